"""Anomaly rules over speculative-decoding accept metrics, and the real-time per-request monitor.

* **garbled** (corrupted KV: the target rejects almost every draft): accept length < 1.4 after more than
  128 generated tokens — on the cumulative metric, the sliding-window one, or either (``signal``).
* **repetition** (degenerate loop: the target accepts almost everything): accept rate > 0.96 once at
  least ``min_verify_steps`` verify steps were seen — cumulative, window, or either.

All comparisons are strict and exact: a metric of exactly 1.4 / 0.96, or exactly 128 generated tokens,
does not fire. Every verdict carries its reason and the numbers behind it.

:class:`SpecMonitor` judges any trace step by step (replay, evaluation); :class:`StepJudge` is the same rules
compiled for one fixed draft-token count, what the SGLang per-step hook runs in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from layersplit.pd.spec.monitor_config import GarbledRule, MonitorConfig, RepetitionRule
from layersplit.pd.spec.metrics import Ratio, RequestSpecState, SpecSnapshot, StepState

HEALTHY, GARBLED, REPETITION = "healthy", "garbled", "repetition"
VERDICTS = (HEALTHY, GARBLED, REPETITION)


@dataclass(frozen=True)
class Verdict:
    """A judgement of one request: ``kind`` in :data:`VERDICTS`, why, and the metrics it was based on."""

    kind: str
    reason: str
    snapshot: SpecSnapshot

    @property
    def anomalous(self) -> bool:
        return self.kind != HEALTHY

    @property
    def numbers(self) -> dict[str, Any]:
        """The metrics behind the verdict (generated, verify_steps, accept_length, accept_rate, window_*)."""
        return self.snapshot.numbers()

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.kind, "reason": self.reason, "numbers": self.numbers}


def _candidates(snap: SpecSnapshot, signal: str, metric: str) -> list[tuple[str, Ratio]]:
    """(label, ratio) pairs the rule looks at, in order: cumulative first, then the window."""
    out = []
    if signal in ("cumulative", "any") and getattr(snap, metric) is not None:
        out.append(("cumulative", getattr(snap, metric)))
    window = getattr(snap, "window_" + metric)
    if signal in ("window", "any") and window is not None:
        out.append((f"window of {snap.window_steps} steps", window))
    return out


def _ratio_text(r: Ratio) -> str:
    return f"{float(r):.4f} ({r.num}/{r.den})"


def check_garbled(snap: SpecSnapshot, rule: GarbledRule) -> str | None:
    """The reason the garbled rule fires on ``snap``, or None."""
    if snap.generated <= rule.after_generated_tokens:
        return None
    for label, length in _candidates(snap, rule.signal, "accept_length"):
        if length.below(rule.threshold):
            return (f"{label} accept length {_ratio_text(length)} < {rule.accept_length_below} "
                    f"after {snap.generated} generated tokens (> {rule.after_generated_tokens})")
    return None


def check_repetition(snap: SpecSnapshot, rule: RepetitionRule) -> str | None:
    """The reason the repetition rule fires on ``snap``, or None."""
    if snap.verify_steps < rule.min_verify_steps:
        return None
    for label, rate in _candidates(snap, rule.signal, "accept_rate"):
        if rate.above(rule.threshold):
            return (f"{label} accept rate {_ratio_text(rate)} > {rule.accept_rate_above} "
                    f"after {snap.verify_steps} verify steps (>= {rule.min_verify_steps})")
    return None


def _healthy_reason(snap: SpecSnapshot) -> str:
    if snap.verify_steps == 0:
        return "no verify steps (speculative decoding off or not started)"
    return f"no rule fired after {snap.generated} generated tokens in {snap.verify_steps} verify steps"


def judge(snap: SpecSnapshot, cfg: MonitorConfig) -> Verdict:
    """Apply both rules to one snapshot (garbled first; the two cannot both hold for sane thresholds)."""
    reason = check_garbled(snap, cfg.garbled)
    if reason:
        return Verdict(GARBLED, reason, snap)
    reason = check_repetition(snap, cfg.repetition)
    if reason:
        return Verdict(REPETITION, reason, snap)
    return Verdict(HEALTHY, _healthy_reason(snap), snap)


class SpecMonitor:
    """Real-time guard: one :class:`RequestSpecState` per request, judged after every verify step.

    The first anomalous verdict of a request is latched (the request is to be aborted); later steps
    return it unchanged.

    Example::

        mon = SpecMonitor(load_monitor_config())
        verdict = mon.observe("req-1", draft_tokens=4, accepted=0)
        if verdict.anomalous: ...   # abort, then RetryController.on_verdict(...)
        final = mon.finish("req-1")
    """

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self._states: dict[str, RequestSpecState] = {}
        self._latched: dict[str, Verdict] = {}

    def observe(self, rid: str, draft_tokens: int, accepted: int) -> Verdict:
        """Record one verify step of request ``rid`` and judge it."""
        if rid in self._latched:
            return self._latched[rid]
        state = self._states.setdefault(rid, RequestSpecState(self.cfg.window_steps))
        state.record(draft_tokens, accepted)
        verdict = judge(state.snapshot(), self.cfg)
        if verdict.anomalous:
            self._latched[rid] = verdict
        return verdict

    def verdict(self, rid: str) -> Verdict:
        """The current verdict of ``rid`` (latched anomaly, else a judgement of its state so far)."""
        if rid in self._latched:
            return self._latched[rid]
        state = self._states.get(rid) or RequestSpecState(self.cfg.window_steps)
        return judge(state.snapshot(), self.cfg)

    def finish(self, rid: str) -> Verdict:
        """The final verdict of ``rid``; forgets the request."""
        verdict = self.verdict(rid)
        self._states.pop(rid, None)
        self._latched.pop(rid, None)
        return verdict

    def active(self) -> int:
        return len(self._states)


class StepJudge:
    """The rules of :func:`judge` compiled to integer comparisons for one fixed ``draft_tokens``: what the
    SGLang per-step hook runs after every verify step. O(1) work, no allocation while nothing fires; the
    step that fires builds its :class:`Verdict` through :func:`judge` itself, so kind, reason and numbers are
    those of :class:`SpecMonitor` on the same counters.

    Example::

        rules = StepJudge(load_monitor_config(), draft_tokens=4)
        state = rules.new_state()
        verdict = rules.step(state, accepted=0)   # None while healthy, else the anomalous Verdict
    """

    def __init__(self, cfg: MonitorConfig, draft_tokens: int) -> None:
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 2:
            raise ValueError(f"draft_tokens: expected an int >= 2 (root + at least one draft), got {draft_tokens!r}")
        g, r, w = cfg.garbled, cfg.repetition, cfg.window_steps
        self.cfg, self.draft_tokens, self.window = cfg, draft_tokens, w
        self.max_accepted = draft_tokens - 1
        self.after_tokens, self.min_steps = g.after_generated_tokens, r.min_verify_steps
        # accept length n/d < a/b  <=>  n*b < a*d ; accept rate n/d > a/b  <=>  n*b > a*d
        self.len_num, self.len_den = g.threshold.numerator, g.threshold.denominator
        self.rate_num, self.rate_den = r.threshold.numerator, r.threshold.denominator
        self.g_cum, self.g_win = g.signal in ("cumulative", "any"), g.signal in ("window", "any")
        self.r_cum, self.r_win = r.signal in ("cumulative", "any"), r.signal in ("window", "any")
        # window metrics over a full window: length = (accepted + w) / w, rate = accepted / (w * drafts)
        self.g_win_limit = self.len_num * w - w * self.len_den  # fires when accepted * len_den < this
        self.r_win_limit = self.rate_num * w * self.max_accepted  # fires when accepted * rate_den > this

    def new_state(self) -> StepState:
        return StepState(self.window)

    def fires(self, state: StepState) -> bool:
        """Whether :func:`judge` would call ``state`` anomalous (integer arithmetic only)."""
        steps, accepted = state.verify_steps, state.accepted
        full = steps >= self.window
        if accepted + steps > self.after_tokens:
            if self.g_cum and (accepted + steps) * self.len_den < self.len_num * steps:
                return True
            if self.g_win and full and state.window_accepted * self.len_den < self.g_win_limit:
                return True
        if steps >= self.min_steps:
            if self.r_cum and accepted * self.rate_den > self.rate_num * steps * self.max_accepted:
                return True
            if self.r_win and full and state.window_accepted * self.rate_den > self.r_win_limit:
                return True
        return False

    def step(self, state: StepState, accepted: int) -> Verdict | None:
        """Record one verify step (``0 <= accepted <= draft_tokens - 1``, checked by the caller) and judge it:
        None while healthy, else the anomalous :class:`Verdict`."""
        state.record(accepted)
        if not self.fires(state):
            return None
        verdict = judge(state.snapshot(self.draft_tokens), self.cfg)
        assert verdict.anomalous, f"StepJudge and judge() disagree: {verdict.reason}"
        return verdict
