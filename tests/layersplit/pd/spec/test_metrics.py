"""SGLang's accept metrics against hand-computed examples, the sliding window, and meta_info parsing."""

from __future__ import annotations

from fractions import Fraction

import pytest

from layersplit.pd.spec.metrics import Ratio, RequestSpecState, accept_length, accept_rate, snapshot_from_meta


def fed(accepted: list[int], draft_tokens: int = 4, window: int = 32) -> RequestSpecState:
    state = RequestSpecState(window)
    for a in accepted:
        state.record(draft_tokens, a)
    return state


# (accepted per step, draft_tokens, accept_length, accept_rate), computed by hand:
# tokens per step = accepted + 1 (bonus); rate = accepted / (steps x (draft_tokens - 1)).
HAND = {
    "mixed-k3": ([3, 0, 2, 1], 4, Fraction(10, 4), Fraction(6, 12)),
    "one-draft": ([1, 1, 0], 2, Fraction(5, 3), Fraction(2, 3)),
    "all-rejected": ([0] * 5, 4, Fraction(1), Fraction(0)),
    "all-accepted-k7": ([7, 7], 8, Fraction(8), Fraction(1)),
    "single-step": ([2], 6, Fraction(3), Fraction(2, 5)),
}


@pytest.mark.parametrize("case", list(HAND))
def test_metrics_match_hand_computed(case):
    accepted, draft_tokens, length, rate = HAND[case]
    snap = fed(accepted, draft_tokens).snapshot()
    assert Fraction(snap.accept_length.num, snap.accept_length.den) == length
    assert Fraction(snap.accept_rate.num, snap.accept_rate.den) == rate
    assert snap.generated == sum(accepted) + len(accepted) and snap.verify_steps == len(accepted)


def test_metric_functions():
    assert float(accept_length(412, 160)) == 2.575
    assert float(accept_rate(252, 160, 4)) == 0.525  # 252 / (160 x 3)
    assert accept_length(0, 0) is None and accept_rate(0, 0, 4) is None


def test_ratio_comparisons_are_exact():
    assert not Ratio(7, 5).below(Fraction(7, 5)) and Ratio(139, 100).below(Fraction(7, 5))
    assert not Ratio(24, 25).above(Fraction(24, 25)) and Ratio(25, 26).above(Fraction(24, 26))


def test_window_covers_the_last_steps_only():
    state = fed([3] * 10 + [0, 1, 0], window=3)
    snap = state.snapshot()
    assert (snap.window_accept_length, snap.window_accept_rate, snap.window_steps) == (Ratio(4, 3), Ratio(1, 9), 3)
    assert snap.accept_length == Ratio(44, 13)  # cumulative unaffected
    assert fed([3, 3], window=3).snapshot().window_accept_length is None  # window not full yet


@pytest.mark.parametrize("draft_tokens,accepted", [(1, 0), (4, 4), (4, -1)], ids=["no-drafts", "too-many", "negative"])
def test_record_rejects_impossible_steps(draft_tokens, accepted):
    with pytest.raises(ValueError, match="expected an int"):
        RequestSpecState(4).record(draft_tokens, accepted)


def test_snapshot_from_meta():
    snap = snapshot_from_meta({"completion_tokens": 412, "spec_verify_ct": 160, "spec_accept_length": 2.575,
                               "spec_accept_rate": 0.525})
    assert (snap.accept_length, snap.accept_rate) == (Ratio(412, 160), Ratio(21, 40))
    assert snap.source == "meta_info" and snap.window_accept_length is None
    assert snapshot_from_meta({"completion_tokens": 5, "spec_verify_ct": 0}).accept_length is None


@pytest.mark.parametrize("meta,pattern", [
    ({"completion_tokens": 412, "spec_verify_ct": 160, "spec_accept_length": 3.0}, "spec_accept_length: expected"),
    ({"completion_tokens": "many", "spec_verify_ct": 160}, "completion_tokens: expected an int >= 0, got 'many'"),
    ({"completion_tokens": 10, "spec_verify_ct": 5, "spec_accept_rate": 1.5}, r"spec_accept_rate: expected a number in \[0, 1\]"),
], ids=["inconsistent-length", "bad-count", "rate-above-1"])
def test_snapshot_from_meta_errors(meta, pattern):
    with pytest.raises(ValueError, match=pattern):
        snapshot_from_meta(meta)
