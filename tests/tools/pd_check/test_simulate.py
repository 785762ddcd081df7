"""``tools.pd_check.simulate``: random walks at the issue-25 target bound (2 ranks x 2 requests x 2 faults, which
the breadth-first search cannot exhaust) find the unsafe variants, say they are not exhaustive when they find
nothing, are the same walks for any worker count, and shorten a violating trace to one that still breaks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tools.pd_check import CheckBounds, replay, run_check
from tools.pd_check.minimize import minimize, still_breaks
from tools.pd_check.simulate import WalkPlan, _Rewind, shortest_walk, simulate
from tools.pd_check.snapshot import Snapshots
from tools.pd_check.state import canonical
from tools.pd_check.world import apply, build_world, enabled
from layersplit.pd.abort.guards import GUARDS

TARGET = CheckBounds(timeout_s=120.0)  # the defaults are the target bound: 2 ranks, 2 requests, 2 faults


def _kinds(violation: list[str]) -> list[str]:
    return [v.split(":")[0] for v in violation]


def test_walks_find_the_legacy_release_at_the_target_bound_and_its_trace_replays():
    bounds = replace(TARGET, legacy=True)
    result = simulate(bounds, WalkPlan(walks=50, seed=0))
    assert result["violations"] == ["freed_while_writing"] and result["violating_walk"] is not None
    trace = result["counterexample"]["trace"]
    assert result["one_minimal"] and 0 < len(trace) <= result["raw_trace_length"]
    replayed = replay(bounds, trace)
    assert replayed["diverged"] is None and replayed["steps"] == len(trace)
    assert _kinds(replayed["violation"]) == _kinds(result["counterexample"]["violation"])
    again = simulate(bounds, WalkPlan(walks=50, seed=0))  # seeded: the same walk, the same trace
    assert again["violating_walk"] == result["violating_walk"] and again["counterexample"] == result["counterexample"]


# what each UNSAFE variant breaks at the target bound (seed 0: the walk that finds it is within the first
# 1,200; README); free-by-owner-only is the one guard no schedule reaches while the others hold
FOUND_AT_TARGET = {"legacy": "freed_while_writing", "idempotent-abort": "double_free",
                   "release-unannounced-at-once": "exception", "fan-in-every-rank": "freed_while_writing",
                   "quarantine-at-bound": "freed_while_writing", "floor-rejects-late": "prefill_window",
                   "prune-below-floor": "prefill_window", "incarnation-address": "freed_while_writing",
                   "restart-drains-first": "freed_while_writing", "sources-held-until-drained": "source_freed_while_writing",
                   "quarantine-heals": "held_for_ever", "fence-refuses-writes": "fenced_write_landed",
                   "decode-life-fence": "freed_while_writing", "floor-per-decode-life": "false_late_rejection",
                   "owners-only": "corrupt_read", "reply-from-its-peer": "corrupt_read"}


def test_every_guard_but_the_stale_free_check_is_listed():
    assert set(GUARDS) - set(FOUND_AT_TARGET) == {"free-by-owner-only"}


@pytest.mark.parametrize("variant", sorted(FOUND_AT_TARGET))
@pytest.mark.slow
def test_walks_find_every_unsafe_variant_at_the_target_bound(variant):
    """The breadth-first search reaches only the shallow ones at this bound in minutes (README); walks find
    each, and its shortened trace replays to the same kind of violation."""
    bounds = replace(TARGET, legacy=True) if variant == "legacy" else replace(TARGET, guards_off=(variant,))
    result = simulate(bounds, WalkPlan(walks=2_000, seed=0))
    assert result["violations"][:1] == [FOUND_AT_TARGET[variant]], result["stopped"]
    assert FOUND_AT_TARGET[variant] in _kinds(replay(bounds, result["counterexample"]["trace"])["violation"])


def test_a_clean_run_counts_its_walks_and_is_never_complete():
    result = simulate(TARGET, WalkPlan(walks=60, seed=1))
    assert result["violations"] == [] and result["counterexample"] is None
    assert result["complete"] is False and result["stopped"] is None and result["walks"] == 60
    ends = ("terminal_walks", "truncated_walks", "stuck_walks", "violating_walks")
    assert sum(result[k] for k in ends) == 60 and result["violating_walks"] == 0 and result["terminal_walks"] > 0
    assert result["steps"] > 60 * 10 and "2" in result["faults_spent"]  # walks spend the whole fault budget too
    assert sum(result["faults_spent"].values()) == 60


def test_the_walks_and_the_first_violation_do_not_depend_on_the_worker_count():
    bounds = replace(TARGET, guards_off=("fan-in-every-rank",))
    plan = WalkPlan(walks=64, seed=0)  # spans of 8 walks in one process, of 4 in two: the violation is not in the first
    one, two = simulate(bounds, plan, workers=1), simulate(bounds, plan, workers=2)
    assert one["violating_walk"] >= 4 and two["workers"] == 2
    for key in ("walks", "steps", "violating_walk", "raw_trace_length", "counterexample", "faults_spent",
                "pruned_by_channel_capacity"):
        assert one[key] == two[key], key
    clean = WalkPlan(walks=24, seed=2)
    a, b = simulate(TARGET, clean, workers=1), simulate(TARGET, clean, workers=2)
    assert {k: a[k] for k in ("walks", "steps", "terminal_walks", "faults_spent")} \
        == {k: b[k] for k in ("walks", "steps", "terminal_walks", "faults_spent")}


def test_minimize_leaves_a_trace_from_which_no_single_step_can_be_removed():
    bounds = replace(TARGET, legacy=True)
    raw = simulate(bounds, WalkPlan(walks=50, seed=0, minimize=False))["counterexample"]
    trace, done = minimize(bounds, raw["trace"], raw["violation"])
    assert done and len(trace) < len(raw["trace"])
    assert still_breaks(bounds, trace, "freed_while_writing") == trace
    for i in range(len(trace)):  # one-minimal: every single removal diverges or no longer breaks
        assert still_breaks(bounds, trace[:i] + trace[i + 1:], "freed_while_writing") is None, i


def test_shortest_walk_swaps_in_the_breadth_first_shortest_counterexample():
    bounds = CheckBounds(prefill_ranks=2, requests=1, faults=0, retries=0, cancels=0, polls=1, legacy=True)
    walked = simulate(bounds, WalkPlan(walks=50, seed=0))
    best = run_check(replace(bounds, por=False))
    result = shortest_walk(bounds, walked)
    assert result["shortest"] and result["shortest_search"]["states"] > 0
    assert len(result["counterexample"]["trace"]) == len(best["counterexample"]["trace"]) \
        <= len(walked["counterexample"]["trace"])
    assert shortest_walk(bounds, simulate(replace(bounds, legacy=False), WalkPlan(walks=3)))["counterexample"] is None


def test_a_walk_stops_at_max_steps_and_a_run_at_its_timeout():
    capped = simulate(TARGET, WalkPlan(walks=5, max_steps=3))
    assert capped["truncated_walks"] == 5 and capped["steps"] == 15
    stopped = simulate(replace(TARGET, timeout_s=1e-9), WalkPlan(walks=1_000))
    assert stopped["stopped"].startswith("timeout") and stopped["walks"] < 1_000 and not stopped["complete"]


@pytest.mark.parametrize("field,value", [("walks", 0), ("seed", -1), ("max_steps", 0), ("fault_rate", 1.5),
                                         ("fault_rate", True), ("walks", 2.0)])
def test_a_bad_plan_is_refused_naming_the_field(field, value):
    kwargs = {"walks": 1, field: value}
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        WalkPlan(**kwargs)


@pytest.mark.slow
def test_the_walks_reach_only_states_the_exhaustive_search_has_and_most_of_its_terminal_classes():
    """The cross-check of the walks' step rule against the breadth-first search: at a bound both can do
    (one fault), every state class a walk reaches is one the exhaustive search (no partial-order reduction)
    found, and 1,000 walks reach at least 90% of its terminal classes (all 50, measured; README)."""
    bounds = CheckBounds(prefill_ranks=2, requests=1, faults=1, retries=0, cancels=0, polls=0, channel_capacity=1,
                         fault_kinds=("drop", "decode_restart"))
    every, every_terminal = set(), set()
    assert run_check(replace(bounds, por=False), classes=every, terminal_classes=every_terminal)["complete"]
    walked, walked_terminal = set(), set()
    result = simulate(bounds, WalkPlan(walks=1_000, seed=0), classes=walked, terminal_classes=walked_terminal)
    assert result["violations"] == [] and walked <= every and walked_terminal <= every_terminal
    assert len(walked_terminal) >= 0.9 * len(every_terminal) and len(walked) > len(every) / 3


@pytest.mark.parametrize("every", [1, 3, 8])
def test_a_step_taken_back_restores_the_world_before_it(every):
    """The walk's rewind (a snapshot every few steps, the actions since re-applied) gives back the world as
    it was after the last step kept — its canonical form compared at every step of 20 seeded walks at the
    target bound, on both sides of each snapshot."""
    checked = 0
    for seed in range(20):
        rng, world = random.Random(seed), build_world(TARGET)
        with Snapshots(world) as snap:
            rewind = _Rewind(snap, world, every=every)
            for _ in range(40):
                actions = enabled(world)
                if not actions:
                    break
                before = canonical(world)
                action = rng.choice(actions)
                apply(world, action)
                if rng.random() < 0.3:  # take it back, as a step over the capacity is
                    world = rewind.back()
                    assert canonical(world) == before
                    checked += 1
                else:
                    rewind.kept(world, action)
                    assert canonical(rewind.back()) == canonical(world)
    assert checked > 50
