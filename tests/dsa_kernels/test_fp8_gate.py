"""The e4m3 capability gate (``dsa_kernels.triton_ops.fp8_gate``), held to the kernels' sources.

* Every dispatch op whose Triton module names an e4m3 type in its code (``tl.float8e4nv``,
  ``FP8_DTYPE``, ``torch.float8_e4m3fn``; comments and docstrings aside) is in ``E4M3_OPS``, and no
  other: a new fp8 kernel cannot be missed by the table.
* Every op of ``E4M3_OPS`` has a call here, and on a faked sm86 / sm80 that call raises the gate's
  one-line ``ValueError`` before any kernel of its module is launched; on sm89+ the same call runs.
* The MLA-cache ops with a bf16 cache are not gated (their kernels have no e4m3 argument).
"""

from __future__ import annotations

import importlib
import inspect
import io
import tokenize

import pytest
import torch

from dsa_kernels.dispatch import OPS
from dsa_kernels.layout import index_page_bytes, mla_row_bytes
from dsa_kernels.triton_ops import fp8_gate
from tests.dsa_kernels.helpers import op

E4M3_NAMES = {"float8e4nv", "FP8_DTYPE", "float8_e4m3fn"}
CPU = torch.device("cpu")


def _triton_module(name: str):
    return importlib.import_module(f"dsa_kernels.triton_ops.{OPS[name]}")


def _names_in_code(module) -> set[str]:
    """The NAME tokens of ``module``'s source: code only, not its comments or strings."""
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(module)).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def _index_cache(d: int = 16, pages: int = 2) -> torch.Tensor:
    return torch.zeros(pages, index_page_bytes(d), dtype=torch.uint8)


def _mla_cache(kv_dtype: str, rows: int = 8, lat: int = 128, rope: int = 16) -> torch.Tensor:
    row = mla_row_bytes(lat, rope, kv_dtype)
    if kv_dtype == "fp8":
        return torch.zeros(rows, row, dtype=torch.uint8)
    return torch.zeros(rows, row // 2, dtype=torch.bfloat16)


def _call(name: str, kv_dtype: str = "fp8") -> tuple:
    """Arguments of one small call of ``name`` that uses e4m3 (``kv_dtype`` for the MLA-cache ops)."""
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 70, 5])
    if name == "quantize_index_keys":
        return torch.randn(3, 16, generator=gen), _index_cache(), slots
    if name == "dequantize_index_keys":
        return _index_cache(), slots
    if name == "indexer_scores":
        q, w = torch.randn(2, 4, 16, generator=gen), torch.rand(2, 4, generator=gen)
        table, req = torch.tensor([[1, 0]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        return q, w, _index_cache(), table, req, torch.tensor([5, 90]), 100
    if name == "pack_mla_kv":
        return torch.randn(3, 128, generator=gen), torch.randn(3, 16, generator=gen), _mla_cache(kv_dtype), slots % 8
    if name == "unpack_mla_kv":
        return _mla_cache(kv_dtype), slots % 8, 128
    if name == "sparse_mla_prefill":
        q, idx = torch.randn(2, 3, 144, generator=gen), torch.tensor([[0, 5, -1], [7, 2, 1]], dtype=torch.int32)
        return q, _mla_cache(kv_dtype), idx, 0.1, 128
    raise AssertionError(f"{name}: its Triton kernel uses e4m3, add a call to _call so its gate is tested")


@pytest.fixture
def fake_sm(monkeypatch):
    def set_sm(major: int, minor: int) -> None:
        monkeypatch.setattr(fp8_gate, "cuda_capability", lambda t: (major, minor))
    return set_sm


@pytest.fixture
def no_launch(monkeypatch):
    """``no_launch(op)``: every Triton kernel of ``op``'s module fails the test if it is launched."""
    import triton

    class Refuse:
        def __getitem__(self, grid):
            pytest.fail("a kernel was launched: the gate must refuse before any launch")

    def arm(name: str) -> None:
        module = _triton_module(name)
        for attr, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.KernelInterface):
                monkeypatch.setattr(module, attr, Refuse())
    return arm


def test_the_gate_table_is_every_op_whose_kernel_source_uses_e4m3():
    uses = {name for name in OPS if _names_in_code(_triton_module(name)) & E4M3_NAMES}
    assert uses == set(fp8_gate.E4M3_OPS), (
        f"ops whose Triton source uses e4m3: {sorted(uses)}; fp8_gate.E4M3_OPS: {sorted(fp8_gate.E4M3_OPS)}")
    assert set(fp8_gate.e4m3_ops("bf16")) == set(fp8_gate.INDEX_KEY_OPS)
    assert set(fp8_gate.e4m3_ops("fp8")) == set(fp8_gate.E4M3_OPS)


@pytest.mark.parametrize("name", fp8_gate.E4M3_OPS)
@pytest.mark.parametrize("sm", [(8, 6), (8, 0), (7, 5)], ids=["sm86", "sm80", "sm75"])
def test_every_e4m3_op_refused_below_sm89_before_launch(name, sm, fake_sm, no_launch):
    args = _call(name)
    fake_sm(*sm)
    no_launch(name)
    with pytest.raises(ValueError) as info:
        op(name, "triton", CPU)(*args)
    message = str(info.value)
    assert message.startswith(f"{name} on Triton: its kernel uses e4m3 (tl.float8e4nv), which Triton compiles "
                              f"for sm89+ only (Ada/Hopper/Blackwell), got sm{sm[0]}{sm[1]} on device cpu; set "
                              "LAYERSPLIT_KERNEL_BACKEND=torch to run the torch reference instead"), message
    assert "\n" not in message
    assert ("--kv-dtype bf16" in message) == (name in fp8_gate.FP8_CACHE_OPS)
    op(name, "torch", CPU)(*_call(name))  # the reference has no such limit


@pytest.mark.parametrize("name", fp8_gate.E4M3_OPS)
@pytest.mark.parametrize("sm", [(8, 9), (9, 0), (10, 0)], ids=["sm89", "sm90", "sm100"])
def test_every_e4m3_op_runs_on_sm89_plus(name, sm, fake_sm):
    fake_sm(*sm)
    op(name, "triton", CPU)(*_call(name))


@pytest.mark.parametrize("name", fp8_gate.FP8_CACHE_OPS)
def test_bf16_cache_ops_not_gated(name, fake_sm):
    """A bf16 cache's kernels take no e4m3 argument (an e4m3 pointer alone fails to compile below sm89)."""
    fake_sm(8, 6)
    op(name, "triton", CPU)(*_call(name, "bf16"))


def test_the_seam_is_none_off_cuda():
    cache = _index_cache()
    assert fp8_gate.cuda_capability(cache) is None and fp8_gate.e4m3_unsupported("indexer_scores", cache) is None
    assert not fp8_gate.below_e4m3(None) and fp8_gate.below_e4m3((8, 6)) and not fp8_gate.below_e4m3((8, 9))
