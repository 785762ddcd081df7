"""Per-step speculative-decoding monitor inside SGLang's scheduler: judge every verify step, abort at once.

SGLang 0.5.23 settles each verify step per request in the batch result processor
(``SchedulerBatchResultProcessor._resolve_spec_v2_tokens``): it adds the step to ``Req.spec_verify_ct`` and
``Req.spec_num_correct_drafts`` and then calls ``Req.update_spec_correct_drafts_histogram(num_correct_drafts)``
— once per request per step, with that step's accepted drafts already on the host (``accept_lens.tolist()``).
:class:`SpecStepMonitor` is an AFTER hook on that method (``compat.spec_step_target()``). It feeds the
step into a :class:`layersplit.pd.spec.monitor.StepJudge` (the rules of ``configs/monitor.yaml``, cumulative and window,
as integer comparisons; O(1) per request per step, state kept on the ``Req`` itself, no tensor touched, so no
host synchronization beyond SGLang's own). On an anomalous verdict it sets ``req.to_finish`` to
:class:`.abort.SpecMonitorAbort` — SGLang's own mid-decode abort path (``FINISH_ABORT`` with
``HTTPStatus.SERVICE_UNAVAILABLE``, as the scheduler's timeout aborts and ``retract_decode`` use): the same step's
``Req.update_finish_state`` turns it into the finish reason, the output streamer sends it with the tokens of
this step, and nothing more is generated. ``meta_info["finish_reason"]`` carries status 503, the reason and
``layersplit_spec_verdict`` (kind, reason, numbers), so a router retries the request elsewhere.

Every TP rank runs the hook on identical counters, so all ranks abort the same request at the same step; the
log line, the Prometheus counters and the optional per-step JSONL export (``LAYERSPLIT_SGLANG_SPEC_TRACE``,
read by ``layersplit monitor replay``) come from attention-TP rank 0 only.

Counting follows SGLang's definitions with its own ``speculative_num_draft_tokens`` (read once, at the first
step): generated = accepted drafts + one token per verify step. SGLang's ``completion_tokens`` also counts the
first token, which prefill produced, so its accept length at completion is (generated + 1) / verify_ct.
"""

from __future__ import annotations

import logging
from collections import Counter
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path

from layersplit.pd.spec.monitor_config import MonitorConfig, load_monitor_config
from layersplit.pd.spec.monitor import VERDICTS, StepJudge, Verdict
from layersplit.pd.spec.metrics import StepState

log = logging.getLogger(__name__)

STATE_ATTR = "_layersplit_spec_step"  # on each Req: its StepState, then the Verdict it was aborted with
SERVER_FLAG = "--layersplit-spec-monitor"


def enabled(argv: list[str] | None = None) -> bool:
    """On by ``LAYERSPLIT_SGLANG_SPEC_MONITOR=1`` or ``--layersplit-spec-monitor``; the flag also sets the
    variable, so the scheduler processes SGLang starts inherit it."""
    import os
    import sys

    from lsconfig import envs

    if SERVER_FLAG in (sys.argv if argv is None else argv):
        os.environ["LAYERSPLIT_SGLANG_SPEC_MONITOR"] = "1"
    return envs.sglang_spec_monitor_enabled()


def add_server_flag(parser) -> None:
    """Add ``--layersplit-spec-monitor`` to SGLang's argument parser (read from the command line by
    :func:`enabled`, because SGLang runs plug-ins before it parses its arguments)."""
    if SERVER_FLAG not in parser._option_string_actions:
        parser.add_argument(SERVER_FLAG, action="store_true", dest="layersplit_spec_monitor",
                            help="layersplit: judge every speculative verify step and abort garbled or looping "
                                 "requests with a retryable 503 (same as LAYERSPLIT_SGLANG_SPEC_MONITOR=1)")


_PROM: dict = {}


class StepCounters:
    """What the hook has done in this process: requests and steps judged, aborts by verdict, requests left
    unjudged because a step's count was out of range."""

    _METRICS = (("requests", "layersplit_spec_step_requests_total", "Requests judged per verify step."),
                ("aborts", "layersplit_spec_step_aborts_total", "Requests aborted at a verify step, by verdict."))

    def __init__(self) -> None:
        self.requests = self.steps = self.untracked = 0
        self.aborts: Counter = Counter()
        self._prom: dict | None = None  # prometheus_client counters once bound

    def bind_prometheus(self) -> bool:
        """Use prometheus_client's counters too (an SGLang dependency; SGLang's metrics exporter collects them
        from its scheduler processes through PROMETHEUS_MULTIPROC_DIR). False where it is not installed."""
        try:
            from prometheus_client import Counter as PromCounter
        except ImportError:
            return False
        if not _PROM:  # one set per process: prometheus_client refuses a metric name twice
            (_, requests, requests_help), (_, aborts, aborts_help) = self._METRICS
            _PROM["requests"] = PromCounter(requests.removesuffix("_total"), requests_help)
            _PROM["aborts"] = PromCounter(aborts.removesuffix("_total"), aborts_help, ["verdict"])
        self._prom = _PROM
        return True

    def count_request(self) -> None:
        self.requests += 1
        if self._prom:
            self._prom["requests"].inc()

    def count_abort(self, kind: str) -> None:
        self.aborts[kind] += 1
        if self._prom:
            self._prom["aborts"].labels(verdict=kind).inc()

    def to_prometheus(self) -> str:
        """This process's counters in Prometheus text format (zeros included)."""
        (_, req_name, req_help), (_, abort_name, abort_help) = self._METRICS
        lines = [f"# HELP {req_name} {req_help}", f"# TYPE {req_name} counter", f"{req_name} {self.requests}",
                 f"# HELP {abort_name} {abort_help}", f"# TYPE {abort_name} counter"]
        lines += [f'{abort_name}{{verdict="{kind}"}} {self.aborts[kind]}' for kind in VERDICTS[1:]]
        return "\n".join(lines) + "\n"


def _leader() -> bool:
    """Whether this process is attention-TP rank 0 (True when SGLang published no parallel context)."""
    from layersplit.sglang_plugin import compat

    parallel = compat.resolve("get_parallel")()
    for name in ("attn_tp_rank", "tp_rank"):
        try:
            return getattr(parallel, name) == 0
        except (AttributeError, RuntimeError, ValueError):
            continue
    return True


class SpecStepMonitor:
    """The per-step hook and its process state (rules, counters, export file).

    Example (what :func:`layersplit.sglang_plugin.register` does)::

        monitor = SpecStepMonitor()
        HookRegistry.register(compat.spec_step_target(), monitor.after_step, HookType.AFTER)
    """

    def __init__(self, cfg: MonitorConfig | None = None, draft_tokens: int | None = None,
                 trace_path: str | Path | None = None, leader: bool | None = None) -> None:
        self.cfg = cfg or load_monitor_config()
        self.counters = StepCounters()
        self.rules: StepJudge | None = None if draft_tokens is None else StepJudge(self.cfg, draft_tokens)
        self._trace_path = Path(trace_path) if trace_path is not None else None
        self._trace = None
        self._leader = leader
        self._abort_cls = None  # set by bind(), at the first step
        self.off = False  # set by bind() when SGLang's draft-token count is unusable

    def bind(self) -> StepJudge | None:
        """First step in this process: read SGLang's draft-token count and rank, open the export file."""
        from layersplit.sglang_plugin import compat
        from layersplit.sglang_plugin.spec.abort import SpecMonitorAbort

        self._abort_cls = SpecMonitorAbort
        if self.rules is None:
            draft_tokens = getattr(compat.resolve("get_spec")(), "speculative_num_draft_tokens", None)
            try:
                self.rules = StepJudge(self.cfg, draft_tokens)
            except ValueError as exc:  # a serving scheduler is not stopped for its monitor: say so, judge nothing
                log.error("layersplit spec monitor: speculative_num_draft_tokens %s; the monitor stays off", exc)
                self.off = True
                return None
        if self._leader is None:
            self._leader = _leader()
        if self._leader:
            self.counters.bind_prometheus()
            if self._trace_path is not None:
                self._trace = self._trace_path.open("a", buffering=1 << 16)
        return self.rules

    def after_step(self, result, req, num_correct_drafts: int, *rest, **kwargs):
        """HookRegistry AFTER hook on ``Req.update_spec_correct_drafts_histogram(self, num_correct_drafts)``:
        ``fn(result, req, num_correct_drafts)``. Returns None (the method's own result stands)."""
        if self.off:
            return None
        rules = self.rules if self._abort_cls is not None else self.bind()  # bound once, at the first step
        if rules is None:
            return None
        state = getattr(req, STATE_ATTR, None)
        if state is None:
            state = rules.new_state()
            setattr(req, STATE_ATTR, state)
            self.counters.count_request()
        elif state.__class__ is not StepState:
            return None  # aborted already (a step SGLang settles after the abort) or untracked
        if not 0 <= num_correct_drafts <= rules.max_accepted:
            return self._untrack(req, num_correct_drafts)
        self.counters.steps += 1
        verdict = rules.step(state, num_correct_drafts)
        if self._trace is not None:
            self._export(req.rid, state, num_correct_drafts, verdict)
        if verdict is not None:
            self._abort(req, state, verdict)
        return None

    def _abort(self, req, state: StepState, verdict: Verdict) -> None:
        setattr(req, STATE_ATTR, verdict)
        if req.to_finish is None:  # an abort SGLang already decided on (grammar, memory) stands
            req.to_finish = self._abort_cls(verdict)
        if self._leader:
            self.counters.count_abort(verdict.kind)
            log.warning("layersplit spec monitor: abort rid=%s at verify step %d (%d tokens): %s: %s",
                        req.rid, state.verify_steps, state.generated, verdict.kind, verdict.reason)
            if self._trace is not None:
                self._trace.flush()

    def _untrack(self, req, num_correct_drafts: int) -> None:
        """A count outside [0, draft_tokens - 1] (a draft-token count this release changes per step): stop
        judging the request rather than judge it on wrong denominators, and say so once per process."""
        setattr(req, STATE_ATTR, False)
        self.counters.untracked += 1
        if self.counters.untracked == 1 and self._leader:
            log.warning("layersplit spec monitor: request %s reported %r accepted drafts in one step, expected "
                        "0..%d (speculative_num_draft_tokens %d); such requests are not judged", req.rid,
                        num_correct_drafts, self.rules.max_accepted, self.rules.draft_tokens)

    def _export(self, rid, state: StepState, accepted: int, verdict: Verdict | None) -> None:
        """One JSONL line (layersplit/pd/spec/replay.py's per-step form), formatted by hand: json.dumps per step costs
        several times the judging itself."""
        tail = f', "verdict": "{verdict.kind}"}}\n' if verdict is not None else "}\n"
        self._trace.write(f'{{"rid": {_json_str(str(rid))}, "step": {state.verify_steps}, '
                          f'"draft_tokens": {self.rules.draft_tokens}, "accepted": {accepted}{tail}')

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def monitor_hooks(hook_type) -> tuple[list, object]:
    """The plug-in's monitor entries ``(target, hook, type, None)`` and the monitor object: the per-step hook
    where the installed release has the per-step method (:func:`compat.spec_step_target`), else the
    completion-time adapter of :mod:`.completion` as the fallback."""
    from layersplit.sglang_plugin import compat
    from lsconfig import envs

    target = compat.spec_step_target()
    if target is None:
        from layersplit.sglang_plugin.spec.completion import TARGET, MetaInfoMonitor

        log.warning("layersplit spec monitor: sglang %s has none of %s; judging requests at completion only",
                    compat.sglang_version(), [c.split(":")[1] for c in compat.SPEC_STEP_METHODS])
        monitor = MetaInfoMonitor()
        return [(TARGET, monitor.after_spec_metrics, hook_type.AFTER, None)], monitor
    monitor = SpecStepMonitor(trace_path=envs.sglang_spec_trace_path())
    return [(target, monitor.after_step, hook_type.AFTER, None)], monitor
