"""Lightning indexer scores over paged fp8 keys and top-k selection, against a dense oracle."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsa_kernels import layout, positions_to_slots
from dsa_kernels.reference.indexer import topk_indices
from tests.dsa_kernels.helpers import assert_same_inf, assert_topk_equivalent, op

D = 128


@dataclass
class Case:
    """Requests given as (prefix length, new tokens): the new tokens are the query rows."""

    reqs: list[tuple[int, int]]
    heads: int
    topk: int


CASES = {
    "one-token": Case([(0, 1)], 4, 8),
    "empty-prefix-63": Case([(0, 63)], 4, 16),
    "page-boundary-64": Case([(60, 4)], 3, 16),
    "page-boundary-65": Case([(64, 1)], 4, 2048),  # context shorter than top-k
    "prefix-100-chunk-29": Case([(100, 29)], 5, 40),
    "three-requests": Case([(0, 7), (128, 3), (65, 10)], 4, 32),
    "heads-32": Case([(40, 9)], 32, 24),
}


def build(case: Case, device: torch.device, seed: int):
    """Random keys per request in shuffled pages; returns inputs and the dense oracle scores."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in case.reqs]
    max_pages = max((c + 63) // 64 for c in ctx)
    num_pages = sum((c + 63) // 64 for c in ctx) + 2
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.zeros(len(ctx), max_pages, dtype=torch.int32)
    cache = torch.zeros(num_pages, layout.index_page_bytes(D), dtype=torch.uint8)
    dense_keys, used = [], 0
    for b, c in enumerate(ctx):
        n_pages = (c + 63) // 64
        page_table[b, :n_pages] = perm[used:used + n_pages].int()
        used += n_pages
        keys = torch.randn(c, D, generator=gen)
        slots = page_table[b, torch.arange(c) // 64].long() * 64 + torch.arange(c) % 64
        op("quantize_index_keys", "torch", torch.device("cpu"))(keys, cache, slots)
        dense_keys.append(op("dequantize_index_keys", "torch", torch.device("cpu"))(cache, slots))
    req_idx = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, (_, n) in enumerate(case.reqs)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in case.reqs])
    q = torch.randn(len(positions), case.heads, D, generator=gen).to(torch.bfloat16)
    w = torch.rand(len(positions), case.heads, generator=gen)
    max_ctx = max(ctx)
    want = torch.full((len(positions), max_ctx), float("-inf"))
    for t in range(len(positions)):  # I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s]) for s <= pos[t]
        k = dense_keys[int(req_idx[t])][: int(positions[t]) + 1]
        want[t, : len(k)] = (torch.relu(q[t].float() @ k.T) * w[t, :, None]).sum(0)
    args = [x.to(device) for x in (q, w, cache, page_table, req_idx, positions)]
    return args, max_ctx, want


def tolerance(device: torch.device) -> float:
    # fp32 accumulation on CPU; on CUDA tl.dot may use tf32 (10-bit mantissa)
    return 1e-4 if device.type == "cpu" else 2e-2


@pytest.mark.parametrize("name", list(CASES))
def test_scores_match_dense_oracle(backend, device, name):
    args, max_ctx, want = build(CASES[name], device, seed=len(name))
    got = op("indexer_scores", backend, device)(*args, max_ctx).cpu()
    assert_same_inf(got, want)
    finite = torch.isfinite(want)
    scale = want[finite].abs().max().clamp_min(1.0)
    assert (got[finite] - want[finite]).abs().max() <= tolerance(device) * scale


@pytest.mark.parametrize("name", list(CASES))
def test_topk_matches_oracle_sets(backend, device, name):
    case = CASES[name]
    args, max_ctx, want_scores = build(case, device, seed=len(name))
    got = topk_indices(op("indexer_scores", backend, device)(*args, max_ctx), case.topk).cpu()
    want = topk_indices(want_scores, case.topk)
    assert got.shape == (want_scores.shape[0], case.topk) and got.dtype == torch.int32
    positions = args[5].cpu()
    n_valid = torch.clamp(positions + 1, max=case.topk)
    assert torch.equal((got >= 0).sum(1), n_valid), "k >= context must pad with -1"
    assert_topk_equivalent(got, want, want_scores, atol=tolerance(device) * want_scores[torch.isfinite(want_scores)].abs().max())


def test_topk_tie_rule_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0], [float("-inf")] * 5])
    assert topk_indices(scores, 3).tolist() == [[1, 2, 4], [-1, -1, -1]]
    assert topk_indices(scores, 7).tolist() == [[1, 2, 4, 0, -1, -1, -1], [-1] * 7]


def test_positions_to_slots():
    page_table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    top = torch.tensor([[0, 65, -1], [3, -1, -1]], dtype=torch.int32)
    slots = positions_to_slots(top, page_table, torch.tensor([0, 1]))
    assert slots.tolist() == [[5 * 64, 2 * 64 + 1, -1], [7 * 64 + 3, -1, -1]]


def test_bad_input_errors(device):
    args, max_ctx, _ = build(CASES["one-token"], device, seed=0)
    fn = op("indexer_scores", "triton", device)
    with pytest.raises(ValueError, match="weights: expected shape"):
        fn(args[0], args[1][:, :2].contiguous(), *args[2:], max_ctx)
    with pytest.raises(ValueError, match="max_context: expected <= 64"):
        fn(*args, 65)
    with pytest.raises(ValueError, match="q: expected head dim 128"):
        fn(args[0][..., :64].contiguous(), *args[1:], max_ctx)
