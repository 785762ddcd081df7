"""64-bit offsets at GLM-5 scale, without GLM-5-sized tensors.

The Triton interpreter runs each program with ``tl.program_id`` from its builder. ``huge_grid``
shifts that id, so a one-program launch computes its offsets as program 16400 (indexer: query row
past 16k at a 131k-wide score row) or 70000 (sparse MLA: token row past 58k at 64 heads x 576),
and records every address the kernel loads or stores instead of touching memory. The test then
checks the addresses against int64 arithmetic done in Python. With
``offsets.UNSAFE_INT32_OFFSETS = True`` (the old 32-bit arithmetic) the same tests fail: see
``test_detects_int32_arithmetic``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tests.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="drives the Triton interpreter's builder (CPU)")

GLM5_ROWS, GLM5_CTX = 16400, 131072  # a query row past 16k at 128k context: t * ctx > 2^31
MLA_ROW, MLA_HEADS, MLA_WIDTH, MLA_LAT = 70000, 64, 576, 512  # t * H * 576 > 2^31


@contextlib.contextmanager
def huge_grid(shift: tuple[int, int]):
    """Programs see ``program_id(a) + shift[a]``; loads return their ``other`` and stores are dropped,
    every unmasked address recorded in ``log['load']`` / ``log['store']`` (uint64 arrays)."""
    from triton.runtime import interpreter as interp
    import triton.language as tl

    builder = interp.interpreter_builder
    log: dict[str, list[np.ndarray]] = {"load": [], "store": []}
    real_pid = builder.create_get_program_id

    def program_id(axis):
        handle = real_pid(axis)
        return interp.TensorHandle(handle.data + np.int32(shift[axis] if axis < 2 else 0), tl.int32)

    def masked_load(ptrs, mask, other, *_):
        log["load"].append(ptrs.data[mask.data].astype(np.uint64))
        dtype_tt = ptrs.get_element_ty()
        if other is None:
            return interp.TensorHandle(np.zeros_like(ptrs.data, dtype=interp._get_np_dtype(dtype_tt)), dtype_tt)
        return interp.TensorHandle(np.broadcast_to(other.data, ptrs.data.shape).copy(), dtype_tt)

    def masked_store(ptrs, value, mask, *_):
        log["store"].append(ptrs.data[mask.data].astype(np.uint64))

    builder.create_get_program_id, builder.create_masked_load, builder.create_masked_store = (
        program_id, masked_load, masked_store)
    try:
        yield log
    finally:
        for name in ("create_get_program_id", "create_masked_load", "create_masked_store"):
            delattr(builder, name)


def run_indexer_row() -> tuple[set[int], set[int]]:
    """The scores kernel as query row 16400, column block 2047 of a ``[16401, 131072]`` fp32 output."""
    from dsa_kernels.layout import FP8_DTYPE, index_page_bytes
    from dsa_kernels.triton_ops import indexer
    from dsa_kernels.triton_ops.offsets import wide

    heads, d, block_s = 2, 128, 64
    q = torch.zeros(1, heads, d, dtype=FP8_DTYPE)
    w = torch.zeros(1, heads)
    cache = torch.zeros(1, index_page_bytes(d), dtype=torch.uint8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    req = pos = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(1, block_s)  # stands for row 16400 of the full output; never written
    with huge_grid((GLM5_ROWS, GLM5_CTX // block_s - 1)) as log:
        indexer._indexer_scores_kernel[(1, 1)](
            q, w, cache.view(FP8_DTYPE), cache.view(torch.float32), table, req, pos, out,
            heads * d, d, heads, 1, GLM5_CTX, cache.shape[1], 0, GLM5_CTX,
            H=heads, BLOCK_H=16, D=d, BLOCK_S=block_s, PAGE=64, DOT_BF16=False, WIDE=wide(),
        )
    cols = (GLM5_CTX // block_s - 1) * block_s + np.arange(block_s)
    want = {out.data_ptr() + 4 * (GLM5_ROWS * GLM5_CTX + int(c)) for c in cols}  # Python ints: exact
    return set(np.concatenate(log["store"]).tolist()), want


def run_sparse_mla_row() -> tuple[set[int], set[int], set[int], set[int]]:
    """Sparse MLA through its launcher as token row 70000 (q rows of 64 x 576 bf16)."""
    from dsa_kernels.triton_ops.sparse_mla import sparse_mla_prefill

    q = torch.zeros(1, MLA_HEADS, MLA_WIDTH, dtype=torch.bfloat16)
    kv = torch.zeros(4, MLA_WIDTH, dtype=torch.bfloat16)
    idx = torch.zeros(1, 32, dtype=torch.int32)
    with huge_grid((MLA_ROW, 0)) as log:
        out, _ = sparse_mla_prefill(q, kv, idx, 0.1, MLA_LAT)
    stores = set(np.concatenate(log["store"]).tolist())
    loads = set(np.concatenate(log["load"]).tolist())
    row_q = q.data_ptr() + 2 * MLA_ROW * MLA_HEADS * MLA_WIDTH
    want_q = {row_q + 2 * i for i in range(MLA_HEADS * MLA_WIDTH)}
    row_out = out.data_ptr() + 2 * MLA_ROW * MLA_HEADS * MLA_LAT
    want_out = {row_out + 2 * i for i in range(MLA_HEADS * MLA_LAT)}
    return stores, want_out, loads, want_q


def test_indexer_output_offset_is_64_bit():
    got, want = run_indexer_row()
    assert got == want, "score stores of row 16400 land elsewhere than row * 131072 * 4 bytes"


def test_sparse_mla_offsets_are_64_bit():
    stores, want_out, loads, want_q = run_sparse_mla_row()
    assert want_out <= stores, "output row 70000 is not written at its 64-bit offset"
    assert want_q <= loads, "q row 70000 is not read at its 64-bit offset"


def test_detects_int32_arithmetic(monkeypatch):
    """The switched-off fix: with 32-bit row offsets both kernels address wrapped rows."""
    from dsa_kernels.triton_ops import offsets

    monkeypatch.setattr(offsets, "UNSAFE_INT32_OFFSETS", True)
    got, want = run_indexer_row()
    assert got != want
    stores, want_out, loads, want_q = run_sparse_mla_row()
    assert not want_out <= stores and not want_q <= loads
