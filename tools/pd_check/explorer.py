"""Breadth-first explicit-state exploration of the PD abort protocol, over the protocol's own code.

Each state is a pickled :class:`~tools.pd_check.world.World` (its frozen configuration shared, not copied:
:mod:`tools.pd_check.snapshot`); every enabled action is applied to a fresh copy
(the last one to the state itself, which is then spent), the result hashed (:mod:`tools.pd_check.hashing`) and,
if new, checked (:mod:`tools.pd_check.invariants`) and queued. Where the partial-order reduction applies
(:mod:`tools.pd_check.por`) only a persistent set of actions is expanded. A state in which nothing is owed any
more (no pending event, no message in flight) is terminal and must also pass the liveness checks.
Breadth-first, so without the partial-order reduction the first violation found has a shortest trace (with
it, ``shortest`` says whether that still holds). A transition is stored as its action, not its label:
the labels of a counterexample are rendered at the end, by replaying its actions from the initial state.
A level is expanded in spans of frontier states, each reading the search as the level began and merged
in order — here, or in worker processes (:mod:`tools.pd_check.parallel`) with the same outcome.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial

from tools.pd_check.bounds import CheckBounds
from tools.pd_check.hashing import Hasher
from tools.pd_check.invariants import terminal_violations, violations
from tools.pd_check.parallel import map_spans, resolve_workers
from tools.pd_check.por import persistent_set
from tools.pd_check.snapshot import Snapshots
from tools.pd_check.state import fingerprint
from tools.pd_check.world import apply, build_world, enabled, label, owed
from layersplit.pd.abort.guards import guards_off

_T0 = [0.0]  # the running check's start (for states/s)


def run_check(bounds: CheckBounds, classes: set | None = None, terminal_classes: set | None = None,
              workers: int | str = 1, progress=None) -> dict:
    """Explore every interleaving within ``bounds``; returns the JSON-ready result (``violations`` empty
    when none was found; else ``counterexample`` holds the trace, one label per step — a shortest one
    when ``shortest``). ``classes`` / ``terminal_classes``: if given, filled with the class (the fingerprint
    under symmetry and stale events) of every state / every terminal state explored — what the cross-checks
    compare between a reduced and an unreduced run (the partial-order reduction keeps every terminal class,
    not every state). ``workers``: processes expanding each level (an integer, or ``"auto"``: one per CPU);
    the states, transitions and verdict are the same for any count (see :mod:`tools.pd_check.parallel`).
    ``progress(states, depth)``: told after each span of frontier states is merged (at most 512 states apart)."""
    workers = resolve_workers(workers)
    start = _T0[0] = time.perf_counter()
    with guards_off(bounds.guards_off), _quiet():
        result = _Search(bounds, classes, terminal_classes, workers, progress).run(start)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def shortest(bounds: CheckBounds, result: dict, workers: int | str = 1, progress=None) -> dict:
    """``result`` if its counterexample is a shortest one (or it has none); else the result of a re-run
    without the partial-order reduction, no deeper than that counterexample: breadth-first over every
    interleaving, so its first violation has a shortest trace."""
    if result["shortest"] or not result["counterexample"]:
        return result
    depth = len(result["counterexample"]["trace"])
    return run_check(replace(bounds, por=False, max_depth=depth), workers=workers, progress=progress)


_STATS = ("transitions", "terminal_states", "pruned_by_channel_capacity", "por_reduced_states",
          "por_proviso_expansions")


@dataclass
class _Span:
    """What expanding a run of frontier states found: merged into the search in frontier order."""
    children: list = field(default_factory=list)  # (fingerprint, parent's, action, pickled state), maybe known
    fresh: set = field(default_factory=set)  # their fingerprints (a duplicate within the span is skipped)
    stats: dict = field(default_factory=lambda: dict.fromkeys(_STATS, 0))
    classes: set = field(default_factory=set)
    terminal_classes: set = field(default_factory=set)
    memo: dict = field(default_factory=dict)  # the hasher's new entries
    found: tuple | None = None  # (depth offset, broken, trace end) of the first violation


class _Search:
    def __init__(self, bounds: CheckBounds, classes: set | None, terminal_classes: set | None,
                 workers: int = 1, progress=None) -> None:
        self.bounds, self.classes, self.terminal_classes, self.workers = bounds, classes, terminal_classes, workers
        self.progress = progress or (lambda states, depth: None)
        self.hashed = Hasher(bounds.symmetry, bounds.stale_events)
        self.parents: dict[int, tuple[int | None, tuple | None]] = {}  # fingerprint -> (parent's, action)
        self.stats = {**dict.fromkeys(_STATS, 0), "frontier_sizes": []}
        self.next_frontier: list = []
        self.next_fps: set[int] = set()  # fingerprints one level deeper than the states being expanded

    def run(self, start: float) -> dict:
        root = build_world(self.bounds)
        with Snapshots(root) as self.snap:  # before any worker is forked: they load its blobs too
            return self._search(root, start)

    def _search(self, root, start: float) -> dict:
        b = self.bounds
        root_fp = self.hashed(root)
        self.parents[root_fp] = (None, None)
        if self.classes is not None:
            self.classes.add(_class(root))
        frontier = [(root_fp, self.snap.dumps(root))]
        depth, stopped = 0, None
        while frontier and stopped is None:
            self.stats["frontier_sizes"].append(len(frontier))
            self.next_frontier, self.next_fps = [], set()
            job = partial(self._expand_span, frontier)
            for span in map_spans(job, len(frontier), self.workers):
                found = self._merge(span)
                if found is not None:
                    return self._result(depth + found[0], None, *found[1:])
                self.progress(len(self.parents), depth)
                if len(self.parents) >= b.max_states:
                    stopped = f"max_states ({b.max_states})"
                    break
                if time.perf_counter() - start > b.timeout_s:
                    stopped = f"timeout ({b.timeout_s} s)"
                    break
            frontier = self.next_frontier
            if frontier and stopped is None and b.max_depth is not None and depth >= b.max_depth:
                stopped, frontier = f"max_depth ({b.max_depth})", []
            depth += bool(frontier)
        return self._result(depth, stopped, [], None)

    def _merge(self, span: _Span):
        """Add a span's new children (in order: the first parent found is kept) and its counts; returns its
        violation, if it found one."""
        for child_fp, fp, action, blob in span.children:
            if child_fp not in self.parents:
                self.parents[child_fp] = (fp, action)
                self.next_frontier.append((child_fp, blob))
                self.next_fps.add(child_fp)
        for key in _STATS:
            self.stats[key] += span.stats[key]
        for mine, theirs in ((self.classes, span.classes), (self.terminal_classes, span.terminal_classes)):
            if mine is not None:
                mine |= theirs
        self.hashed.memo.update(span.memo)
        return span.found

    def _expand_span(self, frontier: list, start: int, end: int) -> _Span:
        """Expand ``frontier[start:end]``, reading the search (what is known, what is one level deeper) but
        not changing it: the same here or in a worker process."""
        span, memo_before = _Span(), len(self.hashed.memo)
        for fp, blob in frontier[start:end]:
            span.found = self._expand(fp, blob, span)
            if span.found is not None:
                break
        if self.workers > 1:  # in a worker: hand its new memo entries back (dicts keep insertion order)
            span.memo = dict(itertools.islice(self.hashed.memo.items(), memo_before, None))
        return span

    def _expand(self, fp: int, blob: bytes, span: _Span):
        """Expand one state; a violation found is returned as (depth offset, broken, trace end)."""
        world = self.snap.loads(blob)
        actions = enabled(world)
        if not owed(actions):
            span.stats["terminal_states"] += 1
            if self.terminal_classes is not None:
                span.terminal_classes.add(_class(world))
            broken = terminal_violations(world)
            if broken:
                return 0, broken, (fp, None)
        ample = persistent_set(world, actions) if self.bounds.por else None
        if ample is not None:
            outcome = self._children(fp, blob, None, ample, span, proviso=True)
            if not (isinstance(outcome, tuple) and outcome[0] == "expand"):
                span.stats["por_reduced_states"] += 1
                return outcome
            span.stats["por_proviso_expansions"] += 1
            done = ample[:outcome[1] + 1]  # applied already (their new children are in)
            actions = [a for a in actions if a not in done]
        return self._children(fp, blob, world, actions, span, proviso=False)

    def _children(self, fp, blob, world, actions, span: _Span, proviso: bool):
        """Apply each of ``actions`` to a copy (the last to ``world`` itself, if given). With ``proviso``:
        return ("expand", i) as soon as the i-th child is pruned or an older state — one no deeper than
        this one: the breadth-first cycle proviso (see tools.pd_check.por)."""
        for i, action in enumerate(actions):
            child = world if world is not None and i == len(actions) - 1 else self.snap.loads(blob)
            span.stats["transitions"] += 1
            try:
                apply(child, action)
            except Exception as exc:  # the implementation itself failed: a bug the trace reproduces
                return 1, [f"exception: {exc!r}"], (fp, action)
            if _over_capacity(child, self.bounds.channel_capacity):
                span.stats["pruned_by_channel_capacity"] += 1
                if proviso:
                    return "expand", i
                continue
            child_fp = self.hashed(child)
            if child_fp in self.parents or child_fp in span.fresh:
                if proviso and child_fp in self.parents and child_fp not in self.next_fps:  # an edge back up
                    return "expand", i
                continue
            span.fresh.add(child_fp)
            if self.classes is not None:
                span.classes.add(_class(child))
            broken = violations(child)
            span.children.append((child_fp, fp, action, None if broken else self.snap.dumps(child)))
            if broken:
                return 1, broken, (child_fp, None)
        return None

    def _result(self, depth, stopped, broken, end) -> dict:
        b, counterexample = self.bounds, None
        if end is not None:
            counterexample = {"violation": broken, "trace": _labels(b, self._path(*end))}
        return {"bounds": b.to_dict(), "states": len(self.parents), "depth": depth, **self.stats,
                "complete": stopped is None and not broken, "stopped": stopped,
                "violations": [x.split(":")[0] for x in broken], "counterexample": counterexample,
                "shortest": not self.stats["por_reduced_states"], "workers": self.workers,
                "states_per_s": round(len(self.parents) / max(time.perf_counter() - _T0[0], 1e-9), 1),
                "reductions": ["symmetry: prefill ranks x request ids"] * b.symmetry
                              + ["stale events neither fired nor hashed"] * b.stale_events
                              + ["partial order: persistent sets of one rank's local steps, or of one quiet "
                                 "delivery into decode"] * b.por,
                "note": "explicit-state model check: every interleaving of pd's own protocol code within the "
                        "bounds (up to the reductions listed, each of which keeps every violation and terminal "
                        "state class)"}

    def _path(self, fp: int, last: tuple | None) -> list[tuple]:
        steps = [last] if last is not None else []
        while self.parents[fp][0] is not None:
            fp, action = self.parents[fp]
            steps.append(action)
        return steps[::-1]


def _class(world) -> int:
    return fingerprint(world, symmetry=True, stale_events=True)


def _labels(bounds: CheckBounds, actions: list[tuple]) -> list[str]:
    """The labels of ``actions`` replayed from the initial state (the search stores actions, not labels;
    applying is deterministic, so the replay meets the very states the search expanded)."""
    world, labels = build_world(bounds), []
    for action in actions:
        labels.append(label(world, action))
        with contextlib.suppress(Exception):  # the last step may be the one that raised
            apply(world, action)
    return labels


def _over_capacity(world, capacity: int) -> bool:
    """More than ``capacity`` messages in flight on one endpoint pair (late duplicates included)."""
    counts = {pair: len(q) for pair, q in world.channel.queues.items()}
    for pair, _ in world.channel.late:
        counts[pair] = counts.get(pair, 0) + 1
    return any(n > capacity for n in counts.values())


@contextlib.contextmanager
def _quiet():
    """Decode logs each quarantine once; across many thousands of explored states that is noise."""
    logger = logging.getLogger("layersplit.pd.abort.decode_side")
    level, logger.level = logger.level, logging.ERROR
    try:
        yield
    finally:
        logger.setLevel(level)


def replay(bounds: CheckBounds, trace: list[str], match=None) -> dict:
    """Re-run ``trace`` (labels, as a counterexample lists them) step by step from the initial state.
    Returns ``{"steps": n applied, "violation": [...] or [], "diverged": label not enabled, or None,
    "applied": the labels of the actions applied}``. ``match(label, i)``: is an enabled action with this
    label the trace's step i (the first that is, is taken)? By default, its label equals ``trace[i]``."""
    match = match or (lambda text, i: text == trace[i])
    applied = []
    with guards_off(bounds.guards_off), _quiet():
        world = build_world(bounds)
        for i, text in enumerate(trace):
            found = next(((a, t) for a in enabled(world) if match(t := label(world, a), i)), None)
            if found is None:
                return {"steps": i, "violation": [], "diverged": text, "applied": applied}
            applied.append(found[1])
            try:
                apply(world, found[0])
            except Exception as exc:
                return {"steps": i + 1, "violation": [f"exception: {exc!r}"], "diverged": None, "applied": applied}
            broken = violations(world)
            if broken:
                return {"steps": i + 1, "violation": broken, "diverged": None, "applied": applied}
        broken = [] if owed(enabled(world)) else terminal_violations(world)
        return {"steps": len(trace), "violation": broken, "diverged": None, "applied": applied}
