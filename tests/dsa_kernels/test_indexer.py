"""Lightning indexer (DeepSeek-V3.2 semantics) over paged fp8 keys: scores and top-k sets against an
independent restatement of DeepSeek's code (``dsa_kernels.reference.deepseek``), chunked top-k
against the unchunked one, and the merge's tie rule."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import dsa_kernels
from dsa_kernels import layout, positions_to_slots
from dsa_kernels.reference import deepseek
from dsa_kernels.reference.index_keys import read_index_keys
from dsa_kernels.reference.indexer import topk_indices, topk_merge, topk_slots
from tests.conftest import DEVICE
from tests.dsa_kernels.helpers import assert_same_inf, op

SUM_ORDER_RTOL = 1e-5  # fp32 summation-order differences, relative to the largest score
# a top-k position may differ from DeepSeek's only at an exact tie on CPU (fp8 products are exact and
# the sums come out bit-equal here); CUDA's bf16 tensor-core dots sum in another order
TIE_RTOL = 0.0 if DEVICE.type == "cpu" else SUM_ORDER_RTOL


@dataclass
class Case:
    """Requests given as (cached prefix length, new tokens): the new tokens are the query rows."""

    reqs: list[tuple[int, int]]
    heads: int
    topk: int
    dim: int = 128


CASES = {
    "one-token": Case([(0, 1)], 4, 8),
    "empty-prefix-63": Case([(0, 63)], 4, 16),
    "page-boundary-64": Case([(60, 4)], 3, 16),
    "page-boundary-65-k2048": Case([(64, 1)], 4, 2048),  # context shorter than top-k
    "prefix-100-chunk-29": Case([(100, 29)], 5, 40),
    "three-requests": Case([(0, 7), (128, 3), (65, 10)], 4, 32),
    "heads-32": Case([(40, 9)], 32, 24),
    "cached-prefix-300-k64": Case([(300, 5)], 8, 64),
    "four-requests-d64": Case([(190, 2), (0, 33), (64, 64), (1, 1)], 4, 16, dim=64),
}


def build(case: Case, seed: int):
    """Random keys per request in shuffled pages (quantized by the torch reference), bf16 queries and
    signed head weights. Returns the op arguments and, per request, the raw keys for the oracle."""
    gen = torch.Generator().manual_seed(seed)
    d = case.dim
    ctx = [p + n for p, n in case.reqs]
    max_pages = max((c + 63) // 64 for c in ctx)
    num_pages = sum((c + 63) // 64 for c in ctx) + 2
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.zeros(len(ctx), max_pages, dtype=torch.int32)
    cache = torch.zeros(num_pages, layout.index_page_bytes(d), dtype=torch.uint8)
    raw_keys, used = [], 0
    for b, c in enumerate(ctx):
        n_pages = (c + 63) // 64
        page_table[b, :n_pages] = perm[used:used + n_pages].int()
        used += n_pages
        keys = (torch.randn(c, d, generator=gen) * torch.rand(c, 1, generator=gen) * 4).to(torch.bfloat16)
        slots = page_table[b, torch.arange(c) // 64].long() * 64 + torch.arange(c) % 64
        op("quantize_index_keys", "torch", torch.device("cpu"))(keys, cache, slots)
        raw_keys.append(keys)
    req_idx = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, (_, n) in enumerate(case.reqs)])
    positions = torch.cat([torch.arange(p, p + n) for p, n in case.reqs])
    q = torch.randn(len(positions), case.heads, d, generator=gen).to(torch.bfloat16)
    w = torch.randn(len(positions), case.heads, generator=gen).to(torch.bfloat16)
    return [q, w, cache, page_table, req_idx, positions], max(ctx), raw_keys


def deepseek_scores(case: Case, args, max_ctx: int, raw_keys) -> torch.Tensor:
    """Dense ``[T, max_ctx]`` scores from the restatement (act_quant + fp8_index + causal mask)."""
    q, w, _, _, req_idx, positions = args
    want = torch.full((len(positions), max_ctx), float("-inf"))
    for b, (prefix, n) in enumerate(case.reqs):
        rows = (req_idx == b).nonzero().squeeze(1)
        q_fp8, q_scale = deepseek.act_quant(q[rows])
        k_fp8, k_scale = deepseek.act_quant(raw_keys[b])
        fold = (w[rows] * case.heads**-0.5)[..., None] * q_scale * case.dim**-0.5
        score = deepseek.fp8_index(q_fp8, fold[..., 0], k_fp8, k_scale[:, 0])
        causal = torch.arange(prefix + n)[None, :] <= positions[rows, None]
        want[rows, : prefix + n] = score.masked_fill(~causal, float("-inf"))
    return want


def to_device(args, device):
    return [a.to(device) for a in args]


def set_differences(got: torch.Tensor, case: Case, args, raw_keys, scores: torch.Tensor) -> list[float]:
    """Compare each query's top-k set with the restatement's; return, for every differing position,
    its distance (in the restatement's scores) to the row's k-th score. Empty list: identical sets."""
    req_idx = args[4]
    diffs: list[float] = []
    for b, (prefix, n) in enumerate(case.reqs):
        rows = (req_idx == b).nonzero().squeeze(1)
        want_sets = deepseek.indexer_topk(args[0][rows], args[1][rows], raw_keys[b], prefix, case.topk)
        for r, want in zip(rows.tolist(), want_sets):
            mine = set(got[r][got[r] >= 0].tolist())
            assert len(mine) == len(want), f"row {r}: {len(mine)} selected, DeepSeek selects {len(want)}"
            if mine != want:
                kth = scores[r, list(want)].min()
                diffs += [abs(float(scores[r, s] - kth)) for s in mine ^ want]
    return diffs


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_key_bytes_equal_deepseek_act_quant(name):
    """The paged cache holds exactly DeepSeek's act_quant bytes and scales for every key."""
    case = CASES[name]
    args, _, raw_keys = build(case, seed=len(name))
    cache, page_table = args[2], args[3]
    for b, keys in enumerate(raw_keys):
        s = torch.arange(len(keys))
        k_fp8, k_scale = read_index_keys(cache, page_table[b, s // 64].long() * 64 + s % 64)
        want_fp8, want_scale = deepseek.act_quant(keys)
        assert torch.equal(k_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
        assert torch.equal(k_scale, want_scale[:, 0])


@pytest.mark.parametrize("name", list(CASES))
def test_scores_match_deepseek(backend, device, name):
    case = CASES[name]
    args, max_ctx, raw_keys = build(case, seed=len(name))
    want = deepseek_scores(case, args, max_ctx, raw_keys)
    got = op("indexer_scores", backend, device)(*to_device(args, device), max_ctx).cpu()
    assert_same_inf(got, want)
    finite = torch.isfinite(want)
    # fp8 products are exact; only the fp32 summation order differs (tl.dot / BLAS / einsum)
    assert (got[finite] - want[finite]).abs().max() <= SUM_ORDER_RTOL * want[finite].abs().max()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_topk_sets_equal_deepseek_except_ties(backend, device, monkeypatch, name):
    """Chunked ``indexer_topk`` (small chunks and query blocks: several merges per row) selects
    DeepSeek's sets; a position may differ only where its score ties the row's k-th score."""
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    case = CASES[name]
    args, max_ctx, raw_keys = build(case, seed=len(name))
    want_scores = deepseek_scores(case, args, max_ctx, raw_keys)
    got = dsa_kernels.indexer_topk(*to_device(args, device), max_ctx, case.topk, chunk=48, query_block=5).cpu()
    assert got.shape == (len(args[5]), case.topk) and got.dtype == torch.int32
    assert torch.equal((got >= 0).sum(1), (args[5] + 1).clamp(max=case.topk)), "k >= context must pad with -1"
    diffs = set_differences(got, case, args, raw_keys, want_scores)
    scale = float(want_scores[torch.isfinite(want_scores)].abs().max())
    assert all(d <= TIE_RTOL * scale for d in diffs), f"non-tie differences: {sorted(diffs)[-3:]}"


@pytest.mark.parametrize("chunk,query_block", [(5, 2), (64, 64), (1000, 1000)])
@pytest.mark.slow
def test_chunked_topk_equals_unchunked(backend, device, monkeypatch, chunk, query_block):
    """Same scores, any chunking: the running merge gives exactly ``topk_indices`` of the whole row,
    order and tie rule included (ties are common: a key whose every head is relu'd to 0 scores 0)."""
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    case = CASES["three-requests"]
    args, max_ctx, _ = build(case, seed=3)
    dev_args = to_device(args, device)
    whole = topk_indices(op("indexer_scores", backend, device)(*dev_args, max_ctx), case.topk).cpu()
    got = dsa_kernels.indexer_topk(*dev_args, max_ctx, case.topk, chunk=chunk, query_block=query_block).cpu()
    assert torch.equal(got, whole)


def test_merge_tie_rule_over_chunks():
    """Ties across and within chunks go to the lower position, exactly as one sort of the row."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (6, 50), generator=gen).float()  # many exact ties
    scores[2, 10:] = float("-inf")
    for k in (1, 5, 17, 60):
        for chunk in (1, 3, 16, 50):
            best, idx = torch.empty(6, 0), torch.empty(6, 0, dtype=torch.int32)
            for s0 in range(0, 50, chunk):
                best, idx = topk_merge(best, idx, scores[:, s0:s0 + chunk], s0, k)
            got = torch.where(torch.isfinite(best), idx, -1)
            want = topk_indices(scores, k)[:, : got.shape[1]]
            assert torch.equal(got, want), (k, chunk)


def test_topk_tie_rule_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0], [float("-inf")] * 5])
    assert topk_indices(scores, 3).tolist() == [[1, 2, 4], [-1, -1, -1]]
    assert topk_indices(scores, 7).tolist() == [[1, 2, 4, 0, -1, -1, -1], [-1] * 7]


def test_positions_to_slots_and_topk_slots():
    page_table = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    top = torch.tensor([[0, 65, -1], [3, -1, -1]], dtype=torch.int32)
    slots = positions_to_slots(top, page_table, torch.tensor([0, 1]))
    assert slots.tolist() == [[5 * 64, 2 * 64 + 1, -1], [7 * 64 + 3, -1, -1]]
    scores = torch.arange(80.0).expand(2, 80).contiguous()  # the highest visible position wins
    got = topk_slots(scores, page_table, torch.tensor([0, 1]), torch.tensor([65, 1]), 3)
    assert got.tolist() == [[2 * 64 + 1, 2 * 64, 5 * 64 + 63], [7 * 64 + 1, 7 * 64, -1]]


def test_bad_input_errors(device):
    args, max_ctx, _ = build(CASES["one-token"], seed=0)
    args = to_device(args, device)
    fn = op("indexer_scores", "triton", device)
    with pytest.raises(ValueError, match="weights: expected shape"):
        fn(args[0], args[1][:, :2].contiguous(), *args[2:], max_ctx)
    with pytest.raises(ValueError, match="max_context: expected <= 64"):
        fn(*args, 65)
    with pytest.raises(ValueError, match="q: expected head dim 128"):
        fn(args[0][..., :64].contiguous(), *args[1:], max_ctx)
    with pytest.raises(ValueError, match="chunk, query_block: expected >= 1"):
        dsa_kernels.indexer_topk(*args, max_ctx, 8, chunk=0)


def agreement_table() -> None:
    """``python -m tests.dsa_kernels.test_indexer``: per backend and case, query rows whose top-k set is
    identical to DeepSeek's, rows that differ only at exact ties, rows that differ otherwise."""
    import os

    for backend in ("torch", "triton"):
        os.environ["LAYERSPLIT_KERNEL_BACKEND"] = backend
        for name, case in CASES.items():
            args, max_ctx, raw_keys = build(case, seed=len(name))
            scores = deepseek_scores(case, args, max_ctx, raw_keys)
            got = dsa_kernels.indexer_topk(*args, max_ctx, case.topk, chunk=48, query_block=5)
            same = ties = other = 0
            for b, (prefix, n) in enumerate(case.reqs):
                rows = (args[4] == b).nonzero().squeeze(1)
                for r, want in zip(rows.tolist(), deepseek.indexer_topk(args[0][rows], args[1][rows], raw_keys[b],
                                                                        prefix, case.topk)):
                    mine = set(got[r][got[r] >= 0].tolist())
                    kth = scores[r, list(want)].min() if want else 0.0
                    exact_tie = all(scores[r, s] == kth for s in mine ^ want)
                    same, ties, other = same + (mine == want), ties + (mine != want and exact_tie), \
                        other + (not exact_tie)
            print(f"{backend:<6} {name:<24} rows {len(args[5]):>3}  identical {same:>3}  "
                  f"differ-only-at-exact-ties {ties:>2}  other {other}")


if __name__ == "__main__":
    agreement_table()
