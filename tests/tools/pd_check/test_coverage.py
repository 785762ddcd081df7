"""The walks' end-state estimates (tools.pd_check.coverage): the formulas, and — where the exhaustive search
knows every end-state class — the Good-Turing estimate against the share of fresh walks that really end
in a class the first walks never ended in."""

from __future__ import annotations

from collections import Counter

import pytest

from tools.pd_check import CheckBounds, run_check
from tools.pd_check.coverage import end_class_estimates
from tools.pd_check.explorer import _quiet
from tools.pd_check.simulate import WalkPlan, _walks, simulate

# the one-fault bound of the README's reductions table: 50 terminal classes, exhaustive in seconds
ONE_FAULT = CheckBounds(prefill_ranks=2, requests=1, faults=1, retries=0, cancels=0, polls=0, channel_capacity=1,
                        fault_kinds=("drop", "decode_restart"))


@pytest.mark.parametrize("counts, once, twice, chao1", [
    ({"a": 1, "b": 1, "c": 2, "d": 5}, 2, 1, 4 + 2 * 2 / (2 * 1)),
    ({"a": 1, "b": 1, "c": 3}, 2, 0, 3 + 2 * 1 / 2),  # no class seen twice: the bias-corrected form
    ({"a": 4, "b": 7}, 0, 0, 2),
], ids=["with-doubletons", "no-doubletons", "no-singletons"])
def test_the_estimates_count_singletons_and_doubletons(counts, once, twice, chao1):
    e = end_class_estimates(Counter(counts))
    n = sum(counts.values())
    assert (e["walks"], e["classes"], e["seen_once"], e["seen_twice"]) == (n, len(counts), once, twice)
    assert e["unseen_mass"] == round(once / n, 6) and e["chao1_classes"] == round(chao1, 1)


def test_no_terminal_walk_gives_no_estimate():
    e = end_class_estimates(Counter())
    assert e["walks"] == 0 and e["unseen_mass"] is None


def _ends(plan: WalkPlan) -> Counter:
    with _quiet():
        return _walks(ONE_FAULT, plan, 0, plan.walks, float("inf")).ends


@pytest.fixture(scope="module")
def held_out() -> Counter:
    return _ends(WalkPlan(2_000, seed=99))  # walks independent of every sample below


@pytest.mark.slow
def test_the_walks_end_only_in_classes_the_exhaustive_search_has(held_out):
    terminal: set = set()
    assert run_check(ONE_FAULT, terminal_classes=terminal)["complete"]
    assert set(held_out) <= terminal and len(held_out) == len(terminal) == 50


@pytest.mark.parametrize("walks", [100, 200, 400])
def test_good_turing_predicts_the_share_of_fresh_walks_that_end_somewhere_new(walks, held_out):
    """The estimate from ``walks`` walks against 2,000 held-out ones (seeded: measured 0.14 / 0.07 / 0.025
    against 0.12 / 0.054 / 0.027). A wrong estimator — doubletons for singletons, classes for singletons,
    half the singletons — is outside the tolerance at one size at least."""
    sample = _ends(WalkPlan(walks, seed=1))
    estimate = end_class_estimates(sample)["unseen_mass"]
    unseen = sum(n for cls, n in held_out.items() if cls not in sample) / sum(held_out.values())
    assert abs(estimate - unseen) <= 0.005 + 0.35 * unseen, (estimate, unseen)


def test_a_simulation_reports_its_end_classes():
    result = simulate(ONE_FAULT, WalkPlan(200, seed=1))
    e = result["end_classes"]
    assert e["walks"] == result["terminal_walks"] == 200 and 0 < e["classes"] <= 50
    assert e["chao1_classes"] >= e["classes"]
