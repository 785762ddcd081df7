"""Speculative-decoding accept metrics with SGLang's definitions, and the per-request state that feeds them.

One verify step runs the target over ``draft_tokens`` positions (SGLang's ``speculative_num_draft_tokens``:
the last verified token plus ``draft_tokens - 1`` proposed drafts), accepts ``a`` drafts
(``0 <= a <= draft_tokens - 1``) and emits ``a + 1`` tokens (the accepted drafts and one bonus/correction
token). Over a request::

    spec_accept_length = generated tokens / verify steps                        (= completion_tokens / verify_ct)
    spec_accept_rate   = accepted drafts / (verify steps x (draft_tokens - 1))

Both are kept as exact integer ratios (:class:`Ratio`) so threshold checks never round.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True, slots=True)
class Ratio:
    """``num / den`` with exact comparisons against a :class:`~fractions.Fraction` threshold."""

    num: int
    den: int

    def __post_init__(self) -> None:
        assert self.den > 0, f"ratio denominator must be > 0, got {self.den}"

    def below(self, threshold: Fraction) -> bool:
        return self.num * threshold.denominator < threshold.numerator * self.den

    def above(self, threshold: Fraction) -> bool:
        return self.num * threshold.denominator > threshold.numerator * self.den

    def __float__(self) -> float:
        return self.num / self.den


def accept_length(generated: int, verify_steps: int) -> Ratio | None:
    """SGLang ``spec_accept_length``: generated tokens (bonus included) per verify step; None before a step."""
    return Ratio(generated, verify_steps) if verify_steps else None


def accept_rate(accepted: int, verify_steps: int, draft_tokens: int) -> Ratio | None:
    """SGLang ``spec_accept_rate``: accepted drafts / (verify steps x (draft_tokens - 1)); None before a step."""
    return Ratio(accepted, verify_steps * (draft_tokens - 1)) if verify_steps else None


@dataclass(frozen=True)
class SpecSnapshot:
    """What the rules see: cumulative metrics, and sliding-window ones when a full window exists."""

    source: str  # "trace" (per-step state) or "meta_info" (cumulative only)
    generated: int
    verify_steps: int
    accept_length: Ratio | None
    accept_rate: Ratio | None
    window_steps: int = 0
    window_accept_length: Ratio | None = None
    window_accept_rate: Ratio | None = None

    def numbers(self) -> dict[str, Any]:
        """The metrics as plain numbers (floats rounded to 4 places) for verdicts and reports."""
        out: dict[str, Any] = {"generated": self.generated, "verify_steps": self.verify_steps}
        for key in ("accept_length", "accept_rate", "window_accept_length", "window_accept_rate"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(float(value), 4)
        if self.window_accept_length is not None:
            out["window_steps"] = self.window_steps
        return out


class RequestSpecState:
    """Per-request counters fed by each verify step (:meth:`record`), with a sliding window of steps.

    Example::

        state = RequestSpecState(window_steps=32)
        state.record(draft_tokens=4, accepted=2)   # 3 tokens out of one verify step
        state.snapshot().accept_length             # Ratio(3, 1)
    """

    def __init__(self, window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps: expected an int >= 1, got {window_steps}")
        self.window_steps = window_steps
        self.verify_steps = self.generated = self.accepted = self.proposed = 0
        self._window: deque[tuple[int, int]] = deque()  # (accepted, proposed) per step, newest last
        self._win_accepted = self._win_proposed = 0

    def record(self, draft_tokens: int, accepted: int) -> None:
        """One verify step over ``draft_tokens`` positions that accepted ``accepted`` drafts."""
        if draft_tokens < 2:
            raise ValueError(f"draft_tokens: expected an int >= 2 (root + at least one draft), got {draft_tokens}")
        if not 0 <= accepted <= draft_tokens - 1:
            raise ValueError(f"accepted: expected an int in [0, {draft_tokens - 1}], got {accepted}")
        proposed = draft_tokens - 1
        self.verify_steps += 1
        self.generated += accepted + 1
        self.accepted += accepted
        self.proposed += proposed
        self._window.append((accepted, proposed))
        self._win_accepted += accepted
        self._win_proposed += proposed
        if len(self._window) > self.window_steps:
            old_accepted, old_proposed = self._window.popleft()
            self._win_accepted -= old_accepted
            self._win_proposed -= old_proposed

    def snapshot(self) -> SpecSnapshot:
        steps = self.verify_steps
        full = steps >= self.window_steps
        w = self.window_steps
        return SpecSnapshot(
            source="trace", generated=self.generated, verify_steps=steps,
            accept_length=Ratio(self.generated, steps) if steps else None,
            accept_rate=Ratio(self.accepted, self.proposed) if steps else None,
            window_steps=w if full else 0,
            # window generated = accepted + one token per step
            window_accept_length=Ratio(self._win_accepted + w, w) if full else None,
            window_accept_rate=Ratio(self._win_accepted, self._win_proposed) if full else None,
        )


class StepState:
    """:class:`RequestSpecState` for a request whose ``draft_tokens`` is fixed (as in an SGLang server), kept
    for the per-step hook: O(1) work and no allocation per :meth:`record` (a ring of accepted counts).

    Example::

        state = StepState(window_steps=32)
        state.record(2)                        # one verify step that accepted 2 drafts
        state.snapshot(draft_tokens=4)         # the same SpecSnapshot RequestSpecState gives
    """

    __slots__ = ("window_steps", "verify_steps", "accepted", "window_accepted", "_ring", "_pos")

    def __init__(self, window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps: expected an int >= 1, got {window_steps}")
        self.window_steps = window_steps
        self.verify_steps = self.accepted = self.window_accepted = self._pos = 0
        self._ring = [0] * window_steps  # accepted drafts of the last window_steps steps

    def record(self, accepted: int) -> None:
        """One verify step that accepted ``accepted`` drafts (the caller checks the range)."""
        pos = self._pos
        self.window_accepted += accepted - self._ring[pos]  # the slot holds the step leaving the window
        self._ring[pos] = accepted
        self._pos = pos + 1 if pos + 1 < self.window_steps else 0
        self.verify_steps += 1
        self.accepted += accepted

    @property
    def generated(self) -> int:
        """Tokens out of the verify steps: the accepted drafts plus one bonus/correction token per step."""
        return self.accepted + self.verify_steps

    def snapshot(self, draft_tokens: int) -> SpecSnapshot:
        steps, w, proposed = self.verify_steps, self.window_steps, draft_tokens - 1
        full = steps >= w
        return SpecSnapshot(
            source="trace", generated=self.generated, verify_steps=steps,
            accept_length=Ratio(self.generated, steps) if steps else None,
            accept_rate=Ratio(self.accepted, steps * proposed) if steps else None,
            window_steps=w if full else 0,
            window_accept_length=Ratio(self.window_accepted + w, w) if full else None,
            window_accept_rate=Ratio(self.window_accepted, w * proposed) if full else None,
        )


def _exact_float(value: Any, name: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    return Fraction(repr(float(value)))


def _count(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return value


def snapshot_from_meta(meta: dict[str, Any]) -> SpecSnapshot:
    """A cumulative snapshot from SGLang ``meta_info`` (``completion_tokens``, ``spec_verify_ct``,
    ``spec_accept_rate``, optional ``spec_accept_length``). No window metrics exist here.

    Accept length is recomputed exactly as completion_tokens / spec_verify_ct; a given
    ``spec_accept_length`` must agree with it. ``spec_accept_rate`` is taken as the decimal it prints as.
    """
    generated, steps = _count(meta, "completion_tokens"), _count(meta, "spec_verify_ct")
    length = accept_length(generated, steps)
    if "spec_accept_length" in meta and length is not None:
        given = _exact_float(meta["spec_accept_length"], "spec_accept_length")
        if abs(float(given) - float(length)) > 1e-3 * max(1.0, float(length)):
            raise ValueError(f"spec_accept_length: expected completion_tokens / spec_verify_ct = "
                             f"{float(length):.4f}, got {meta['spec_accept_length']!r}")
    rate = None
    if "spec_accept_rate" in meta and steps:
        exact_rate = _exact_float(meta["spec_accept_rate"], "spec_accept_rate")
        if not 0 <= exact_rate <= 1:
            raise ValueError(f"spec_accept_rate: expected a number in [0, 1], got {meta['spec_accept_rate']!r}")
        rate = Ratio(exact_rate.numerator, exact_rate.denominator)
    return SpecSnapshot(source="meta_info", generated=generated, verify_steps=steps,
                        accept_length=length, accept_rate=rate)
