"""Action policy for anomalous verdicts: abort the request and retry it through the router.

Retries are bounded (``RetryPolicy.max_retries`` per request), go to an instance the request has not run
on yet where one exists, and wait an exponential backoff (``initial x multiplier^(n-1)``, capped). Counters
by verdict are exposed in the Prometheus text exposition format.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from layersplit.pd.spec.monitor_config import RetryPolicy
from layersplit.pd.spec.monitor import VERDICTS, Verdict

CONTINUE, RETRY, GIVE_UP = "continue", "retry", "give_up"


class Router(Protocol):
    """The load balancer seam the policy drives (an SGLang router, or a fake in tests)."""

    def instances(self) -> Sequence[str]:
        """Names of the serving instances a request may be sent to, in preference order."""

    def abort(self, rid: str, instance: str, reason: str) -> None:
        """Abort ``rid`` on ``instance`` (frees its KV; the client does not see the partial output)."""

    def retry(self, rid: str, instance: str, delay_s: float) -> None:
        """Resubmit ``rid`` to ``instance`` after ``delay_s`` seconds."""


@dataclass(frozen=True)
class Action:
    """What the policy did: ``continue`` (healthy), ``retry`` (aborted and resubmitted), ``give_up``
    (aborted, retries exhausted). ``attempt`` counts retries of this request so far."""

    kind: str
    instance: str | None = None
    delay_s: float = 0.0
    attempt: int = 0


def backoff_delay(policy: RetryPolicy, retry_number: int) -> float:
    """Delay before retry ``retry_number`` (1-based): initial x multiplier^(n-1), capped at backoff_max_s."""
    if retry_number < 1:
        raise ValueError(f"retry_number: expected an int >= 1, got {retry_number}")
    return min(policy.backoff_max_s, policy.backoff_initial_s * policy.backoff_multiplier ** (retry_number - 1))


def pick_instance(instances: Sequence[str], history: Sequence[str], prefer_other: bool) -> str:
    """The instance for the next try. ``history`` lists where the request ran, oldest first (the last is
    the one it was just aborted on). Preferring others: a never-tried instance in router order, else the
    least recently tried one that is not the current; with a single instance, that instance."""
    if not instances:
        raise ValueError("instances: expected at least one serving instance, got none")
    current = history[-1] if history else None
    if not prefer_other:
        return current if current in instances else instances[0]
    untried = [name for name in instances if name not in history]
    if untried:
        return untried[0]
    others = [name for name in instances if name != current] or list(instances)
    last_used = {name: i for i, name in enumerate(history)}
    return min(others, key=lambda name: last_used[name])


@dataclass
class MonitorCounters:
    """Counters by verdict: judged requests, aborts, retries, and retries exhausted."""

    verdicts: Counter = field(default_factory=Counter)
    aborts: Counter = field(default_factory=Counter)
    retries: Counter = field(default_factory=Counter)
    exhausted: Counter = field(default_factory=Counter)

    _METRICS = (
        ("verdicts", "pd_spec_monitor_verdicts_total", "Requests judged by the speculative-decoding monitor."),
        ("aborts", "pd_spec_monitor_aborts_total", "Requests aborted for an anomalous verdict."),
        ("retries", "pd_spec_monitor_retries_total", "Aborted requests resubmitted through the router."),
        ("exhausted", "pd_spec_monitor_retries_exhausted_total", "Aborted requests given up after max retries."),
    )

    def to_prometheus(self) -> str:
        """The counters in Prometheus text exposition format (one sample per verdict, zeros included)."""
        lines = []
        for attr, name, help_text in self._METRICS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            counts = getattr(self, attr)
            kinds = VERDICTS if attr == "verdicts" else VERDICTS[1:]
            lines += [f'{name}{{verdict="{kind}"}} {counts[kind]}' for kind in kinds]
        return "\n".join(lines) + "\n"


class RetryController:
    """Turns verdicts into router calls. Call :meth:`on_verdict` once per request with its final verdict,
    or as soon as the monitor returns an anomalous one.

    Example::

        ctl = RetryController(router, cfg.retry)
        action = ctl.on_verdict("req-1", "decode-0", verdict)   # Action(kind="retry", instance="decode-1", ...)
    """

    def __init__(self, router: Router, policy: RetryPolicy, counters: MonitorCounters | None = None) -> None:
        self.router = router
        self.policy = policy
        self.counters = counters or MonitorCounters()
        self._history: dict[str, list[str]] = {}  # rid -> instances it ran on, oldest first
        self._retries: Counter = Counter()  # rid -> retries issued

    def retries(self, rid: str) -> int:
        """Retries issued for ``rid`` so far."""
        return self._retries[rid]

    def on_verdict(self, rid: str, instance: str, verdict: Verdict) -> Action:
        self.counters.verdicts[verdict.kind] += 1
        if not verdict.anomalous:
            return Action(CONTINUE, instance, attempt=self.retries(rid))
        history = self._history.setdefault(rid, [])
        if not history or history[-1] != instance:
            history.append(instance)
        self.router.abort(rid, instance, f"{verdict.kind}: {verdict.reason}")
        self.counters.aborts[verdict.kind] += 1
        used = self.retries(rid)
        if used >= self.policy.max_retries:
            self.counters.exhausted[verdict.kind] += 1
            return Action(GIVE_UP, None, attempt=used)
        target = pick_instance(self.router.instances(), history, self.policy.prefer_other_instance)
        delay = backoff_delay(self.policy, used + 1)
        history.append(target)
        self._retries[rid] += 1
        self.router.retry(rid, target, delay)
        self.counters.retries[verdict.kind] += 1
        return Action(RETRY, target, delay, attempt=used + 1)

    def finished(self, rid: str) -> None:
        """Forget ``rid`` (it completed, or the client got the error)."""
        self._history.pop(rid, None)
        self._retries.pop(rid, None)
