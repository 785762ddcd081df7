"""The vendor tier's gates, on CPU with fake vendor modules: which calls reach FlashMLA / FlashInfer,
which fall back (and log once), how FlashMLA's lse is converted, how top-k sets compare, and the
fp8 cache's fallback to Triton meeting the launcher's sm89 gate on the same fake device."""

from __future__ import annotations

import logging
import math
import sys
import types

import pytest
import torch

from dsa_kernels import dispatch, vendor
from dsa_kernels.reference import indexer as ref_indexer
from dsa_kernels.reference.sparse_mla import sparse_mla_prefill as reference_mla


def install_fake_flash_mla(monkeypatch, version: str, base: float | None, calls: list, state: dict) -> None:
    """A fake ``sgl_kernel`` package whose ``flash_mla`` is a real submodule in ``sys.modules`` and
    NOT an attribute of the package, as upstream's ``sgl_kernel/__init__`` leaves it (an adapter that
    reads ``sgl_kernel.flash_mla`` as an attribute finds nothing). The ``flash_mla`` wheel's module
    is made unimportable."""
    package = types.ModuleType("sgl_kernel")
    package.__version__ = version
    package.__path__ = []  # a package: submodules may live under it
    monkeypatch.setitem(sys.modules, "sgl_kernel", package)
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", fake_flash_mla_module(base, calls, state))
    monkeypatch.setitem(sys.modules, "flash_mla", None)


def fake_flash_mla_module(base: float | None, calls: list, state: dict) -> types.ModuleType:
    """``flash_mla_sparse_fwd`` in torch with the kernel's contract asserted: bf16 q with exactly
    h_q in the accepted set of the device (64 or 128 on sm90, 128 on sm100), kv ``[S, 1, d_qk]``
    bf16, int32 indices ``[T, 1, K]`` with K a multiple of 128, d_v 512; lse in ``base`` (None:
    garbage), ``+inf`` for a row with no valid index."""
    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v):
        accepted = {9: (64, 128), 10: (128,)}[state["sm"]]
        assert q.shape[1] in accepted, f"h_q {q.shape[1]}: FlashMLA's TORCH_CHECK refuses it"
        assert q.dtype == kv.dtype == torch.bfloat16 and d_v == 512
        assert kv.dim() == 3 and kv.shape[1] == 1 and indices.dtype == torch.int32 and indices.shape[2] % 128 == 0
        calls.append((tuple(q.shape), tuple(indices.shape)))
        out, lse = reference_mla(q, kv[:, 0], indices[:, 0], sm_scale, d_v)
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        lse = lse / math.log(base) if base else torch.full_like(lse, 3.0)
        return out.to(torch.bfloat16), lse, lse
    module = types.ModuleType("sgl_kernel.flash_mla")
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return module


def fake_flashinfer(calls: list) -> types.ModuleType:
    """Radix top-k stand-ins that break ties toward the HIGHER index (ours: lower), as FlashInfer
    promises no tie order."""
    def top_k(x, k, sorted=False):
        calls.append("top_k")
        n = x.shape[1]
        flipped = torch.topk(x.flip(1), k, dim=1, sorted=True)  # stable-ish on the flipped row: high index first
        return flipped.values, (n - 1 - flipped.indices).to(torch.int64)

    def top_k_page_table_transform(x, src_page_table, lengths, k, row_to_batch=None):
        calls.append("top_k_page_table_transform")
        out = torch.full((x.shape[0], k), -1, dtype=torch.int32)
        for i in range(x.shape[0]):
            n = int(lengths[i])
            _, idx = top_k(x[i:i + 1, :n], min(k, n))
            b = int(row_to_batch[i]) if row_to_batch is not None else i
            out[i, : idx.shape[1]] = src_page_table[b, idx[0]]
        return out
    return types.SimpleNamespace(top_k=top_k, top_k_page_table_transform=top_k_page_table_transform)


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors pass for CUDA ones on an sm90 device (``sm``.``minor``), for the vendor gates and for
    the Triton fallback's fp8 gate alike; caches and the one-time log are reset."""
    from dsa_kernels.triton_ops import fp8_gate

    state = {"sm": 9, "minor": 0, "mla_calls": [], "fi_calls": []}
    monkeypatch.setattr(vendor, "_on_cuda", lambda t: True)
    monkeypatch.setattr(vendor, "_capability", lambda dev: (state["sm"], state["minor"]))
    monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (state["sm"], state["minor"]))
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(state["fi_calls"]))
    install_fake_flash_mla(monkeypatch, "0.3.legacy", 2.0, state["mla_calls"], state)
    vendor.flash_mla_lse_base.cache_clear()
    vendor._LOGGED.clear()
    yield state
    vendor.flash_mla_lse_base.cache_clear()
    vendor._LOGGED.clear()


def mla_inputs(t, h, k, lat, rope, rows, q_dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, lat + rope, generator=gen).to(q_dtype)
    kv = torch.randn(rows, lat + rope, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, rows, (t, k), generator=gen, dtype=torch.int32)
    idx[0, k // 2:] = -1
    if t > 1:
        idx[1] = -1  # fully masked row: FlashMLA's +inf lse must come back as -inf
    return q, kv, idx


# (id, sm major, T, heads, K, latent, rope, q dtype, cache, -> vendor?, h_q of each call, padded K)
MLA_MATRIX = [
    ("glm5-h64-sm90", 9, 3, 64, 128, 512, 64, torch.bfloat16, "bf16", True, (64,), 128),
    ("tp-shard-h16-pad64", 9, 3, 16, 256, 512, 64, torch.bfloat16, "bf16", True, (64,), 256),
    ("h96-pad128", 9, 2, 96, 128, 512, 64, torch.bfloat16, "bf16", True, (128,), 128),
    ("dsv32-h128", 9, 2, 128, 128, 512, 64, torch.bfloat16, "bf16", True, (128,), 128),
    ("h200-two-groups", 9, 2, 200, 128, 512, 64, torch.bfloat16, "bf16", True, (128, 128), 128),
    ("h256-two-groups", 9, 2, 256, 128, 512, 64, torch.bfloat16, "bf16", True, (128, 128), 128),
    ("h64-sm100-pad128", 10, 2, 64, 128, 512, 64, torch.bfloat16, "bf16", True, (128,), 128),
    ("h16-sm100-pad128", 10, 2, 16, 128, 512, 64, torch.bfloat16, "bf16", True, (128,), 128),
    ("k100-pad128", 9, 2, 64, 100, 512, 64, torch.bfloat16, "bf16", True, (64,), 128),
    ("no-rope-d512", 9, 2, 64, 64, 512, 0, torch.bfloat16, "bf16", True, (64,), 128),
    ("q-fp32", 9, 2, 16, 64, 512, 64, torch.float32, "bf16", False, (), 0),
    ("fp8-cache", 9, 2, 16, 64, 512, 64, torch.bfloat16, "fp8", False, (), 0),
    ("tiny-d144", 9, 2, 4, 16, 128, 16, torch.bfloat16, "bf16", False, (), 0),
    ("sm80", 8, 2, 64, 64, 512, 64, torch.bfloat16, "bf16", False, (), 0),
]


@pytest.mark.parametrize("name,sm,t,h,k,lat,rope,q_dtype,cache,to_vendor,h_pad,k_pad", MLA_MATRIX,
                         ids=[m[0] + ("->vendor" if m[9] else "->fallback") for m in MLA_MATRIX])
def test_flash_mla_gating_matrix(fake_gpu, name, sm, t, h, k, lat, rope, q_dtype, cache, to_vendor, h_pad, k_pad):
    fake_gpu["sm"] = sm
    q, kv, idx = mla_inputs(t, h, k, lat, rope, 200, q_dtype)
    if cache == "fp8":  # the same rows in the 656-byte layout: FlashMLA's prefill reads bf16 only
        kv_c, k_pe = kv[:, :lat].float(), kv[:, lat:].float()
        kv = torch.zeros(200, 656, dtype=torch.uint8)
        dispatch.resolve("pack_mla_kv", "cpu", "torch")[1](kv_c, k_pe, kv, torch.arange(200))
        assert "fp8" in vendor.flash_mla_unsupported(q, kv, idx, lat)
    out, lse = vendor.sparse_mla_prefill(q, kv, idx, 0.07, lat)
    want_out, want_lse = reference_mla(q, kv, idx, 0.07, lat)
    calls = [c for c in fake_gpu["mla_calls"] if c[0][0] == t]  # the lse probe calls with T = 4
    if to_vendor:
        assert calls == [((t, h_q, lat + rope), (t, 1, k_pad)) for h_q in h_pad]
    else:
        assert calls == []
    assert out.shape == (t, h, lat) and lse.shape == (t, h)
    assert torch.isneginf(lse[1]).all() and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert (lse[finite] - want_lse[finite]).abs().max() < 1e-3  # natural log either way
    assert (out.float() - want_out).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * want_out.abs().max()


def fp8_inputs(t=2, h=16, k=64, rows=200):
    """GLM-5-shaped q and indices over the same rows packed in the 656-byte fp8 layout."""
    q, kv, idx = mla_inputs(t, h, k, 512, 64, rows)
    fp8 = torch.zeros(rows, 656, dtype=torch.uint8)
    pack = dispatch.resolve("pack_mla_kv", "cpu", "torch")[1]
    pack(kv[:, :512].float().contiguous(), kv[:, 512:].float().contiguous(), fp8, torch.arange(rows))
    return q, fp8, idx


@pytest.mark.parametrize("sm", [(8, 6), (8, 0)], ids=["sm86", "sm80"])
def test_fp8_fallback_refused_below_sm89(fake_gpu, sm):
    """The vendor adapter sends an fp8 cache to Triton (FlashMLA's sparse prefill reads bf16 only),
    whose launcher refuses it below sm89 before any launch: field, expected, got, what to do."""
    fake_gpu["sm"], fake_gpu["minor"] = sm
    q, fp8, idx = fp8_inputs()
    with pytest.raises(ValueError, match=rf"^sparse_mla_prefill on Triton: .* sm89\+ only \(Ada/Hopper/Blackwell\), "
                                         rf"got sm{sm[0]}{sm[1]} on device cpu; set LAYERSPLIT_KERNEL_BACKEND=torch "):
        vendor.sparse_mla_prefill(q, fp8, idx, 0.07, 512)
    assert fake_gpu["mla_calls"] == []


@pytest.mark.parametrize("sm", [(8, 9), (9, 0), (10, 0)], ids=["sm89", "sm90", "sm100"])
def test_fp8_fallback_runs_triton_on_sm89_plus(fake_gpu, sm):
    fake_gpu["sm"], fake_gpu["minor"] = sm
    q, fp8, idx = fp8_inputs()
    out, lse = vendor.sparse_mla_prefill(q, fp8, idx, 0.07, 512)
    want_out, want_lse = reference_mla(q, fp8, idx, 0.07, 512)
    assert [c for c in fake_gpu["mla_calls"] if c[0][0] == 2] == []  # never FlashMLA (the probe: T = 4)
    assert torch.isneginf(lse[1]).all() and torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert (out.float() - want_out).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * want_out.abs().max()


@pytest.mark.parametrize("version,base,expect", [("0.3.legacy", 2.0, 2.0), ("0.4.natural", math.e, math.e),
                                                 ("0.5.garbage", None, None)])
def test_lse_base_measured_per_version(fake_gpu, monkeypatch, caplog, version, base, expect):
    install_fake_flash_mla(monkeypatch, version, base, fake_gpu["mla_calls"], fake_gpu)
    assert vendor.flash_mla_lse_base(version, torch.device("cpu")) == expect
    q, kv, idx = mla_inputs(2, 64, 64, 512, 64, 100)
    with caplog.at_level(logging.WARNING, logger="dsa_kernels.vendor"):
        for _ in range(3):
            _, lse = vendor.sparse_mla_prefill(q, kv, idx, 0.07, 512)
    want = reference_mla(q, kv, idx, 0.07, 512)[1]
    finite = torch.isfinite(want)
    assert (lse[finite] - want[finite]).abs().max() < 1e-3
    fallbacks = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(fallbacks) == (0 if expect else 1), "an unestablished base falls back, logged once"


def test_fallback_logged_once_per_reason(fake_gpu, caplog):
    q, kv, idx = mla_inputs(2, 16, 64, 512, 64, 100, torch.float32)
    with caplog.at_level(logging.WARNING, logger="dsa_kernels.vendor"):
        for _ in range(3):
            vendor.sparse_mla_prefill(q, kv, idx, 0.07, 512)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "q torch.float32" in caplog.records[0].getMessage()


def test_without_vendor_modules_nothing_is_offered(monkeypatch):
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)  # import fails
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", None)
    monkeypatch.setitem(sys.modules, "flash_mla", None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vendor.available() == {}


def test_dispatch_offers_fake_vendor_ops_on_cuda(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dispatch._vendor_ops.cache_clear()
    dispatch._resolve.cache_clear()
    try:
        assert set(vendor.available()) == {"sparse_mla_prefill", "topk_indices", "topk_merge", "topk_slots"}
        for op in ("sparse_mla_prefill", "topk_indices", "topk_merge", "topk_slots"):
            assert dispatch.resolve(op, "cuda", "auto")[0] == "vendor"
            assert dispatch.resolve(op, "cpu", "auto")[0] == "torch"
        assert dispatch.resolve("indexer_scores", "cuda", "auto")[0] == "triton"
    finally:
        dispatch._vendor_ops.cache_clear()
        dispatch._resolve.cache_clear()


def tie_scores(t: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (t, n), generator=gen).float()  # many exact ties
    scores[0, n // 3:] = float("-inf")
    return scores


def assert_sets_equal_up_to_ties(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> None:
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    for r in range(got.shape[0]):
        a, b = set(got[r][got[r] >= 0].tolist()), set(want[r][want[r] >= 0].tolist())
        if a != b:
            kth = scores[r, list(b)].min()
            assert all(scores[r, s] == kth for s in a ^ b), f"row {r}: a non-tie differs"


# (id, dtype, k, n, -> vendor?)
TOPK_MATRIX = [("fp32-k8", torch.float32, 8, 40, True), ("bf16-k8", torch.bfloat16, 8, 40, True),
               ("k-past-row", torch.float32, 50, 40, True), ("fp64", torch.float64, 8, 40, False)]


@pytest.mark.parametrize("name,dtype,k,n,to_vendor", TOPK_MATRIX,
                         ids=[m[0] + ("->vendor" if m[4] else "->fallback") for m in TOPK_MATRIX])
def test_flashinfer_topk_gating_and_sets(fake_gpu, name, dtype, k, n, to_vendor):
    scores = tie_scores(5, n, seed=k).to(dtype)
    got = vendor.topk_indices(scores, k)
    want = ref_indexer.topk_indices(scores, k)
    assert got.shape == want.shape == (5, k) and got.dtype == torch.int32
    assert (fake_gpu["fi_calls"] == ["top_k"]) == to_vendor
    assert_sets_equal_up_to_ties(got, want, scores.float())
    if to_vendor and k < n:
        assert not torch.equal(got.sort(1).values, want.sort(1).values), "the fake's tie order should show"


def test_flashinfer_chunked_merge_sets(fake_gpu):
    scores = tie_scores(4, 70, seed=1)
    best, idx = torch.empty(4, 0), torch.empty(4, 0, dtype=torch.int32)
    for s0 in range(0, 70, 16):
        best, idx = vendor.topk_merge(best, idx, scores[:, s0:s0 + 16], s0, 12)
    got = torch.where(torch.isfinite(best), idx, -1)
    assert "top_k" in fake_gpu["fi_calls"]
    assert_sets_equal_up_to_ties(got, ref_indexer.topk_indices(scores, 12), scores)


def test_flashinfer_topk_slots(fake_gpu):
    scores = tie_scores(3, 130, seed=2)
    page_table = torch.tensor([[4, 1, 7], [0, 2, 3]], dtype=torch.int32)
    req, pos = torch.tensor([1, 0, 1]), torch.tensor([5, 129, 70])
    got = vendor.topk_slots(scores, page_table, req, pos, 9)
    want = ref_indexer.topk_slots(scores, page_table, req, pos, 9)
    assert fake_gpu["fi_calls"][0] == "top_k_page_table_transform"
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    for r in range(3):  # same slots up to ties: compare as sets of the positions' scores
        assert sorted(got[r].tolist()) == sorted(want[r].tolist()) or \
            sorted(scores[r][_slot_to_pos(got[r], page_table[req[r]])].tolist()) == \
            sorted(scores[r][_slot_to_pos(want[r], page_table[req[r]])].tolist())


def _slot_to_pos(slots: torch.Tensor, table_row: torch.Tensor) -> torch.Tensor:
    slots = slots[slots >= 0].long()
    page_of = {int(p): i for i, p in enumerate(table_row.tolist())}
    return torch.tensor([page_of[int(s) // 64] * 64 + int(s) % 64 for s in slots], dtype=torch.long)


def test_flash_mla_found_as_submodule_not_attribute(fake_gpu):
    """The fake's ``flash_mla`` is only in ``sys.modules`` (upstream's package ``__init__`` does not
    import it): the adapter must import it by name; reading the package attribute finds nothing."""
    assert getattr(sys.modules["sgl_kernel"], "flash_mla", None) is None
    found = vendor._flash_mla()
    assert found is not None and found[1] == "sgl_kernel.flash_mla 0.3.legacy"


def test_flash_mla_wheel_module_when_sgl_kernel_has_none(fake_gpu, monkeypatch):
    """sglang 0.5.23's own FlashMLA: the ``flash_mla`` module of the ``sgl-flash-mla`` wheel."""
    wheel = fake_flash_mla_module(2.0, fake_gpu["mla_calls"], fake_gpu)
    wheel.__version__ = "1.0.0"
    monkeypatch.setitem(sys.modules, "sgl_kernel.flash_mla", None)
    monkeypatch.setitem(sys.modules, "flash_mla", wheel)
    assert vendor._flash_mla()[1] == "flash_mla 1.0.0"
    q, kv, idx = mla_inputs(2, 16, 128, 512, 64, 100)
    vendor.sparse_mla_prefill(q, kv, idx, 0.07, 512)
    assert ((2, 64, 576), (2, 1, 128)) in fake_gpu["mla_calls"]


@pytest.mark.parametrize("heads,sm,want", [
    (16, 9, [(0, 16, 64)]), (64, 9, [(0, 64, 64)]), (65, 9, [(0, 65, 128)]), (128, 9, [(0, 128, 128)]),
    (130, 9, [(0, 128, 128), (128, 2, 64)]), (200, 9, [(0, 128, 128), (128, 72, 128)]),
    (16, 10, [(0, 16, 128)]), (256, 10, [(0, 128, 128), (128, 128, 128)])])
def test_flash_mla_head_groups_only_accepted_sizes(heads, sm, want):
    groups = vendor.flash_mla_head_groups(heads, sm)
    assert groups == want
    assert all(h_q in vendor.FLASH_MLA_HEADS[sm] for _, _, h_q in groups)
    assert sum(n for _, n, _ in groups) == heads


def test_flash_mla_probe_that_raises_disables_the_tier(fake_gpu, monkeypatch, caplog):
    """A kernel that refuses the probe's shape (its TORCH_CHECK) turns the tier off, logged; the call
    still returns the Triton result."""
    def refuse(*args):
        raise RuntimeError("h_q must be 64 or 128")

    monkeypatch.setattr(sys.modules["sgl_kernel.flash_mla"], "flash_mla_sparse_fwd", refuse)
    q, kv, idx = mla_inputs(2, 64, 64, 512, 64, 100)
    with caplog.at_level(logging.WARNING, logger="dsa_kernels.vendor"):
        out, lse = vendor.sparse_mla_prefill(q, kv, idx, 0.07, 512)
    assert any("not established" in r.getMessage() for r in caplog.records)
    want_out, want_lse = reference_mla(q, kv, idx, 0.07, 512)
    finite = torch.isfinite(want_lse)
    assert (lse[finite] - want_lse[finite]).abs().max() < 1e-3
