"""The Triton (and vendor) ops as PyTorch custom ops (``dsa_kernels.custom_ops``).

What CUDA's stream sanitizer relies on: each op's schema marks as written (``Tensor(a!)``) exactly
the arguments the kernel changes, so a read of a cache before the kernel that fills it is ordered
is a hazard it can see. Checked by running each op on sentinel-filled inputs and comparing the
arguments that changed with the schema; a registration that omits a written argument is caught.
Also: the custom op gives the launcher's results bit for bit, the public functions reach the
dispatcher as ``dsa_kernels::<op>``, and the fake implementations give the real shapes and dtypes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import dsa_kernels
from dsa_kernels import custom_ops, dispatch, layout
from dsa_kernels.reference import indexer as reference_indexer
from dsa_kernels.triton_ops import paged_copy
from lsconfig import envs
from tests.dsa_kernels.helpers import distinct_slots, op

pytestmark = pytest.mark.skipif(not envs.triton_interpret(), reason="Triton on CPU needs TRITON_INTERPRET=1")
CPU = torch.device("cpu")
LAT, ROPE, D = 128, 16, 32
SENTINEL = 0xA5  # every byte of a buffer an op may write starts as this


def sentinel(shape, dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(SENTINEL)
    return t


def index_cache(gen, pages: int = 3) -> torch.Tensor:
    """A filled indexer cache (the torch reference quantizes random keys into every slot)."""
    cache = torch.zeros(pages, layout.index_page_bytes(D), dtype=torch.uint8)
    op("quantize_index_keys", "torch", CPU)(torch.randn(pages * 64, D, generator=gen), cache, torch.arange(pages * 64))
    return cache


def mla_cache(gen, rows: int, kv_dtype: str) -> torch.Tensor:
    width = layout.mla_row_bytes(LAT, ROPE, kv_dtype)
    cache = torch.zeros(rows, width // 2, dtype=torch.bfloat16) if kv_dtype == "bf16" else \
        torch.zeros(rows, width, dtype=torch.uint8)
    op("pack_mla_kv", "torch", CPU)(torch.randn(rows, LAT, generator=gen), torch.randn(rows, ROPE, generator=gen),
                                    cache, torch.arange(rows))
    return cache


def build(name: str, seed: int = 0) -> dict:
    """Valid arguments for ``name`` at odd sizes; the buffers it may write are sentinel-filled."""
    gen = torch.Generator().manual_seed(seed)
    if name == "quantize_index_keys":
        return {"keys": torch.randn(13, D, generator=gen).to(torch.bfloat16),
                "index_cache": sentinel((3, layout.index_page_bytes(D)), torch.uint8),
                "slots": distinct_slots(13, 3, gen)}
    if name == "dequantize_index_keys":
        return {"index_cache": index_cache(gen), "slots": distinct_slots(11, 3, gen)}
    if name.startswith("pack_mla_kv"):
        fp8 = name.endswith("fp8")
        width = layout.mla_row_bytes(LAT, ROPE, "fp8" if fp8 else "bf16")
        cache = sentinel((70, width), torch.uint8) if fp8 else sentinel((70, width // 2), torch.bfloat16)
        return {"kv_c": torch.randn(5, LAT, generator=gen), "k_pe": torch.randn(5, ROPE, generator=gen),
                "kv_cache": cache, "slots": torch.randperm(70, generator=gen)[:5]}
    if name.startswith("unpack_mla_kv"):
        cache = mla_cache(gen, 70, "fp8" if name.endswith("fp8") else "bf16")
        return {"kv_cache": cache, "slots": torch.randperm(70, generator=gen)[:7], "kv_lora_rank": LAT}
    if name == "indexer_scores":
        return {"q": torch.randn(5, 3, D, generator=gen), "weights": torch.randn(5, 3, generator=gen),
                "index_cache": index_cache(gen), "page_table": torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32),
                "req_idx": torch.tensor([0, 1, 1, 0, 1]), "positions": torch.tensor([0, 63, 64, 150, 190]),
                "max_context": 171, "s_start": 7}
    if name.startswith("sparse_mla_prefill"):
        idx = torch.randint(-1, 45, (3, 7), generator=gen, dtype=torch.int32)  # -1 and >= rows: invalid
        cache = mla_cache(gen, 40, "fp8") if name.endswith("fp8") else \
            torch.randn(40, LAT + ROPE, generator=gen).to(torch.bfloat16)
        return {"q": torch.randn(3, 5, LAT + ROPE, generator=gen).to(torch.bfloat16), "kv_cache": cache,
                "indices": idx, "sm_scale": 0.083, "kv_lora_rank": LAT}
    if name == "gather_pages":
        return {"pages": torch.randint(0, 256, (5, 99), dtype=torch.uint8, generator=gen),
                "page_ids": torch.tensor([4, 0, 3])}
    assert name == "scatter_pages", name
    return {"packed": torch.randint(0, 256, (3, 100), dtype=torch.uint8, generator=gen),
            "pages": sentinel((5, 100), torch.uint8), "page_ids": torch.tensor([4, 0, 2])}


CASES = ["quantize_index_keys", "dequantize_index_keys", "pack_mla_kv", "pack_mla_kv-fp8", "unpack_mla_kv",
         "unpack_mla_kv-fp8", "indexer_scores", "sparse_mla_prefill", "sparse_mla_prefill-fp8", "gather_pages",
         "scatter_pages"]


def op_name(case: str) -> str:
    return case.split("-")[0]


def overload(name: str):
    """The op's custom op (registered by the first resolve)."""
    dispatch.resolve(name, CPU, "triton")
    return getattr(torch.ops.dsa_kernels, name).default


def clone(args: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def tensors(result) -> list[torch.Tensor]:
    """The tensors of an op's result (none for an op that writes in place)."""
    return [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def written(fn, schema, args: dict) -> tuple[set[str], set[str]]:
    """``(arguments fn changed, arguments the schema declares written)`` for one call."""
    before = clone(args)
    fn(**args)
    changed = {k for k, v in args.items() if isinstance(v, torch.Tensor) and not torch.equal(v, before[k])}
    declared = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return changed, declared


@pytest.mark.parametrize("case", CASES)
def test_schema_declares_exactly_what_is_written(case):
    ov = overload(op_name(case))
    changed, declared = written(ov, ov._schema, build(case))
    assert changed == declared, f"{ov._schema}: changed {sorted(changed)}, declared written {sorted(declared)}"


def test_missing_mutates_entry_is_caught():
    """Teeth: the same helper registering scatter_pages without ``mutates=("pages",)`` is refused."""
    bad = custom_ops.register("dsa_kernels_test::scatter_pages_undeclared", paged_copy.scatter_pages,
                              custom_ops.scatter_pages, mutates=())
    changed, declared = written(bad, bad._schema, build("scatter_pages"))
    assert changed == {"pages"} and declared == set()
    with pytest.raises(Exception, match="pages is not defined as mutable but was mutated"):  # opcheck agrees
        torch.library.opcheck(bad, (), build("scatter_pages"), test_utils="test_schema")


@pytest.mark.parametrize("case", CASES)
def test_custom_op_equals_launcher(case):
    """Through the dispatcher (resolve's Triton function) and the bare launcher: same bytes."""
    name = op_name(case)
    args = build(case, seed=3)
    direct_args = clone(args)
    got = dispatch.resolve(name, CPU, "triton")[1](**args)
    want = dispatch._load("triton", name)(**direct_args)
    assert len(tensors(got)) == len(tensors(want))
    for g, w in zip(tensors(got), tensors(want)):
        assert g.dtype == w.dtype and torch.equal(g, w)
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, direct_args[k]), f"{k} differs after the call"


class RecordOps(TorchDispatchMode):
    """Records the name of every op the dispatcher hands to Python modes (what CSAN sees)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def public_calls() -> set[str]:
    """Every engine-facing function of a Triton op once; returns the op names seen."""
    a = {case: build(case) for case in ("quantize_index_keys", "dequantize_index_keys", "pack_mla_kv", "unpack_mla_kv",
                                       "indexer_scores", "sparse_mla_prefill", "gather_pages", "scatter_pages")}
    with RecordOps() as mode:
        dsa_kernels.quantize_index_keys(**a["quantize_index_keys"])
        dsa_kernels.dequantize_index_keys(**a["dequantize_index_keys"])
        dsa_kernels.pack_mla_kv(**a["pack_mla_kv"])
        dsa_kernels.unpack_mla_kv(**a["unpack_mla_kv"])
        s = a["indexer_scores"]
        dsa_kernels.indexer_scores(**{k: v for k, v in s.items() if k != "s_start"})
        dsa_kernels.indexer_topk(s["q"], s["weights"], s["index_cache"], s["page_table"], s["req_idx"],
                                 s["positions"], s["max_context"], 9, chunk=50, query_block=4)
        dsa_kernels.sparse_mla_prefill(*a["sparse_mla_prefill"].values())
        dsa_kernels.gather_pages(**a["gather_pages"])
        dsa_kernels.scatter_pages(**a["scatter_pages"])
    return set(mode.names)


def test_dispatch_mode_sees_the_triton_ops(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "triton")
    seen = public_calls()
    assert {f"dsa_kernels::{name}" for name in dispatch.OPS} <= seen, sorted(seen)


def test_torch_backend_stays_aten(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "torch")
    seen = public_calls()
    assert not {n for n in seen if n.startswith("dsa_kernels::")} and "aten::index_put_" in seen


def test_launch_hook_gets_the_callers_arguments():
    args = build("gather_pages")
    calls = []
    dispatch.set_launch_hook(lambda name, a, kw: calls.append((name, a, kw)) or contextlib.nullcontext())
    try:
        dispatch.resolve("gather_pages", CPU, "triton")[1](args["pages"], args["page_ids"])
    finally:
        dispatch.set_launch_hook(None)
    (name, hook_args, hook_kwargs), = calls
    assert name == "gather_pages" and hook_args[0] is args["pages"] and hook_args[1] is args["page_ids"]


@pytest.mark.parametrize("case", CASES)
def test_fake_matches_real(case):
    """The fake implementation (what torch.compile traces) gives the real outputs' shapes and dtypes."""
    ov = overload(op_name(case))
    args = build(case)
    real = tensors(ov(**clone(args)))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tensors(ov(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                                                   for k, v in args.items()}))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


VENDOR_STAND_INS = {  # vendor op -> (a function with its semantics runnable here, arguments)
    "sparse_mla_prefill": (dispatch._load("triton", "sparse_mla_prefill"), lambda: build("sparse_mla_prefill")),
    "topk_indices": (reference_indexer.topk_indices, lambda: {"scores": torch.randn(4, 37), "k": 9}),
    "topk_merge": (reference_indexer.topk_merge, lambda: {
        "best_scores": torch.randn(4, 5), "best_idx": torch.randint(0, 9, (4, 5), dtype=torch.int32),
        "chunk_scores": torch.randn(4, 11), "s_start": 9, "k": 7}),
    "topk_slots": (reference_indexer.topk_slots, lambda: {
        "scores": torch.randn(3, 130), "page_table": torch.tensor([[1, 0, 2]], dtype=torch.int32),
        "req_idx": torch.zeros(3, dtype=torch.int64), "positions": torch.tensor([0, 64, 129]), "k": 8}),
}


@pytest.mark.parametrize("name", sorted(VENDOR_STAND_INS))
def test_vendor_registration(name):
    """The vendor path's registration (no vendor wheel here: a function of the same semantics stands in)."""
    fn, make = VENDOR_STAND_INS[name]
    call = custom_ops.routed(name, fn, "vendor")
    ov = getattr(torch.ops.dsa_kernels, f"vendor_{name}").default
    args = make()
    changed, declared = written(ov, ov._schema, clone(args))
    assert changed == declared == set()
    got, want = tensors(call(**args)), tensors(fn(**clone(args)))
    assert len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tensors(
            ov(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in want]


def test_reregistration_runs_the_latest_function():
    calls = []
    first = custom_ops.register("dsa_kernels_test::gather_latest", lambda p, i: calls.append(1) or p[i.long()],
                                custom_ops.gather_pages)
    again = custom_ops.register("dsa_kernels_test::gather_latest", lambda p, i: calls.append(2) or p[i.long()],
                                custom_ops.gather_pages)
    again(torch.zeros(2, 3, dtype=torch.uint8), torch.tensor([1]))
    assert first is again and calls == [2]


@pytest.mark.parametrize("case", CASES)
def test_opcheck(case):
    """PyTorch's own checks: schema vs. mutations, fake tensors, aot dispatch with dynamic shapes."""
    ov = overload(op_name(case))
    torch.library.opcheck(ov, (), build(case))
