"""One input contract at the dispatch boundary, for every backend (``dsa_kernels.contract``).

Each case hands an op one bad argument (the engine's column slice ``rows[:, a:b]``, strides
``(176, 1)``, among them) and asserts that the torch reference refuses it with exactly the message
the Triton launcher gives, before any work: a CPU test on the torch path catches what the GPU
path would refuse.
"""

from __future__ import annotations

import pytest
import torch

import dsa_kernels
from dsa_kernels import contract, dispatch, layout
from tests.dsa_kernels.helpers import op

CPU = torch.device("cpu")
LAT, ROPE, D = 128, 16, 32


def strided(shape, dtype=torch.float32, extra=7):
    """A ``shape`` view whose rows are ``extra`` elements longer than its columns (not contiguous)."""
    base = torch.zeros(*shape[:-1], shape[-1] + extra, dtype=dtype)
    return base[..., : shape[-1]]


def valid_args(name: str) -> dict:
    ints = dict(dtype=torch.int64)
    index_cache = torch.zeros(2, layout.index_page_bytes(D), dtype=torch.uint8)
    if name in ("quantize_index_keys", "dequantize_index_keys"):
        args = {"keys": torch.zeros(3, D), "index_cache": index_cache, "slots": torch.tensor([0, 5, 70])}
        return args if name == "quantize_index_keys" else {k: args[k] for k in ("index_cache", "slots")}
    if name in ("pack_mla_kv", "unpack_mla_kv"):
        cache = torch.zeros(128, LAT + ROPE, dtype=torch.bfloat16)
        if name == "unpack_mla_kv":
            return {"kv_cache": cache, "slots": torch.tensor([1, 2]), "kv_lora_rank": LAT}
        return {"kv_c": torch.zeros(2, LAT), "k_pe": torch.zeros(2, ROPE), "kv_cache": cache, "slots": torch.tensor([1, 2])}
    if name == "indexer_scores":
        return {"q": torch.zeros(2, 4, D), "weights": torch.zeros(2, 4), "index_cache": index_cache,
                "page_table": torch.tensor([[1, 0]], dtype=torch.int32), "req_idx": torch.zeros(2, **ints),
                "positions": torch.tensor([3, 4]), "max_context": 64}
    if name == "sparse_mla_prefill":
        return {"q": torch.zeros(2, 4, LAT + ROPE), "kv_cache": torch.zeros(10, LAT + ROPE, dtype=torch.bfloat16),
                "indices": torch.zeros(2, 4, dtype=torch.int32), "sm_scale": 0.1, "kv_lora_rank": LAT}
    pages, ids = torch.zeros(3, 64, dtype=torch.uint8), torch.tensor([2, 0])
    if name == "gather_pages":
        return {"pages": pages, "page_ids": ids}
    return {"packed": torch.zeros(2, 64, dtype=torch.uint8), "pages": pages, "page_ids": ids}


# (op, argument, bad value builder, message fragment)
BAD = [
    ("quantize_index_keys", "keys", lambda: torch.zeros(3, 176)[:, 176 - D:], "keys: expected a contiguous tensor, got strides (176, 1)"),
    ("quantize_index_keys", "slots", lambda: torch.arange(6)[::2], "slots: expected a contiguous tensor"),
    ("quantize_index_keys", "slots", lambda: torch.tensor([0.0, 5.0, 70.0]), "slots: expected dtype in"),
    ("quantize_index_keys", "keys", lambda: torch.zeros(3, D, dtype=torch.float64), "keys: expected dtype in"),
    ("dequantize_index_keys", "index_cache", lambda: strided((2, layout.index_page_bytes(D)), torch.uint8),
     "index_cache: expected a contiguous tensor"),
    ("pack_mla_kv", "kv_c", lambda: torch.zeros(2, 176)[:, :LAT], "kv_c: expected a contiguous tensor, got strides (176, 1)"),
    ("pack_mla_kv", "k_pe", lambda: torch.zeros(2, 176)[:, LAT:LAT + ROPE], "k_pe: expected a contiguous tensor"),
    ("pack_mla_kv", "slots", lambda: torch.tensor([1, 2, 3]), "slots: expected 2 rows"),
    ("unpack_mla_kv", "kv_cache", lambda: strided((128, LAT + ROPE), torch.bfloat16), "kv_cache: expected a contiguous"),
    ("indexer_scores", "q", lambda: strided((2, 4, D)), "q: expected a contiguous tensor"),
    ("indexer_scores", "weights", lambda: torch.zeros(4, 2).T, "weights: expected a contiguous tensor"),
    ("indexer_scores", "positions", lambda: torch.arange(4)[::2], "positions: expected a contiguous tensor"),
    ("indexer_scores", "max_context", lambda: 129, "max_context: expected <= 128"),
    ("sparse_mla_prefill", "q", lambda: strided((2, 4, LAT + ROPE)), "q: expected a contiguous tensor"),
    ("sparse_mla_prefill", "kv_cache", lambda: torch.zeros(10, 168, dtype=torch.uint8),  # fp8 rows are 164 B
     "kv_cache: expected fp8-layout rows of 164 B (latent 128 + rope 16, from q's last dim 144), got 168 B"),
    ("sparse_mla_prefill", "kv_cache", lambda: torch.zeros(10, LAT + ROPE, dtype=torch.int16),
     "kv_cache: expected dtype in"),
    ("sparse_mla_prefill", "indices", lambda: torch.zeros(4, 2, dtype=torch.int32).T, "indices: expected a contiguous"),
    ("gather_pages", "pages", lambda: strided((3, 64), torch.uint8), "pages: expected a contiguous tensor"),
    ("scatter_pages", "packed", lambda: strided((2, 64), torch.uint8), "packed: expected a contiguous tensor"),
]


def refusal(fn, args: dict) -> str:
    with pytest.raises(ValueError) as info:
        fn(**args)
    return str(info.value)


@pytest.mark.parametrize("name,arg,bad,fragment", BAD, ids=[f"{b[0]}-{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_torch_refuses_what_triton_refuses_same_message(name, arg, bad, fragment):
    args = valid_args(name) | {arg: bad()}
    on_triton = refusal(op(name, "triton", CPU), args)
    on_torch = refusal(op(name, "torch", CPU), args)
    assert fragment in on_triton
    assert on_torch == on_triton


@pytest.mark.parametrize("name", sorted(contract.CHECKS))
def test_valid_arguments_pass_every_backend(name):
    """The cases' valid arguments run on both backends (so each refusal above is the bad argument's)."""
    for backend in ("torch", "triton"):
        op(name, backend, CPU)(**valid_args(name))


def test_every_kernel_op_has_a_contract():
    assert set(contract.CHECKS) == set(dispatch.OPS)


def test_public_op_refuses_engine_column_slice_on_torch(monkeypatch):
    """The engine's case: ``rows[:, lat + rope:]`` handed to the public op on the CPU torch path."""
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "torch")
    rows = torch.zeros(3, LAT + ROPE + D)
    args = valid_args("quantize_index_keys")
    with pytest.raises(ValueError, match=r"keys: expected a contiguous tensor, got strides \(176, 1\)"):
        dsa_kernels.quantize_index_keys(rows[:, LAT + ROPE:], args["index_cache"], args["slots"])
    before = args["index_cache"].clone()
    with pytest.raises(ValueError):
        dsa_kernels.quantize_index_keys(rows[:, LAT + ROPE:], args["index_cache"], args["slots"])
    assert torch.equal(args["index_cache"], before), "refused before any work"
