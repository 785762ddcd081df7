"""Shortening a counterexample: remove steps while what is left still breaks the same way.

The steps are labels (what a trace reads and a replay matches). Removing a step that numbers something —
a submit or a retry opens a room and admits it at the next epoch, a post opens a batch, a release makes a
new page generation — renumbers what comes after it, so an exact replay of the rest would diverge at the
first later step that names one. The replay here matches a step *up to those numbers*: each label's
rooms, epochs, generations, batch ids and pages are renamed by first appearance (and a floor matches any),
in the trace and in the replayed run alike, so "room 2" of the trace matches the run's room 1 when it is
the first room either names. That is only how a candidate's steps are found; a candidate is kept only if
its replay — the protocol's own code, step by step — ends in a violation of the same kind, and the trace
returned is the labels that replay really applied (an exact replay, :func:`~tools.pd_check.explorer.replay`,
reproduces it).
"""

from __future__ import annotations

import re
import time

from tools.pd_check.bounds import CheckBounds
from tools.pd_check.explorer import replay

# "room 3", "epoch 2", "gen 1", "batch 0", "decode page 1", "pages [0, 1]", "from page 0" (a source page of
# prefill's: its own numbering); rids, ranks, layers, incarnations and decode lives keep their numbers. A floor
# is matched as any floor: it is the least epoch decode still waits on, so removing a request moves it
# relative to the epochs (the floor 0 below epoch 1 becomes the floor 0 of epoch 0)
_NUMBERED = re.compile(r"\b(room|epoch|gen|batch|decode page|from page|pages) (\d+|\[[\d, ]*\])")
_FLOOR = re.compile(r"\bfloor \d+")
_DIGITS = re.compile(r"\d+")
_KIND = {"pages": "decode page"}  # a request's pages are decode's


def minimize(bounds: CheckBounds, trace: list[str], violation: list[str],
             deadline: float | None = None) -> tuple[list[str], bool]:
    """``trace`` with steps removed — chunks of half its length, then halving to single steps — while its
    replay still ends in a violation of the kind of ``violation[0]`` (cut at the step where it does), and
    whether it got to the end: no single step can be removed any more. Stops early, with what it has,
    after ``deadline`` (a ``time.perf_counter()`` value)."""
    kind = violation[0].split(":")[0]
    chunk = max(1, len(trace) // 2)
    while True:
        i, removed = 0, False
        while i < len(trace):
            if deadline is not None and time.perf_counter() > deadline:
                return trace, False
            shorter = still_breaks(bounds, trace[:i] + trace[i + chunk:], kind)
            if shorter is None:
                i += chunk
            else:
                trace, removed = shorter, True
        if chunk == 1 and not removed:
            return trace, True
        chunk = max(1, chunk // 2) if not removed else chunk


def still_breaks(bounds: CheckBounds, trace: list[str], kind: str) -> list[str] | None:
    """The labels a replay of ``trace`` (matched up to renumbering) really applied, up to the violation of
    kind ``kind`` it ends in; None if a step finds no match or the replay breaks otherwise or not at all."""
    outcome = replay(bounds, trace, match=_Renumbered(trace))
    if outcome["diverged"] is None and any(v.split(":")[0] == kind for v in outcome["violation"]):
        return outcome["applied"]
    return None


class _Renumbered:
    """A replay's step matcher: an enabled action's label matches step i when both read the same once
    renamed by first appearance — the trace's names over the trace, the run's over the steps it took."""

    def __init__(self, trace: list[str]) -> None:
        names: dict = {}
        self.wanted = [canonical(text, names) for text in trace]
        self.names: dict = {}

    def __call__(self, text: str, i: int) -> bool:
        trial = dict(self.names)
        if canonical(text, trial) != self.wanted[i]:
            return False
        self.names = trial  # the replay takes the first match: its names are the run's from now on
        return True


def canonical(text: str, names: dict) -> str:
    """``text`` with each numbered name renamed by its first appearance in ``names`` (updated)."""
    def name(kind: str, number: str) -> str:
        key = (_KIND.get(kind, kind), int(number))
        if key not in names:
            names[key] = sum(1 for k in names if k[0] == key[0])
        return f"#{names[key]}"

    def rename(match: re.Match) -> str:
        kind, value = match.group(1), match.group(2)
        if value.startswith("["):
            return f"{kind} [{', '.join(name(kind, n) for n in _DIGITS.findall(value))}]"
        return f"{kind} {name(kind, value)}"
    return _NUMBERED.sub(rename, _FLOOR.sub("floor *", text))
