"""The stress check holds on a GPU: a top-k that breaks exact ties in another order (FlashInfer's
radix top-k: thread order) is not corruption, and every removed wait is still detected.

The stand-in for the device's top-k breaks ties toward the *higher* position (a legal top-k the host
reference never returns); the stress's own host calls keep the reference. With it, the check before
this one (exact comparison with a host top-k) reported corruption with every wait in place.
"""

from __future__ import annotations

import threading

import pytest
import torch

import hicache.stress as stress
from dsa_kernels.reference.indexer import positions_to_slots, topk_indices as host_topk
from hicache.stress import check_topk, page_owners, slots_to_positions
from tests.hicache.test_stress import LOADS, tiny_run

INF = float("inf")


class HighTieTopk:
    """``topk_indices`` as a device may break ties: toward the higher position. ``changed`` counts
    the calls whose choice differs from the host reference's (the stand-in bites)."""

    def __init__(self) -> None:
        self.changed = 0

    def __call__(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        host = host_topk(scores, k)
        if not threading.current_thread().name.startswith("stream-"):
            return host  # the host's own calls: the reference
        flipped = host_topk(scores.flip(1), k)
        idx = torch.where(flipped >= 0, scores.shape[1] - 1 - flipped, flipped)
        self.changed += int(not torch.equal(idx.sort(1).values, host.sort(1).values))
        return idx


@pytest.fixture
def high_ties(monkeypatch) -> HighTieTopk:
    topk = HighTieTopk()
    monkeypatch.setattr(stress, "topk_indices", topk)
    return topk


# check_topk on hand-made rows ---------------------------------------------------------------------
ROW = [3.0, 0.0, 0.0, 1.0, -INF]  # position 4 masked; positions 1 and 2 tie at 0 (ReLU)
CASES = {  # id: (scores, chosen, k, rel_tol, valid, tie)
    "tie-lower": (ROW, [0, 3, 1], 3, 0.0, True, True),
    "tie-higher": (ROW, [2, 0, 3], 3, 0.0, True, True),
    "wrong-choice": (ROW, [0, 1, 2], 3, 0.0, False, True),
    "no-tie-at-k": (ROW, [0, 3], 2, 0.0, True, False),
    "k-above-context": (ROW, [0, 1, 2, 3, -1, -1], 6, 0.0, True, False),
    "k-above-context-short": (ROW, [0, 1, 2, -1, -1, -1], 6, 0.0, False, False),
    "masked-position-chosen": (ROW, [0, 3, 4], 3, 0.0, False, True),
    "duplicate": (ROW, [0, 0, 3], 3, 0.0, False, True),
    "foreign-slot": (ROW, [0, 3, -2], 3, 0.0, False, True),
    "fully-masked-row": ([-INF] * 5, [-1, -1], 2, 0.0, True, False),
    "near-tie-inside-tol": ([3.0, 1.0, 1.002, 0.5, -INF], [0, 1], 2, 1e-3, True, True),
    "near-tie-outside-tol": ([3.0, 1.0, 1.01, 0.5, -INF], [0, 1], 2, 1e-3, False, False),
    "nan-reference": ([3.0, float("nan"), 0.0, 1.0, -INF], [0, 3], 2, 0.0, False, False),
}


@pytest.mark.parametrize("scores, chosen, k, rel_tol, valid, tie", list(CASES.values()), ids=list(CASES))
def test_check_topk(scores, chosen, k, rel_tol, valid, tie):
    got_valid, got_tie = check_topk(torch.tensor([scores]), torch.tensor([chosen]), k, rel_tol)
    assert (bool(got_valid), bool(got_tie)) == (valid, tie)


@pytest.mark.parametrize("k", [1, 5, 70], ids=["k1", "k5", "k-above-context"])
def test_check_topk_accepts_either_tie_order_of_a_real_row(k):
    """ReLU rows: many exact zeros; both the host's and the reversed choice are valid, a shifted one is not."""
    g = torch.Generator().manual_seed(1)
    ref = torch.relu(torch.randn(4, 63, generator=g)).masked_fill(torch.arange(63) > 40, -INF)
    low = host_topk(ref, k)
    high = torch.where((f := host_topk(ref.flip(1), k)) >= 0, 62 - f, f)
    assert check_topk(ref, low, k)[0].all() and check_topk(ref, high, k)[0].all()
    shifted = torch.where(low >= 0, low + 1, low)  # k above the context: position 41 is masked
    assert not check_topk(ref, shifted, k)[0].all()


def test_slots_map_back_to_positions():
    """Device slots of a padded page table (page 0: padding) back to positions; a slot in another
    request's page is -2, -1 stays -1."""
    device_pages, counts = [5, 2, 7, 3], [1, 3]  # request 0: page 5; request 1: pages 2, 7, 3
    table = torch.tensor([[5, 0, 0], [2, 7, 3]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1])
    top = torch.tensor([[0, 63, -1], [0, 64, 191], [130, -1, 5]])
    slots = positions_to_slots(top, table, req)
    owner, index = page_owners(device_pages, counts, 8)
    assert torch.equal(slots_to_positions(slots, owner, index, req), top)
    foreign = slots.clone()
    foreign[0, 0] = 2 * 64  # request 1's page, read by a request-0 query
    assert slots_to_positions(foreign, owner, index, req)[0, 0] == -2


# the stress with the stand-in -----------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_high_tie_topk_with_every_wait_is_not_corruption(high_ties):
    r = tiny_run(set())
    print(f"ties toward the higher position: {high_ties.changed} top-k calls chose differently, "
          f"{r.topk_tie_rows}/{r.topk_rows_checked} tie rows, {r.corrupted_outputs}/{r.outputs_checked} corrupted")
    assert high_ties.changed > 0 and r.topk_tie_rows > 0  # the stand-in did change choices
    assert r.corrupted_outputs == 0 and r.topk_invalid_rows == 0 and r.poisoned_reads == 0
    assert r.outputs_checked == r.layers_loaded >= LOADS


@pytest.mark.timeout(180)
@pytest.mark.parametrize("unsafe", ["indexer", "kv", "fence"], ids=["skip-indexer", "skip-kv", "skip-fence"])
@pytest.mark.slow
def test_high_tie_topk_each_removed_wait_is_detected(high_ties, unsafe):
    r = tiny_run({unsafe})
    print(f"unsafe_skip={unsafe}: {r.corrupted_outputs}/{r.outputs_checked} corrupted, "
          f"{r.topk_invalid_rows} invalid top-k rows, {r.poisoned_reads} poisoned reads")
    assert r.corrupted_outputs > 0
