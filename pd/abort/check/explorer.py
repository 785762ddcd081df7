"""Breadth-first explicit-state exploration of the PD abort protocol, over the protocol's own code.

Each state is a pickled :class:`~pd.abort.check.world.World`; every enabled action is applied to a fresh copy,
the result hashed (:mod:`pd.abort.check.state`) and, if new, checked (:mod:`pd.abort.check.invariants`) and queued.
Breadth-first, so the first violation found has a shortest trace. A state in which nothing is owed any
more (no pending event, no message in flight) is terminal and must also pass the liveness checks.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from functools import partial

from pd.abort.check.bounds import CheckBounds
from pd.abort.check.invariants import terminal_violations, violations
from pd.abort.check.state import fingerprint
from pd.abort.check.world import apply, build_world, enabled, label, owed
from pd.abort.guards import guards_off


_T0 = [0.0]  # the running check's start (for states/s)


def run_check(bounds: CheckBounds, classes: set | None = None) -> dict:
    """Explore every interleaving within ``bounds``; returns the JSON-ready result (``violations`` empty
    when none was found; else ``counterexample`` holds the shortest trace, one label per step).
    ``classes``: if given, filled with the class of every state explored (its fingerprint under every
    reduction) — what the cross-check compares between a reduced and an unreduced run."""
    start = _T0[0] = time.perf_counter()
    with guards_off(bounds.guards_off), _quiet():
        result = _bfs(bounds, start, classes)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def _bfs(bounds: CheckBounds, start: float, classes: set | None) -> dict:
    root = build_world(bounds)
    hashed = partial(fingerprint, symmetry=bounds.symmetry, stale_events=bounds.stale_events)
    parents: dict[int, tuple[int | None, str | None]] = {hashed(root): (None, None)}
    frontier = [(hashed(root), pickle.dumps(root, pickle.HIGHEST_PROTOCOL))]
    if classes is not None:
        classes.add(fingerprint(root, symmetry=True, stale_events=True))
    stats = {"transitions": 0, "terminal_states": 0, "pruned_by_channel_capacity": 0, "frontier_sizes": []}
    depth, stopped = 0, None
    while frontier and stopped is None:
        stats["frontier_sizes"].append(len(frontier))
        next_frontier = []
        for fp, blob in frontier:
            world = pickle.loads(blob)
            actions = enabled(world)
            if not owed(actions):
                stats["terminal_states"] += 1
                broken = terminal_violations(world)
                if broken:
                    return _found(bounds, stats, parents, depth, fp, None, broken)
            labels = [label(world, a) for a in actions]
            for action, text in zip(actions, labels):
                child = pickle.loads(blob)
                stats["transitions"] += 1
                try:
                    apply(child, action)
                except Exception as exc:  # the implementation itself failed: a bug the trace reproduces
                    return _found(bounds, stats, parents, depth + 1, fp, text, [f"exception: {exc!r}"])
                if _over_capacity(child, bounds.channel_capacity):
                    stats["pruned_by_channel_capacity"] += 1
                    continue
                child_fp = hashed(child)
                if child_fp in parents:
                    continue
                parents[child_fp] = (fp, text)
                if classes is not None:
                    classes.add(fingerprint(child, symmetry=True, stale_events=True))
                broken = violations(child)
                if broken:
                    return _found(bounds, stats, parents, depth + 1, child_fp, None, broken)
                next_frontier.append((child_fp, pickle.dumps(child, pickle.HIGHEST_PROTOCOL)))
            if len(parents) >= bounds.max_states:
                stopped = f"max_states ({bounds.max_states})"
                break
            if time.perf_counter() - start > bounds.timeout_s:
                stopped = f"timeout ({bounds.timeout_s} s)"
                break
        frontier = next_frontier
        depth += bool(frontier)
    return _result(bounds, stats, parents, depth, stopped, [], None)


def _over_capacity(world, capacity: int) -> bool:
    """More than ``capacity`` messages in flight on one endpoint pair (late duplicates included)."""
    counts = {pair: len(q) for pair, q in world.channel.queues.items()}
    for pair, _ in world.channel.late:
        counts[pair] = counts.get(pair, 0) + 1
    return any(n > capacity for n in counts.values())


@contextlib.contextmanager
def _quiet():
    """Decode logs each quarantine once; across many thousands of explored states that is noise."""
    logger = logging.getLogger("pd.abort.decode_side")
    level, logger.level = logger.level, logging.ERROR
    try:
        yield
    finally:
        logger.setLevel(level)


def _found(bounds, stats, parents, depth, fp, last, broken) -> dict:
    trace = _path(parents, fp) + ([last] if last else [])
    return _result(bounds, stats, parents, depth, None, broken, {"violation": broken, "trace": trace})


def _path(parents, fp) -> list[str]:
    steps = []
    while parents[fp][0] is not None:
        fp, text = parents[fp]
        steps.append(text)
    return steps[::-1]


def _result(bounds, stats, parents, depth, stopped, broken, counterexample) -> dict:
    return {"bounds": bounds.to_dict(), "states": len(parents), "depth": depth, **stats,
            "complete": stopped is None and not broken, "stopped": stopped,
            "violations": [b.split(":")[0] for b in broken], "counterexample": counterexample,
            "states_per_s": round(len(parents) / max(time.perf_counter() - _T0[0], 1e-9), 1),
            "reductions": ["symmetry: prefill ranks x request ids"] * bounds.symmetry
                          + ["stale events neither fired nor hashed"] * bounds.stale_events,
            "note": "explicit-state model check: every interleaving of pd's own protocol code within the bounds"}


def replay(bounds: CheckBounds, trace: list[str]) -> dict:
    """Re-run ``trace`` (labels, as a counterexample lists them) step by step from the initial state.
    Returns ``{"steps": n applied, "violation": [...] or [], "diverged": label not enabled, or None}``."""
    with guards_off(bounds.guards_off), _quiet():
        world = build_world(bounds)
        for i, text in enumerate(trace):
            actions = enabled(world)
            match = next((a for a in actions if label(world, a) == text), None)
            if match is None:
                return {"steps": i, "violation": [], "diverged": text}
            try:
                apply(world, match)
            except Exception as exc:
                return {"steps": i + 1, "violation": [f"exception: {exc!r}"], "diverged": None}
            broken = violations(world)
            if broken:
                return {"steps": i + 1, "violation": broken, "diverged": None}
        broken = [] if owed(enabled(world)) else terminal_violations(world)
        return {"steps": len(trace), "violation": broken, "diverged": None}



