"""Sparse MLA prefill over the fp8-layout cache (uint8 ``[S, L + 4L/128 + 2R]``, ``dsa_kernels.layout``).

Triton (rows dequantized in registers) against the torch reference (rows dequantized by
``unpack_mla_kv``), and the fp8 op against the bf16 op on the same latent rows, within e4m3's error.
The Triton launcher's sm89 gate (refused before any launch below it) and the fp8 path's 8 warps are
driven on CPU through its capability seam.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsa_kernels import layout
from tests.dsa_kernels.helpers import assert_same_inf, op

CPU = torch.device("cpu")
E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: rounding moves a normal value by at most 2^-4 of it
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6 * scale the grid step is 2^-9 * scale

# (tokens, heads, top-k, latent, rope, cache rows); rows > 64 put indices on both sides of page edges
SHAPES = {
    "t1-h1-k1": (1, 1, 1, 128, 16, 10),
    "t5-h3-k31-r64": (5, 3, 31, 128, 64, 130),
    "t7-h17-k33-r32": (7, 17, 33, 256, 32, 200),  # two head blocks, a K tail, two latent tiles
    "t3-h16-k45-glm656": (3, 16, 45, 512, 64, 150),  # GLM-5's 656-byte row
    "t4-h5-k19-r17-unaligned": (4, 5, 19, 128, 17, 90),  # 166-byte rows: scales not 4-byte aligned
    "t4-h2-k150-short": (4, 2, 150, 128, 16, 70),  # top-k past the context: mostly -1
    "t0": (0, 4, 8, 128, 16, 10),
}
PAGE_EDGE = [62, 63, 64, 65, 127, 128, 129]  # slots around PAGE_SIZE boundaries


def pack_both(kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows as a bf16 cache and an fp8-layout cache (the torch reference writes both)."""
    rows, lat = kv_c.shape
    rope = k_pe.shape[1]
    bf16 = torch.zeros(rows, lat + rope, dtype=torch.bfloat16)
    fp8 = torch.zeros(rows, layout.mla_row_bytes(lat, rope, "fp8"), dtype=torch.uint8)
    for cache in (bf16, fp8):
        op("pack_mla_kv", "torch", CPU)(kv_c, k_pe, cache, torch.arange(rows))
    return bf16, fp8


def build(t, h, k, lat, rope, rows, seed):
    """q bf16, bf16-exact latent rows (so the bf16 cache holds them exactly), both caches, indices
    with -1 holes anywhere, indices past the cache, page-edge slots and one fully masked row."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, lat + rope, generator=gen).to(torch.bfloat16)
    tile_mag = 4 * torch.rand(rows, lat // 128, generator=gen).repeat_interleave(128, dim=1)  # scales differ per tile
    kv_c = (torch.randn(rows, lat, generator=gen) * tile_mag).bfloat16().float()
    k_pe = torch.randn(rows, rope, generator=gen)
    bf16, fp8 = pack_both(kv_c, k_pe)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        n = min(k, rows, int(torch.randint(1, k + 1, (1,), generator=gen)))
        idx[i, :n] = torch.randperm(rows, generator=gen)[:n].int()
        idx[i] = idx[i][torch.randperm(k, generator=gen)]
    edge = torch.tensor([s for s in PAGE_EDGE if s < rows] + [rows, rows + 5], dtype=torch.int32)
    m = min(k // 2, len(edge))
    if t > 0:
        idx[0, :m] = edge[:m]  # page edges, then indices past the cache (masked like -1)
    if t > 2:
        idx[1] = -1  # a fully masked query row
    return q, bf16, fp8, idx


def sm_scale_of(lat: int, rope: int) -> float:
    return 1.0 / math.sqrt(lat // 4 + rope)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["q-bf16", "q-fp32"])
def test_triton_matches_reference(device, name, q_dtype):
    t, h, k, lat, rope, rows = SHAPES[name]
    q, _, fp8, idx = build(t, h, k, lat, rope, rows, seed=t * 31 + h)
    q = q.to(q_dtype)
    args = (q.to(device), fp8.to(device), idx.to(device), sm_scale_of(lat, rope), lat)
    out, lse = op("sparse_mla_prefill", "triton", device)(*args)
    want_out, want_lse = op("sparse_mla_prefill", "torch", CPU)(q, fp8, idx, sm_scale_of(lat, rope), lat)
    assert out.shape == (t, h, lat) and out.dtype == q_dtype and lse.shape == (t, h) and lse.dtype == torch.float32
    assert_same_inf(lse.cpu(), want_lse)
    assert not torch.isnan(out).any()
    if t == 0:
        return
    if t > 2:
        assert torch.equal(out[1].cpu().float(), torch.zeros(h, lat)), "fully masked row"
    # interpreter: fp32 throughout, so one rounding to out's dtype (bf16: 2 eps) or fp32 summation
    # order; a GPU also rounds q, p and the dequantized rows to bf16 for the dots
    rtol = max(2 * torch.finfo(out.dtype).eps, 1e-5)
    if device.type == "cuda":
        rtol += 4 * torch.finfo(torch.bfloat16).eps
    scale = want_out.abs().max().clamp_min(1.0)
    assert (out.cpu().float() - want_out).abs().max() <= rtol * scale
    finite = torch.isfinite(want_lse)
    lse_tol = 1e-5 if device.type == "cpu" else 1e-2
    assert (lse.cpu()[finite] - want_lse[finite]).abs().max() <= lse_tol * want_lse[finite].abs().max().clamp_min(1.0)


def value_bound(fp8: torch.Tensor, lat: int) -> torch.Tensor:
    """Per cache row and latent element, how far the fp8 value may be from the bf16-exact one:
    ``2^-4 |x| + 2^-10 s_tile`` (half an e4m3 ulp, normal or subnormal) ``[S, L]``."""
    kv_c, _ = op("unpack_mla_kv", "torch", CPU)(fp8, torch.arange(fp8.shape[0]), lat)
    scales = fp8[:, lat: lat + 4 * (lat // 128)].contiguous().view(torch.float32)  # [S, L/128]
    return E4M3_HALF_ULP * kv_c.abs() + E4M3_SUBNORMAL_HALF_STEP * scales.repeat_interleave(128, dim=1)


def lse_bound(q, fp8, idx, lat, sm_scale) -> torch.Tensor:
    """Per (t, h), the largest move of any logit from bf16 to fp8 rows, ``sm_scale * sum_d |q_d|
    value_bound_d`` over the latent (rope is bf16 in both): lse moves by at most that."""
    valid = (idx >= 0) & (idx < fp8.shape[0])
    err = value_bound(fp8, lat)[torch.where(valid, idx, 0).long()] * valid[..., None]  # [T, K, L]
    return sm_scale * torch.einsum("thl,tkl->thk", q[..., :lat].float().abs(), err).amax(-1)


def run_both(backend_fp8, device, q, bf16, fp8, idx, sm_scale, lat):
    """``(fp8 op, bf16 op)`` results on the same rows; q in fp32 so only the cache's precision differs."""
    out8, lse8 = op("sparse_mla_prefill", backend_fp8, device)(q.to(device), fp8.to(device), idx.to(device),
                                                               sm_scale, lat)
    out16, lse16 = op("sparse_mla_prefill", "torch", CPU)(q, bf16, idx, sm_scale, lat)
    return out8.cpu().float(), lse8.cpu(), out16, lse16


@pytest.mark.parametrize("backend_fp8", ["torch", "triton"])
@pytest.mark.parametrize("name", ["t5-h3-k31-r64", "t3-h16-k45-glm656", "t4-h5-k19-r17-unaligned"])
def test_fp8_close_to_bf16_op(device, backend_fp8, name):
    """fp8 vs bf16 on the same (bf16-exact) rows. e4m3 keeps 3 mantissa bits, so every dequantized
    latent is within half an ulp, ``2^-4`` of its value (``2^-10 x scale`` among subnormals), of the
    bf16 one (``value_bound``). Then:

    * lse moves by at most its largest logit move (``lse_bound``): a worst case, checked as such;
    * out = softmax-weighted mean of the values: the values' own error is <= 2^-4 relative, and the
      weights move with the logits, by the same order at logits of O(1) spread; relative RMS <= 2 x
      2^-4 (measured: 0.03 to 0.08 over these shapes).
    """
    t, h, k, lat, rope, rows = SHAPES[name]
    q, bf16, fp8, idx = build(t, h, k, lat, rope, rows, seed=7 + t)
    sm_scale = sm_scale_of(lat, rope)
    out8, lse8, out16, lse16 = run_both(backend_fp8, device, q.float(), bf16, fp8, idx, sm_scale, lat)
    assert_same_inf(lse8, lse16)
    finite = torch.isfinite(lse16)
    assert ((lse8 - lse16).abs()[finite] <= lse_bound(q, fp8, idx, lat, sm_scale)[finite] + 1e-5).all()
    rel_rms = ((out8 - out16).pow(2).mean() / out16.pow(2).mean()).sqrt()
    assert rel_rms <= 2 * E4M3_HALF_ULP, f"relative RMS {rel_rms:.4f} above two e4m3 half ulps"


@pytest.mark.parametrize("backend_fp8", ["torch", "triton"])
def test_one_valid_index_out_is_the_row_within_half_ulp(device, backend_fp8):
    """With one valid index per query the weight is 1 on both paths and out is that row's latent:
    elementwise within ``value_bound`` of the bf16 op's (the value path alone, a worst case)."""
    q, bf16, fp8, _ = build(5, 3, 1, 256, 32, 140, seed=11)
    idx = torch.tensor([[-1, 63, -1], [64, -1, 999], [0, -1, -1], [139, -1, -1], [127, -1, -1]], dtype=torch.int32)
    out8, _, out16, _ = run_both(backend_fp8, device, q.float(), bf16, fp8, idx, 0.1, 256)
    bound = value_bound(fp8, 256)[torch.tensor([63, 64, 0, 139, 127])]  # [T, L]
    assert ((out8 - out16).abs() <= bound[:, None, :] + 1e-5).all()  # slack: the fp32 x / scale
    assert (out8 != out16).any(), "no rounding at all: the rows were not quantized"


def test_invalid_rows_never_read(backend, device):
    """Rows no index selects may hold any bytes (here 0x7F: e4m3 NaN, scales and rope of 3.4e38), row 0
    (where masked lanes point) among them: the result equals that of a clean cache, and an index past
    the cache or < -1 is masked like -1."""
    q, _, fp8, idx = build(4, 3, 12, 128, 16, 70, seed=3)
    idx = torch.where(idx == 0, -1, idx)  # keep row 0 unused, hence dirty
    dirty = fp8.clone()
    used = set(idx[(idx >= 0) & (idx < 70)].tolist())
    unused = torch.tensor([s for s in range(70) if s not in used])
    dirty[unused] = 0x7F  # NaN latent bytes, NaN scales, NaN rope
    bad = idx.clone()
    bad[2, :3] = torch.tensor([70, 2**31 - 1, -9], dtype=torch.int32)
    clean = torch.where((bad >= 0) & (bad < 70), bad, -1)
    fn = op("sparse_mla_prefill", backend, device)
    out, lse = fn(q.to(device), dirty.to(device), bad.to(device), 0.1, 128)
    want_out, want_lse = fn(q.to(device), fp8.to(device), clean.to(device), 0.1, 128)
    assert_same_inf(lse.cpu(), want_lse.cpu())
    assert torch.equal(out.cpu(), want_out.cpu()) and torch.isneginf(lse[1]).all()


def test_all_invalid_row_is_zero_and_minus_inf(backend, device):
    q, _, fp8, _ = build(2, 4, 9, 256, 32, 20, seed=4)
    idx = torch.tensor([[-1] * 9, [20, 21, -1, 99, -1, -1, 25, -1, -1]], dtype=torch.int32)  # nothing valid
    out, lse = op("sparse_mla_prefill", backend, device)(q.to(device), fp8.to(device), idx.to(device), 0.1, 256)
    assert torch.equal(out.cpu().float(), torch.zeros(2, 4, 256)) and torch.isneginf(lse.cpu()).all()


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_bad_fp8_input_errors(backend_name):
    """Field, expected, got — the same on both backends (the contract runs before either)."""
    q, _, fp8, idx = build(2, 2, 4, 128, 16, 10, seed=1)
    fn = op("sparse_mla_prefill", backend_name, CPU)
    with pytest.raises(ValueError, match=r"kv_cache: expected fp8-layout rows of 164 B \(latent 128 \+ rope 16, "
                                         r"from q's last dim 144\), got 165 B"):
        fn(q, torch.zeros(10, 165, dtype=torch.uint8), idx, 0.1, 128)
    with pytest.raises(ValueError, match="kv_cache: expected fp8-layout rows of 196 B"):
        fn(torch.zeros(2, 2, 128 + 32), fp8, idx, 0.1, 128)  # q's rope (32) disagrees with the cache's (16)
    with pytest.raises(ValueError, match="kv_lora_rank: expected a multiple of 128 for an fp8-layout"):
        fn(torch.zeros(2, 2, 64 + 16), torch.zeros(10, 64 + 2 + 32, dtype=torch.uint8), idx, 0.1, 64)
    with pytest.raises(ValueError, match=r"kv_cache: expected dtype in .*got torch.int8"):
        fn(q, fp8.view(torch.int8), idx, 0.1, 128)


def test_every_e4m3_byte_dequantizes_as_torch(backend, device):
    """All 254 finite e4m3 bytes (subnormals, both zeros, +-448) times an fp32 scale that is no power
    of two: with one valid index, out is the dequantized row itself, bit for bit torch's
    ``byte.view(float8_e4m3fn).float() * scale``."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # the two NaN codes
    lat, rope = 128, 16
    cache = torch.zeros(4, layout.mla_row_bytes(lat, rope, "fp8"), dtype=torch.uint8)
    scales = torch.tensor([0.37, 0.37, 3.1e-5, 3.1e-5])
    for row in range(4):
        cache[row, :lat] = codes[(row % 2) * lat:(row % 2 + 1) * lat]
        cache[row, lat:lat + 4] = scales[row:row + 1].view(torch.uint8)
    q = torch.zeros(4, 1, lat + rope)
    idx = torch.arange(4, dtype=torch.int32)[:, None]
    out, _ = op("sparse_mla_prefill", backend, device)(q.to(device), cache.to(device), idx.to(device), 0.1, lat)
    want = cache[:, :lat].view(torch.float8_e4m3fn).float() * scales[:, None]
    assert torch.equal(out.cpu()[:, 0], want)


# the sm89 gate and the fp8 launch width (``triton_ops.sparse_mla``), driven on CPU through the launcher's
# capability seam: the interpreter runs the kernel whatever the fake device says

class LaunchRecorder:
    """Stands in for the ``@triton.jit`` kernel: records each launch's ``num_warps``, then launches the
    real kernel (``refuse``: fails the test if anything launches at all)."""

    def __init__(self, kernel, refuse: bool = False):
        self.kernel, self.refuse, self.num_warps = kernel, refuse, []

    def __getitem__(self, grid):
        assert not self.refuse, "the kernel was launched: the gate must refuse before any launch"

        def launch(*args, **kwargs):
            self.num_warps.append(kwargs["num_warps"])
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def fake_sm(monkeypatch):
    """``fake_sm(major, minor)``: the Triton launcher sees its tensors on a CUDA device of that capability."""
    from dsa_kernels.triton_ops import fp8_gate

    def set_sm(major: int, minor: int) -> None:
        monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (major, minor))
    return set_sm


def _launcher_with_recorder(monkeypatch, refuse: bool = False) -> LaunchRecorder:
    from dsa_kernels.triton_ops import sparse_mla

    recorder = LaunchRecorder(sparse_mla._sparse_mla_prefill_kernel, refuse)
    monkeypatch.setattr(sparse_mla, "_sparse_mla_prefill_kernel", recorder)
    return recorder


@pytest.mark.parametrize("sm", [(8, 6), (8, 0), (7, 5)], ids=["sm86", "sm80", "sm75"])
def test_fp8_cache_refused_below_sm89_before_launch(monkeypatch, fake_sm, sm):
    q, bf16, fp8, idx = build(3, 2, 8, 128, 16, 40, seed=5)
    fake_sm(*sm)
    _launcher_with_recorder(monkeypatch, refuse=True)
    want = (rf"^sparse_mla_prefill on Triton: its kernel uses e4m3 \(tl.float8e4nv\), which Triton compiles for "
            rf"sm89\+ only \(Ada/Hopper/Blackwell\), got sm{sm[0]}{sm[1]} on device cpu; set "
            rf"LAYERSPLIT_KERNEL_BACKEND=torch to run the torch reference instead, or use --kv-dtype bf16 ")
    with pytest.raises(ValueError, match=want):
        op("sparse_mla_prefill", "triton", CPU)(q, fp8, idx, 0.1, 128)
    op("sparse_mla_prefill", "torch", CPU)(q, fp8, idx, 0.1, 128)  # the reference reads fp8 anywhere


def test_bf16_cache_not_gated_and_keeps_four_warps(monkeypatch, fake_sm):
    from dsa_kernels.triton_ops.sparse_mla import BF16_NUM_WARPS

    q, bf16, _, idx = build(3, 2, 8, 128, 16, 40, seed=5)
    fake_sm(8, 6)
    recorder = _launcher_with_recorder(monkeypatch)
    out, lse = op("sparse_mla_prefill", "triton", CPU)(q, bf16, idx, 0.1, 128)
    assert recorder.num_warps == [BF16_NUM_WARPS] == [4]
    want_out, want_lse = op("sparse_mla_prefill", "torch", CPU)(q, bf16, idx, 0.1, 128)
    assert_same_inf(lse, want_lse)
    assert (out.float() - want_out).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * want_out.abs().max()


@pytest.mark.parametrize("sm", [(8, 9), (9, 0), (10, 0), (12, 0)], ids=["sm89", "sm90", "sm100", "sm120"])
def test_fp8_cache_passes_the_gate_on_sm89_plus_with_eight_warps(monkeypatch, fake_sm, sm):
    """Past the gate the fp8 path launches with ``FP8_NUM_WARPS`` = 8 (sm90's ptxas spills 220/204 B
    at 4 warps, 12/8 B at 8) and gives the result of an ungated launch, bit for bit."""
    from dsa_kernels.triton_ops.sparse_mla import FP8_NUM_WARPS

    q, _, fp8, idx = build(3, 17, 33, 256, 32, 90, seed=6)  # two head blocks, a K tail, two latent tiles
    plain = op("sparse_mla_prefill", "triton", CPU)(q, fp8, idx, 0.1, 256)
    fake_sm(*sm)
    recorder = _launcher_with_recorder(monkeypatch)
    out, lse = op("sparse_mla_prefill", "triton", CPU)(q, fp8, idx, 0.1, 256)
    assert recorder.num_warps == [FP8_NUM_WARPS] == [8]
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_gate_reads_the_real_capability_only_on_cuda():
    """Off CUDA the seam answers None (nothing to gate: the interpreter, the CPU reference path)."""
    from dsa_kernels.triton_ops.fp8_gate import cuda_capability, e4m3_unsupported

    cache = torch.zeros(4, 164, dtype=torch.uint8)
    assert cuda_capability(cache) is None and e4m3_unsupported("sparse_mla_prefill", cache) is None
