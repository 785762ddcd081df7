"""Random walks over the same state graph, for bounds too large to explore every interleaving of (TLC's
simulation mode): ``python -m tools.pd_check --simulate WALKS``.

A walk starts in the initial state and takes one enabled action at a time until nothing is owed and it
stops, or ``max_steps`` pass: at each step, with probability ``fault_rate`` an optional action (a fault or
a cancel, while the budgets last) and otherwise an owed one (an event, a delivery, a heal), uniformly
within the group; where nothing is owed the walk stops unless it draws an optional action. Every state it
reaches is checked against the safety invariants and every state where nothing is owed against the
liveness ones — the explorer's checks, the explorer's actions (:func:`~tools.pd_check.world.enabled`),
its channel capacity (an action that would exceed it is put back and another drawn). Walk ``i`` draws
from ``random.Random(f"{seed}:{i}")``, so the walks, and the first violating one, are the same for any
number of worker processes (unless ``timeout_s`` cuts the run short).

A walk that finds nothing proves nothing about the states it did not visit: the result is never
``complete``. A violation's trace is then shortened (:func:`minimize`): steps are removed, in chunks
halving down to one, while the replay of what is left still ends in a violation of the same kind — a
trace from which no single step can be removed (:mod:`tools.pd_check.minimize`), not necessarily a
shortest one (``shortest: false``; ``--shortest`` re-runs the breadth-first search to that depth). What a
clean run has left unseen is estimated from the classes of the states the walks ended in
(``end_classes``: :mod:`tools.pd_check.coverage`).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

from tools.pd_check.bounds import CheckBounds
from tools.pd_check.coverage import end_class_estimates
from tools.pd_check.explorer import _class, _over_capacity, _quiet, replay, shortest
from tools.pd_check.invariants import terminal_violations, violations
from tools.pd_check.minimize import minimize
from tools.pd_check.parallel import map_spans, resolve_workers
from tools.pd_check.snapshot import Snapshots
from tools.pd_check.world import OWED, apply, build_world, enabled, label
from layersplit.pd.abort.guards import guards_off


@dataclass(frozen=True)
class WalkPlan:
    """walks: how many; seed: walk i draws from ``Random(f"{seed}:{i}")``; max_steps: a walk stops there
    (counted as truncated); fault_rate: the chance per step of an optional action (fault or cancel) while
    one is enabled; minimize: shorten a violation's trace."""

    walks: int
    seed: int = 0
    max_steps: int = 500
    fault_rate: float = 0.1
    minimize: bool = True

    def __post_init__(self) -> None:
        for name, low in (("walks", 1), ("seed", 0), ("max_steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if isinstance(self.fault_rate, bool) or not isinstance(self.fault_rate, (int, float)) \
                or not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"fault_rate: expected a number in [0, 1], got {self.fault_rate!r}")


# how walks ended: nothing owed (and no optional action drawn), at max_steps, every enabled action over the
# channel capacity, at a violation (the run's last walk)
_ENDS = ("terminal_walks", "truncated_walks", "stuck_walks", "violating_walks")
_COUNTS = ("walks", "steps", *_ENDS, "pruned_by_channel_capacity")


@dataclass
class _Span:
    counts: dict = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    faults_spent: dict = field(default_factory=dict)  # faults a walk spent -> walks
    ends: Counter = field(default_factory=Counter)  # the class of a terminal walk's last state -> walks
    found: tuple | None = None  # (walk index, violations, labels)
    stopped: bool = False
    classes: set | None = None  # the classes of the states / the terminal states the walks reached, if asked
    terminal_classes: set | None = None


def simulate(bounds: CheckBounds, plan: WalkPlan, workers: int | str = 1, classes: set | None = None,
             terminal_classes: set | None = None, progress=None) -> dict:
    """Run ``plan.walks`` random walks within ``bounds`` (stopping at the first violation, or after
    ``bounds.timeout_s``); the JSON-ready result, shaped like :func:`~tools.pd_check.explorer.run_check`'s
    (``counterexample`` holds the shortened trace, ``raw_trace_length`` the walk's own). ``classes`` /
    ``terminal_classes``: if given, filled with the class of every state / every state where nothing is
    owed that a walk reached — as ``run_check`` fills them, so a test can hold the walks' states inside the
    exhaustive search's and measure how much of it they covered. ``end_classes``: the estimates over the
    classes of the walks' end states (:func:`~tools.pd_check.coverage.end_class_estimates`). ``progress(walks,
    steps, "walks")``: told after each span of walks."""
    workers = resolve_workers(workers)
    collect = (classes is not None, terminal_classes is not None)
    start = time.perf_counter()
    deadline = start + bounds.timeout_s
    total, faults_spent, ends, found, stopped = _Span(), {}, Counter(), None, None
    with guards_off(bounds.guards_off), _quiet():
        for span in map_spans(lambda a, b: _walks(bounds, plan, a, b, deadline, collect), plan.walks, workers):
            for mine, theirs in ((classes, span.classes), (terminal_classes, span.terminal_classes)):
                if mine is not None:
                    mine |= theirs
            for key in _COUNTS:
                total.counts[key] += span.counts[key]
            for spent, n in span.faults_spent.items():
                faults_spent[spent] = faults_spent.get(spent, 0) + n
            ends.update(span.ends)
            if progress is not None:
                progress(total.counts["walks"], total.counts["steps"], "walks")
            if span.found is not None:
                found = span.found
                break
            if span.stopped:
                stopped = f"timeout ({bounds.timeout_s} s)"
                break
        walked_s = time.perf_counter() - start
        counterexample, raw, minimal = None, None, False
        if found is not None:
            raw, trace = len(found[2]), found[2]
            if plan.minimize:
                trace, minimal = minimize(bounds, trace, found[1], deadline)
            counterexample = {"violation": replay(bounds, trace)["violation"] if plan.minimize else found[1],
                              "trace": trace}
    seconds = time.perf_counter() - start
    return {"mode": "simulation", "bounds": bounds.to_dict(), "plan": vars(plan).copy(), **total.counts,
            "faults_spent": {str(k): faults_spent[k] for k in sorted(faults_spent)},
            "violating_walk": None if found is None else found[0], "raw_trace_length": raw,
            "one_minimal": minimal, "end_classes": end_class_estimates(ends),
            "violations": [] if found is None else [v.split(":")[0] for v in counterexample["violation"]],
            "counterexample": counterexample, "complete": False, "shortest": False, "stopped": stopped,
            "workers": workers, "seconds": round(seconds, 2), "walk_seconds": round(walked_s, 2),
            "steps_per_s": round(total.counts["steps"] / max(walked_s, 1e-9), 1),
            "note": "random simulation: walks over pd's own protocol code within the bounds, every state they reach "
                    "checked; not exhaustive (a clean run proves nothing about the states no walk reached)"}


def shortest_walk(bounds: CheckBounds, result: dict, workers: int | str = 1) -> dict:
    """``result`` (a simulation's) with its counterexample replaced by a shortest one where the breadth-first
    search without reductions (:func:`~tools.pd_check.explorer.shortest`, no deeper than the walk's shortened
    trace, within ``bounds.timeout_s`` again) finds one; ``shortest_search`` says what that search did."""
    if not result["counterexample"]:
        return result
    search = shortest(bounds, result, workers=workers)
    summary = {k: search[k] for k in ("states", "depth", "seconds", "complete", "stopped")}
    if not search["counterexample"]:
        return {**result, "shortest_search": summary}  # stopped first: the walk's trace stays
    return {**result, "shortest_search": summary, "counterexample": search["counterexample"], "shortest": True,
            "violations": search["violations"]}


def _walks(bounds: CheckBounds, plan: WalkPlan, first: int, end: int, deadline: float,
           collect: tuple[bool, bool] = (False, False)) -> _Span:
    """Walks ``first .. end - 1``, in order, until one finds a violation or the deadline passes."""
    span = _Span(classes=set() if collect[0] else None, terminal_classes=set() if collect[1] else None)
    root = build_world(bounds)
    with Snapshots(root) as snap:  # one per span: every walk starts from a copy of the same initial world
        initial = snap.dumps(root)
        for index in range(first, end):
            if time.perf_counter() > deadline:
                span.stopped = True
                break
            span.counts["walks"] += 1
            outcome, spent, broken, labels = _walk(snap, initial, plan, index, span)
            span.counts[outcome] += 1
            span.faults_spent[spent] = span.faults_spent.get(spent, 0) + 1
            if broken:
                span.found = (index, broken, labels)
                break
    return span


def _walk(snap: Snapshots, initial: bytes, plan: WalkPlan, index: int, span: _Span) -> tuple[str, int, list, list]:
    """One walk from a copy of the initial world: (how it ended, faults spent, the violations found, the
    labels of its steps)."""
    world = snap.loads(initial)
    return _walk_from(world, _Rewind(snap, world, blob=initial), plan, random.Random(f"{plan.seed}:{index}"), span)


class _Rewind:
    """How a walk takes back a step that went over the channel capacity: a snapshot every ``every`` steps
    kept and the actions applied since, re-applied onto a copy of it (applying is deterministic, so that is
    the world as it was). A snapshot per step cost ~150 us, more than the step itself; a step taken back is
    rarer (one in six at the target bound) and costs a load and up to ``every`` - 1 steps."""

    def __init__(self, snap: Snapshots, world, every: int = 8, blob: bytes | None = None) -> None:
        """``blob``: ``world``'s snapshot, if the caller has one."""
        self.snap, self.every = snap, every
        self.blob, self.since = snap.dumps(world) if blob is None else blob, []

    def kept(self, world, action: tuple) -> None:
        """``action`` was applied to ``world`` and stays."""
        self.since.append(action)
        if len(self.since) >= self.every:
            self.blob, self.since = self.snap.dumps(world), []

    def back(self):
        """A copy of the world after the last step that stayed."""
        world = self.snap.loads(self.blob)
        for action in self.since:
            apply(world, action)
        return world


def _walk_from(world, rewind: _Rewind, plan: WalkPlan, rng: random.Random, span: _Span) -> tuple[str, int, list, list]:
    labels, counts = [], span.counts
    for _ in range(plan.max_steps):
        actions = enabled(world)
        owed = [a for a in actions if a[0] in OWED]
        if span.classes is not None:
            span.classes.add(_class(world))
        if not owed and span.terminal_classes is not None:
            span.terminal_classes.add(_class(world))
        if not owed:
            broken = terminal_violations(world)
            if broken:
                return "violating_walks", world.faults_used, broken, labels
        optional = [a for a in actions if a[0] not in OWED]
        groups = [optional, owed] if optional and rng.random() < plan.fault_rate else [owed, optional]
        if not owed and groups[0] is not optional:  # nothing owed, no optional action drawn
            span.ends[_class(world)] += 1
            return "terminal_walks", world.faults_used, [], labels
        world, step = _step(world, rewind, groups, rng, counts)
        if step is None:
            return "stuck_walks", world.faults_used, [], labels  # every enabled action exceeds the capacity
        labels.append(step[0])
        counts["steps"] += 1
        broken = step[1] or violations(world)
        if broken:
            return "violating_walks", world.faults_used, broken, labels
    return "truncated_walks", world.faults_used, [], labels


def _step(world, rewind: _Rewind, groups: list[list[tuple]], rng: random.Random, counts: dict):
    """Apply an action drawn from the first group that has one within the channel capacity:
    (the world after it, (its label, [exception] or [])), or (world, None) if none fits."""
    for group in groups:
        candidates = list(group)
        rng.shuffle(candidates)
        for action in candidates:
            text = label(world, action)
            try:
                apply(world, action)
            except Exception as exc:  # the implementation itself failed: a bug the trace reproduces
                return world, (text, [f"exception: {exc!r}"])
            if not _over_capacity(world, world.bounds.channel_capacity):
                rewind.kept(world, action)
                return world, (text, [])
            counts["pruned_by_channel_capacity"] += 1
            world = rewind.back()
    return world, None
