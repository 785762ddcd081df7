"""The one capability gate for every Triton kernel here that reads or writes e4m3.

Triton compiles ``tl.float8e4nv`` (e4m3) for NVIDIA capability 8.9+ only (Ada, Hopper, Blackwell): the
installed Triton's CUDA backend adds ``fp8e4nv`` to its supported fp8 types at capability >= 89, and a
kernel with an e4m3 pointer argument or cast fails to compile below that. So each launcher whose kernel
uses e4m3 calls :func:`require_e4m3` after its contract check, before any launch: an sm80/86 device gets
one ``ValueError`` naming the op and what to do, not Triton's compile error.

Which ops (``E4M3_OPS``; held to the kernels' sources by ``tests/dsa_kernels/test_fp8_gate.py``):

* the index-key ops, in every KV dtype (index keys are e4m3 always): ``INDEX_KEY_OPS``;
* the MLA-cache ops, for an fp8 (uint8) cache only (a bf16 cache's kernel has no e4m3): ``FP8_CACHE_OPS``.

This module imports no Triton (the engine's parent process and the GPU check read it before any kernel).
"""

from __future__ import annotations

import torch

FP8_MIN_CAPABILITY = (8, 9)  # tl.float8e4nv compiles on sm89+ only: Ada, Hopper, Blackwell
INDEX_KEY_OPS = ("quantize_index_keys", "dequantize_index_keys", "indexer_scores")
FP8_CACHE_OPS = ("pack_mla_kv", "unpack_mla_kv", "sparse_mla_prefill")
E4M3_OPS = INDEX_KEY_OPS + FP8_CACHE_OPS


def e4m3_ops(kv_dtype: str) -> tuple[str, ...]:
    """The ops whose Triton kernel uses e4m3 with an MLA cache of ``kv_dtype`` (``bf16`` | ``fp8``)."""
    return INDEX_KEY_OPS + (FP8_CACHE_OPS if kv_dtype == "fp8" else ())


def cuda_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """``t``'s CUDA compute capability, None off CUDA (the seam CPU tests replace with a fake device).
    Device properties only: no sync."""
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def below_e4m3(capability: tuple[int, int] | None) -> bool:
    """Is ``capability`` a CUDA device Triton cannot compile e4m3 for (None: not CUDA, nothing to gate)?"""
    return capability is not None and tuple(capability) < FP8_MIN_CAPABILITY


def refusal(op: str, capability: tuple[int, int], where: str) -> str:
    """The one-line reason ``op``'s Triton kernel cannot run on a device of ``capability`` (``where``: its name)."""
    fix = "set LAYERSPLIT_KERNEL_BACKEND=torch to run the torch reference instead"
    if op in FP8_CACHE_OPS:
        fix += ", or use --kv-dtype bf16 (a bf16 cache needs no e4m3; index keys still do on Triton)"
    return (f"{op} on Triton: its kernel uses e4m3 (tl.float8e4nv), which Triton compiles for sm89+ only "
            f"(Ada/Hopper/Blackwell), got sm{capability[0]}{capability[1]} on {where}; {fix}")


def e4m3_unsupported(op: str, t: torch.Tensor) -> str | None:
    """Why ``op``'s e4m3 kernel cannot run on ``t``'s device, or None (it can, or ``t`` is not on CUDA)."""
    capability = cuda_capability(t)
    return refusal(op, capability, f"device {t.device}") if below_e4m3(capability) else None


def require_e4m3(op: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` (:func:`e4m3_unsupported`) before a launch the device cannot compile."""
    refused = e4m3_unsupported(op, t)
    if refused is not None:
        raise ValueError(refused)
