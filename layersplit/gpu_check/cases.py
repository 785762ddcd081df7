"""Kernel cases of the GPU check: one :class:`OpCase` per op and shape, with the check that fits it
(exact equality for layouts and gathers, the kernel tests' tolerances for indexer and attention; for
sparse MLA over the fp8 cache also relative RMS and cosine against the bf16 cache's output) and the
FLOP or byte count of one call. Used by :mod:`layersplit.gpu_check.run`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Shapes:
    """Problem sizes of one mode (GLM-5: indexer 32 x 128, MLA latent 512 + rope 64, top-k 2048)."""

    index_tokens: int  # indexer query rows (the last rows of one request's context)
    index_heads: int
    index_dim: int
    context: int  # indexer context tokens
    attn_tokens: int
    attn_heads: int
    kv_lora_rank: int
    rope_dim: int
    topk: int
    kv_rows: int  # MLA cache rows the sparse attention draws from
    key_rows: int  # rows quantized / packed
    pool_pages: int  # pages in the gather/scatter pool (bf16 MLA pages of 64 rows)
    moved_pages: int
    warmup: int
    repeats: int
    stress_loads: int
    stress_unsafe: tuple[str, ...]  # waits dropped, one stress run each
    overlap_argv: tuple[str, ...]
    cp_context: int  # tiny-model prefill: context tokens, 90% of it a cached prefix
    link_context: int  # the same, for the one-process overlap measurement (link_overlap)
    estimates_s: tuple[tuple[str, float], ...]  # section -> expected seconds (the deadline's unit)

@dataclass
class OpCase:
    """One op at one shape. ``make()`` builds fresh output buffers and returns ``run(fn) -> outputs``;
    ``work`` is the FLOP or byte count of one call (``formula``), compared with the ``peak`` key."""

    op: str
    label: str
    make: Callable[[], Callable[[Callable], object]]
    check: Callable[[object, object, str], dict]  # (got, want, backend that ran) -> verdict
    work: float
    unit: str  # "FLOP" | "B"
    formula: str
    peak: str
    fixed: Callable | None = None  # ops outside the dispatch (torch only)
    kernel: Callable[[str], str] | None = None  # backend -> the kernel that really runs (vendor may fall back)
    refused: Callable[[str], str | None] | None = None  # backend -> why this device refuses it (a capability gate)
    # a FLOP case's bytes read too, compared with HBM: the kernel that ran -> (bytes, what they count)
    bytes_read: Callable[[str], tuple[int, str]] | None = None


def _tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def check_exact(got, want, backend: str = "torch") -> dict:
    """Data movement and fp8 packing of representable values: bit-exact."""
    same = all(torch.equal(a, b) for a, b in zip(_tuple(got), _tuple(want)))
    return {"passed": same, "check": "exact" if same else "exact: bytes differ"}


def _inf_match(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (not torch.isnan(got).any() and torch.equal(torch.isinf(got), torch.isinf(want))
            and torch.equal(got[torch.isinf(got)], want[torch.isinf(want)]))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1.0)
    return float((got[finite].float() - want[finite].float()).abs().max() / scale)


def check_indexer(tol: float) -> Callable[[object, object], dict]:
    """Scores: NaN/-inf positions first, then max error <= ``tol`` x max(|score|, 1) (tests' rule)."""
    def check(got, want, backend: str = "torch") -> dict:
        inf_ok, err = _inf_match(got, want), _rel_err(got, want)
        return {"passed": inf_ok and err <= tol, "max_rel_err": err, "tol": tol,
                "check": f"-inf mask {'same' if inf_ok else 'DIFFERS'}, rel err {err:.1e} <= {tol:.0e}"}
    return check


BF16_DOT_TOL = 2 * torch.finfo(torch.bfloat16).eps  # 1.6e-2 of max|out|: q and p rounded to bf16 before the dots


def dots_in_bf16(backend: str, device: torch.device) -> bool:
    """Does sparse MLA dot bf16 operands on this path? FlashMLA does, and so does the Triton kernel
    on a GPU (``DOT_BF16``: q and the probabilities rounded to bf16); the torch reference and the
    Triton interpreter keep fp32. A vendor call the gate refuses runs the Triton kernel: bf16 too."""
    return device.type == "cuda" and backend != "torch"


def check_sparse_mla(lse_tol: float, device: torch.device) -> Callable[[object, object, str], dict]:
    """``out`` within the tolerance of the path that ran (bf16 dots: ``BF16_DOT_TOL``; fp32 dots:
    2 eps of out's dtype, at least 1e-5) x max|out|; ``lse`` -inf rows equal, then ``lse_tol``."""
    def check(got, want, backend: str = "torch") -> dict:
        (out, lse), (w_out, w_lse) = got, want
        out_tol = max(2 * torch.finfo(out.dtype).eps, 1e-5)
        if dots_in_bf16(backend, device):
            out_tol = max(out_tol, BF16_DOT_TOL)
        inf_ok = _inf_match(lse.float(), w_lse) and not torch.isnan(out).any()
        out_err = float((out.float() - w_out).abs().max() / w_out.abs().max().clamp_min(1.0))
        lse_err = _rel_err(lse, w_lse)
        passed = inf_ok and out_err <= out_tol and lse_err <= lse_tol
        return {"passed": passed, "max_rel_err": out_err, "lse_rel_err": lse_err, "tol": out_tol,
                "check": f"-inf lse {'same' if inf_ok else 'DIFFERS'}, out {out_err:.1e} <= {out_tol:.0e}, "
                         f"lse {lse_err:.1e} <= {lse_tol:.0e}"}
    return check


E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: rounding moves a normal value by at most 2^-4 of it
# fp8 vs bf16 cache, sparse MLA's out: the values' own error is <= 2^-4 relative and the softmax weights
# move by the same order (the kernel tests' bound, tests/dsa_kernels/test_sparse_mla_fp8.py)
FP8_REL_RMS_TOL = 2 * E4M3_HALF_ULP
FP8_MIN_COS = math.sqrt(1 - FP8_REL_RMS_TOL**2)  # a row within relative error r has cosine >= sqrt(1 - r^2)


def check_fp8_vs_bf16(got, bf16) -> dict:
    """Sparse MLA's ``(out, lse)`` over the fp8 cache against the bf16 cache's over the same rows: NaN
    and the -inf lse positions first, rows with no valid index 0, then the relative RMS of ``out`` <=
    ``FP8_REL_RMS_TOL`` and its lowest per-(token, head) cosine >= ``FP8_MIN_COS``."""
    (out, lse), (w_out, w_lse) = got, bf16
    out = out.float()
    live = torch.isfinite(w_lse)  # [T, H]: rows with a valid index
    inf_ok = _inf_match(lse.float(), w_lse) and not torch.isnan(out).any() and bool((out[~live] == 0).all())
    rms = float((out - w_out).pow(2).mean().sqrt() / w_out.pow(2).mean().sqrt().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(out[live], w_out[live], dim=-1).min()) if live.any() else 1.0
    passed = inf_ok and rms <= FP8_REL_RMS_TOL and cos >= FP8_MIN_COS
    return {"passed": passed, "rel_rms": rms, "min_cosine": cos, "rel_rms_tol": FP8_REL_RMS_TOL,
            "min_cosine_tol": FP8_MIN_COS,
            "check": f"-inf lse and masked rows {'same' if inf_ok else 'DIFFER'}, rel RMS {rms:.1e} <= "
                     f"{FP8_REL_RMS_TOL:.2g}, min cosine {cos:.4f} >= {FP8_MIN_COS:.4f}"}


def check_sparse_mla_fp8(lse_tol: float, device: torch.device, bf16: Callable[[], tuple]) -> Callable:
    """The fp8-cache result against the torch reference over the same bytes (``check_sparse_mla``: the
    path's own dot precision), and against the bf16 cache's result ``bf16()`` within fp8's error."""
    same_bytes = check_sparse_mla(lse_tol, device)

    def check(got, want, backend: str = "torch") -> dict:
        exact, vs_bf16 = same_bytes(got, want, backend), check_fp8_vs_bf16(got, bf16())
        return exact | {"passed": exact["passed"] and vs_bf16["passed"], "fp8_vs_bf16": vs_bf16,
                        "check": f"{exact['check']}; vs bf16 cache: {vs_bf16['check']}"}
    return check


def fp8_exact_rows(n: int, d: int, gen: torch.Generator, tile: int) -> torch.Tensor:
    """Rows whose per-``tile`` e4m3 quantization is exact (as in the kernel tests), so every backend
    must produce the same bytes: e4m3 values times a power of 2, with +-448 in every tile."""
    vals = torch.randn(n, d, generator=gen).to(torch.float8_e4m3fn).float().view(n, d // tile, tile)
    vals[:, :, 0] = 448.0 * torch.sign(torch.randn(n, d // tile, generator=gen))
    exps = torch.randint(-10, 6, (n, d // tile), generator=gen).float()
    return (vals * torch.exp2(exps)[..., None]).view(n, d)


def _ref(op: str, dev: torch.device) -> Callable:
    from dsa_kernels.dispatch import resolve

    return resolve(op, dev, "torch")[1]


def e4m3_refused(op: str, t: torch.Tensor) -> Callable[[str], str | None]:
    """``OpCase.refused`` of a case whose Triton kernel uses e4m3 (``fp8_gate``: the index-key ops, the
    MLA-cache ops over an fp8 cache): on a device below sm89 the Triton backend, and the vendor one (whose
    fallback is Triton), are refused with the launcher's own reason; the torch reference never is."""
    from dsa_kernels.triton_ops import fp8_gate

    assert op in fp8_gate.E4M3_OPS, f"{op}: its Triton kernel uses no e4m3 (fp8_gate.E4M3_OPS)"
    return lambda backend: None if backend == "torch" else fp8_gate.e4m3_unsupported(op, t)


def index_key_cases(s: Shapes, dev: torch.device, gen: torch.Generator) -> list[OpCase]:
    """quantize: read ``n*D*2`` (bf16 keys) + slots, write ``n*(D+4)``; dequantize: the reverse in fp32."""
    from dsa_kernels.layout import index_page_bytes

    n, d = s.key_rows, s.index_dim
    pages = -(-n // 64) + 1
    keys = fp8_exact_rows(n, d, gen, d).to(torch.bfloat16).to(dev)
    slots = torch.randperm(pages * 64, generator=gen)[:n].to(dev)
    filled = torch.zeros(pages, index_page_bytes(d), dtype=torch.uint8, device=dev)
    _ref("quantize_index_keys", dev)(keys, filled, slots)

    def make_quantize():
        cache = torch.zeros_like(filled)
        return lambda fn: (fn(keys, cache, slots), cache)[1]
    io = n * (d + 4) + slots.nbytes
    return [
        OpCase("quantize_index_keys", f"quantize_index_keys n={n} D={d}", make_quantize, check_exact,
               keys.nbytes + io, "B", "n*D*2 + n*(D+4) + slot bytes", "hbm",
               refused=e4m3_refused("quantize_index_keys", filled)),
        OpCase("dequantize_index_keys", f"dequantize_index_keys n={n} D={d}",
               lambda: lambda fn: fn(filled, slots), check_exact, io + n * d * 4, "B",
               "n*(D+4) + slot bytes + n*D*4", "hbm", refused=e4m3_refused("dequantize_index_keys", filled)),
    ]


def mla_kv_cases(s: Shapes, dev: torch.device, gen: torch.Generator) -> list[OpCase]:
    """pack: read bf16 ``kv_c``/``k_pe`` + slots, write ``n*row_bytes``; unpack: read rows, write fp32."""
    from dsa_kernels.layout import mla_row_bytes

    n, lat, rope = s.key_rows, s.kv_lora_rank, s.rope_dim
    rows = (-(-n // 64) + 1) * 64  # one slot per packed row, scattered over a cache a page larger
    kv_c = fp8_exact_rows(n, lat, gen, 128).to(torch.bfloat16).to(dev)
    k_pe = torch.randn(n, rope, generator=gen).to(torch.bfloat16).to(dev)
    slots = torch.randperm(rows, generator=gen)[:n].to(dev)
    cases = []
    for kv_dtype in ("bf16", "fp8"):
        row = mla_row_bytes(lat, rope, kv_dtype)
        bf16 = kv_dtype == "bf16"
        shape, dtype = ((rows, row // 2), torch.bfloat16) if bf16 else ((rows, row), torch.uint8)
        filled = torch.zeros(shape, dtype=dtype, device=dev)
        _ref("pack_mla_kv", dev)(kv_c, k_pe, filled, slots)

        def make_pack(shape=shape, dtype=dtype):
            cache = torch.zeros(shape, dtype=dtype, device=dev)
            return lambda fn: (fn(kv_c, k_pe, cache, slots), cache)[1]
        cases += [
            OpCase("pack_mla_kv", f"pack_mla_kv[{kv_dtype}] n={n}", make_pack, check_exact,
                   kv_c.nbytes + k_pe.nbytes + slots.nbytes + n * row, "B", "n*(L+R)*2 + slot bytes + n*row_bytes",
                   "hbm", refused=None if bf16 else e4m3_refused("pack_mla_kv", filled)),
            OpCase("unpack_mla_kv", f"unpack_mla_kv[{kv_dtype}] n={n}",
                   lambda filled=filled: lambda fn: fn(filled, slots, lat), check_exact,
                   n * row + slots.nbytes + n * (lat + rope) * 4, "B", "n*row_bytes + slot bytes + n*(L+R)*4", "hbm",
                   refused=None if bf16 else e4m3_refused("unpack_mla_kv", filled)),
        ]
    return cases


def indexer_cases(s: Shapes, dev: torch.device, gen: torch.Generator) -> list[OpCase]:
    """Scores over one request's paged fp8 keys for its last ``T`` positions.

    FLOPs = ``2 * H * D * pairs`` with ``pairs = sum_t (pos_t + 1)`` the unmasked (causal) query/key
    pairs. top-k (torch only): reads ``T*ctx*4`` B, writes ``T*k*4`` B.
    """
    from dsa_kernels.layout import index_page_bytes

    t, h, d, ctx = s.index_tokens, s.index_heads, s.index_dim, s.context
    pages = -(-ctx // 64)
    table = torch.randperm(pages, generator=gen).to(torch.int32)[None].to(dev)
    cache = torch.zeros(pages, index_page_bytes(d), dtype=torch.uint8, device=dev)
    pos_all = torch.arange(ctx, device=dev)
    slots = table[0, pos_all // 64].long() * 64 + pos_all % 64
    _ref("quantize_index_keys", dev)(torch.randn(ctx, d, generator=gen).to(dev), cache, slots)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.rand(t, h, generator=gen).to(dev)
    req = torch.zeros(t, dtype=torch.int32, device=dev)
    pos = torch.arange(ctx - t, ctx, device=dev)
    pairs = t * (2 * ctx - t + 1) // 2  # sum of pos + 1 over the last t positions, on the host
    tol = 2e-2 if dev.type == "cuda" else 1e-4  # tl.dot may use tf32 on CUDA
    scores = functools.cache(lambda: _ref("indexer_scores", dev)(q, w, cache, table, req, pos, ctx))
    from dsa_kernels.reference.indexer import topk_indices

    def check_topk(got, _want, backend: str = "torch") -> dict:
        ok = bool(torch.equal((got >= 0).sum(1), (pos + 1).clamp(max=s.topk)))
        return {"passed": ok, "check": "valid count = min(pos + 1, k)" + ("" if ok else ": DIFFERS")}
    return [
        OpCase("indexer_scores", f"indexer_scores T={t} H={h} D={d} ctx={ctx}",
               lambda: lambda fn: fn(q, w, cache, table, req, pos, ctx), check_indexer(tol),
               2 * h * d * pairs, "FLOP", "2*H*D*sum_t(pos_t+1)", "flops_fp8",
               refused=e4m3_refused("indexer_scores", cache)),
        OpCase("topk_indices", f"topk_indices T={t} ctx={ctx} k={s.topk}", lambda: lambda fn: fn(scores(), s.topk),
               check_topk, t * ctx * 4 + t * s.topk * 4, "B", "T*ctx*4 + T*k*4", "hbm", fixed=topk_indices),
    ]


def sparse_mla_cases(s: Shapes, dev: torch.device, gen: torch.Generator) -> list[OpCase]:
    """The bf16 cache, and the same rows packed (``pack_mla_kv``, the reference) into the fp8 layout,
    read with the same q and indices; row 0 is half -1 padding and row 1 fully masked, as edge cases.

    FLOPs = ``2 * H * ((L+R) + L) * valid`` (q.k over L+R, p.v over L) per valid (token, index) pair;
    bytes read follow the kernel that ran (:func:`sparse_mla_bytes_read`). Both dot bf16 operands on a
    GPU (the fp8 rows dequantized in registers), so both FLOP rates are held to the bf16 peak, and the
    bytes to HBM's.
    """
    from dsa_kernels.layout import mla_row_bytes

    t, h, lat, rope, k = s.attn_tokens, s.attn_heads, s.kv_lora_rank, s.rope_dim, s.topk
    q = torch.randn(t, h, lat + rope, generator=gen).to(torch.bfloat16).to(dev)
    kv = torch.randn(s.kv_rows, lat + rope, generator=gen).to(torch.bfloat16).to(dev)
    kv8 = torch.zeros(s.kv_rows, mla_row_bytes(lat, rope, "fp8"), dtype=torch.uint8, device=dev)
    _ref("pack_mla_kv", dev)(kv[:, :lat].contiguous(), kv[:, lat:].contiguous(), kv8,
                             torch.arange(s.kv_rows, device=dev))
    idx = torch.randint(0, s.kv_rows, (t, k), generator=gen, dtype=torch.int32)
    idx[0, k // 2:] = -1
    idx[1] = -1
    valid = int((idx >= 0).sum())  # on the host, before the move
    idx = idx.to(dev)
    scale = 1.0 / math.sqrt(lat + rope)
    lse_tol = 1e-2 if dev.type == "cuda" else 1e-4  # tf32 dots on CUDA
    bf16_result = functools.cache(lambda: _ref("sparse_mla_prefill", dev)(q, kv, idx, scale, lat))
    flops = 2 * h * (2 * lat + rope) * valid
    cases = []
    for kv_dtype, cache in (("bf16", kv), ("fp8", kv8)):
        row = mla_row_bytes(lat, rope, kv_dtype)
        fp8 = kv_dtype == "fp8"
        check = check_sparse_mla_fp8(lse_tol, dev, bf16_result) if fp8 else check_sparse_mla(lse_tol, dev)
        cases.append(OpCase(
            "sparse_mla_prefill", f"sparse_mla_prefill[{kv_dtype}] T={t} H={h} K={k} L+R={lat + rope} row={row} B",
            lambda cache=cache: lambda fn: fn(q, cache, idx, scale, lat), check, flops, "FLOP",
            "2*H*((L+R)+L)*valid_indices", "flops_bf16",
            kernel=lambda backend, cache=cache: sparse_mla_kernel(backend, q, cache, idx, lat),
            refused=e4m3_refused("sparse_mla_prefill", kv8) if fp8 else None,
            bytes_read=lambda kernel, row=row: sparse_mla_bytes_read(kernel, valid=valid, row=row, heads=h,
                                                                     q_bytes=q.nbytes, idx_bytes=idx.nbytes)))
    return cases


def sparse_mla_bytes_read(kernel: str, *, valid: int, row: int, heads: int, q_bytes: int, idx_bytes: int
                          ) -> tuple[int, str]:
    """Bytes a sparse-MLA call loads, by the kernel that ran (``OpCase.kernel``), and what they count.

    The selected rows and the indices are loaded once per program that gathers them: the Triton kernel
    runs ``cdiv(H, BLOCK_H)`` head blocks per token (``triton_ops.sparse_mla.BLOCK_H``), each gathering every
    selected row (4x at H = 64; repeats may hit L2); FlashMLA and the torch reference gather each row once
    per token for all heads (FlashMLA once per group of at most 128 heads). q is read once either way.
    """
    if kernel.startswith("triton"):
        from dsa_kernels.triton_ops.sparse_mla import BLOCK_H  # Triton: imported when a row is timed

        passes = -(-heads // BLOCK_H)
        what = f"x{passes}: cdiv(H={heads}, BLOCK_H={BLOCK_H}) Triton head blocks per token each gather the rows"
    elif kernel.startswith("flash_mla"):
        from dsa_kernels.vendor import FLASH_MLA_HEADS

        group = max(max(accepted) for accepted in FLASH_MLA_HEADS.values())
        passes = -(-heads // group)
        what = f"x{passes}: FlashMLA gathers each row once per token per group of <= {group} heads"
    else:
        passes, what = 1, "x1: the torch reference gathers each row once per token"
    formula = f"{passes} * (valid_indices*{row} + T*K*4) + T*H*(L+R)*2 ({what})"
    return passes * (valid * row + idx_bytes) + q_bytes, formula


def sparse_mla_kernel(backend: str, q, kv, idx, lat: int) -> str:
    """The kernel a sparse-MLA call on ``backend`` really runs: the vendor adapter runs Triton where
    its gate refuses the call (``vendor.sparse_mla_route``), e.g. for every fp8 (uint8) cache:
    FlashMLA's sparse prefill reads bf16 only."""
    if backend != "vendor":
        return backend
    from dsa_kernels import vendor

    reason = vendor.sparse_mla_route(q, kv, idx, lat)
    return "triton (vendor fallback: " + reason + ")" if reason else "flash_mla " + vendor._flash_mla()[1]


def paged_copy_cases(s: Shapes, dev: torch.device, gen: torch.Generator) -> list[OpCase]:
    """gather/scatter bytes = ``2 * pages * page_bytes`` (each page read once and written once)."""
    page_bytes = 64 * (s.kv_lora_rank + s.rope_dim) * 2  # one bf16 MLA page
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    # bytes drawn on the device: the GLM-5 pool is 600 MB, slow to draw on the host (meta: shapes only)
    dev_gen = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(seed)
    pool = torch.randint(0, 256, (s.pool_pages, page_bytes), dtype=torch.uint8, generator=dev_gen, device=dev)
    ids = torch.randperm(s.pool_pages, generator=gen)[:s.moved_pages].to(dev)
    packed = pool[ids.long()].clone()
    work = 2 * s.moved_pages * page_bytes

    def make_scatter():
        dst = torch.zeros_like(pool)
        return lambda fn: (fn(packed, dst, ids), dst)[1]
    label = f"pages={s.moved_pages} of {s.pool_pages} x {page_bytes} B"
    return [
        OpCase("gather_pages", f"gather_pages {label}", lambda: lambda fn: fn(pool, ids), check_exact, work, "B",
               "2*pages*page_bytes", "hbm"),
        OpCase("scatter_pages", f"scatter_pages {label}", make_scatter, check_exact, work, "B",
               "2*pages*page_bytes", "hbm"),
    ]


CASE_BUILDERS = (index_key_cases, mla_kv_cases, indexer_cases, sparse_mla_cases, paged_copy_cases)


def check_case_contracts(s: Shapes, dev: torch.device = torch.device("meta")) -> dict:
    """Build every case at shapes ``s`` on ``dev`` (meta: shapes only, no memory, no kernel runs) and
    hold each op's arguments to its input contract (``dsa_kernels.contract``), so the GPU shapes are
    checked on any machine: a case the op would refuse on the GPU is refused here."""
    from dsa_kernels import contract

    gen, checked, errors = torch.Generator().manual_seed(0), [], []
    for build in CASE_BUILDERS:
        try:
            built = build(s, dev, gen)
        except Exception as exc:  # noqa: BLE001 - reported: a builder the shapes break
            errors.append(f"{build.__name__}: {type(exc).__name__}: {exc}")
            continue
        for case in built:
            check = contract.CHECKS.get(case.op)
            try:
                if check is not None:
                    case.make()(check)
                checked.append(case.label)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{case.label}: {type(exc).__name__}: {exc}")
    return {"device": str(dev), "cases": checked, "errors": errors, "passed": not errors}


# vendor tier (GPU only): FlashMLA's lse base per sgl_kernel version, FlashInfer top-k vs the reference --

def _sets_equal_up_to_ties(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> tuple[bool, int]:
    """Same -1 counts, and every position in one set only ties the row's k-th reference score.
    Returns ``(ok, rows whose sets differ by ties)``."""
    if not torch.equal((got >= 0).sum(1), (want >= 0).sum(1)):
        return False, 0
    tie_rows = 0
    for r in range(got.shape[0]):
        a, b = set(got[r][got[r] >= 0].tolist()), set(want[r][want[r] >= 0].tolist())
        if a != b:
            kth = scores[r, list(b)].min()
            if not all(scores[r, s] == kth for s in a ^ b):
                return False, tie_rows
            tie_rows += 1
    return True, tie_rows


def flash_mla_checks(dev: torch.device) -> dict:
    """The lse base measured for the installed FlashMLA module (``vendor.flash_mla_lse_base``), then the
    gating matrix on this device: which shapes reach FlashMLA, each result against the reference."""
    from dsa_kernels import vendor
    from dsa_kernels.reference.sparse_mla import sparse_mla_prefill as reference

    found = vendor._flash_mla()
    if found is None:
        return {"skipped": f"flash_mla_sparse_fwd not importable from {', '.join(vendor.FLASH_MLA_MODULES)}"}
    base = vendor.flash_mla_lse_base(found[1], dev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    # 64 / 128 heads: the kernel's own sizes; 16 and 96 padded up; 200 run in groups of 128
    for h, k, q_dtype in ((64, 2048, torch.bfloat16), (16, 2048, torch.bfloat16), (128, 100, torch.bfloat16),
                          (96, 2048, torch.bfloat16), (200, 2048, torch.bfloat16), (64, 2048, torch.float32)):
        q = torch.randn(8, h, 576, generator=gen).to(q_dtype).to(dev)
        kv = torch.randn(4096, 576, generator=gen).to(torch.bfloat16).to(dev)
        idx = torch.randint(0, 4096, (8, k), generator=gen, dtype=torch.int32).to(dev)
        idx[1] = -1
        kernel = sparse_mla_kernel("vendor", q, kv, idx, 512)
        out, lse = vendor.sparse_mla_prefill(q, kv, idx, 576**-0.5, 512)
        # vendor or its Triton fallback: both dot in bf16 here, so bf16's tolerance (not fp32 q's)
        check = check_sparse_mla(1e-2, dev)((out, lse), reference(q, kv, idx, 576**-0.5, 512), "vendor")
        rows.append({"heads": h, "topk": k, "q_dtype": str(q_dtype), "kernel": kernel, **check})
    passed = base is not None and all(r["passed"] for r in rows)
    return {"module": found[1], "lse_base": {2.0: "2", math.e: "e", None: "not established"}[base],
            "gating": rows, "passed": passed}


def flashinfer_topk_checks(dev: torch.device) -> dict:
    """``flashinfer.top_k`` / ``top_k_page_table_transform`` (through ``dsa_kernels.vendor``) against the
    torch reference on GLM-5-sized rows with many exact ties: index sets equal up to ties."""
    from dsa_kernels import vendor
    from dsa_kernels.reference import indexer as ref

    if vendor._flashinfer("top_k") is None:
        return {"skipped": "flashinfer.top_k not importable"}
    gen = torch.Generator().manual_seed(1)
    scores = (torch.randn(64, 32768, generator=gen) * 8).round().to(dev)  # integer scores: ties everywhere
    pos = torch.randint(1000, 32768, (64,), generator=gen).to(dev)
    scores = scores.masked_fill(torch.arange(32768, device=dev)[None] > pos[:, None], float("-inf"))
    out = {}
    ok, ties = _sets_equal_up_to_ties(vendor.topk_indices(scores, 2048), ref.topk_indices(scores, 2048), scores)
    out["top_k"] = {"passed": ok, "rows_differing_by_ties": ties}
    best, idx = scores[:, :0], torch.empty(64, 0, dtype=torch.int32, device=dev)
    for s0 in range(0, 32768, 8192):
        best, idx = vendor.topk_merge(best, idx, scores[:, s0:s0 + 8192], s0, 2048)
    ok, ties = _sets_equal_up_to_ties(torch.where(torch.isfinite(best), idx, -1), ref.topk_indices(scores, 2048),
                                      scores)
    out["chunked_merge"] = {"passed": ok, "rows_differing_by_ties": ties}
    if vendor._flashinfer("top_k_page_table_transform") is not None:
        table = torch.arange(512, dtype=torch.int32, device=dev).flip(0)[None].expand(2, 512).contiguous()
        req = torch.arange(64, device=dev) % 2
        got = vendor.topk_slots(scores, table, req, pos, 2048)
        want = ref.topk_slots(scores, table, req, pos, 2048)

        def to_positions(slots):  # the table maps page p to page 511 - p
            return torch.where(slots >= 0, (511 - slots // 64) * 64 + slots % 64, -1)
        ok, ties = _sets_equal_up_to_ties(to_positions(got), to_positions(want), scores)
        out["page_table_transform"] = {"passed": ok, "rows_differing_by_ties": ties}
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


def vendor_checks(dev: torch.device) -> dict:
    """Both vendor checks; a missing vendor module is reported as skipped, not failed, and with
    neither importable the section did not run (``ran`` False)."""
    mla, topk = flash_mla_checks(dev), flashinfer_topk_checks(dev)
    ran = [part for part in (mla, topk) if "skipped" not in part]
    passed = bool(ran) and all(part["passed"] for part in ran)
    parts = [f"FlashMLA: {mla.get('skipped') or mla['module'] + ' lse base ' + mla['lse_base']}",
             f"FlashInfer top-k: {topk.get('skipped') or ('sets equal up to ties' if topk['passed'] else 'DIFFERS')}"]
    return {"flash_mla": mla, "flashinfer_topk": topk, "passed": passed, "ran": bool(ran), "summary": "; ".join(parts)}
