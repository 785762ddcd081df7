"""Backend choice for every DSA op, in one place.

``LAYERSPLIT_KERNEL_BACKEND`` = auto | vendor | triton | torch (see ``lsconfig.envs``).
``auto`` picks, per op and device: vendor (CUDA, importable) -> Triton (CUDA, or the CPU under
``TRITON_INTERPRET=1`` only when asked explicitly) -> torch reference. On CPU ``auto`` is the
torch reference: the Triton interpreter is for kernel tests, not for runs.

``OPS`` have a Triton kernel and a torch reference; ``TOPK_OPS`` (selection) have a torch reference
and, on CUDA, FlashInfer's top-k as their vendor tier (asking for "triton" gives the reference).
A vendor op still checks each call and falls back by itself (``dsa_kernels.vendor``).

Three things wrap every resolved function, so they hold on whichever backend runs:

* **One input contract** (``dsa_kernels.contract``): every function is checked here before it
  runs (a Triton launcher calls the same check again itself, for direct callers). A CPU test on the torch
  reference therefore refuses what the GPU path's kernels refuse, with the same message.
* **Interpreted Triton launches are serialized.** Under ``TRITON_INTERPRET=1`` the interpreter
  keeps its grid and its patched ``tl`` builtins in process-global state, so two emulated streams
  (threads) interpreting kernels at once collide (``InterpreterError('x >= grid_dim[0]')`` or a
  silently wrong program id). Every Triton op then runs under one process-wide lock. No lock on a
  real GPU, where launches are asynchronous and independent. ``UNSAFE_UNLOCKED_INTERPRETER``
  (tests only) turns the lock off, so the concurrency test can show the collision it prevents.
  Inside the lock, a **launch hook** (:func:`set_launch_hook`) may wrap the launch: the stream
  sanitizer declares there what the kernel really reads and writes, because the interpreter copies
  every tensor argument in and out whole (``hicache.sanitizer.kernel_accesses``).
* **Triton and vendor calls go through the PyTorch dispatcher** as custom ops
  (``torch.ops.dsa_kernels.*``, registered by ``dsa_kernels.custom_ops`` on first resolve), whose
  schemas name the tensors each op writes: CUDA's stream sanitizer, the profiler and
  ``torch.compile`` see them as they see aten ops. Order per call: the contract check, then the
  interpreter lock and the launch hook (given the caller's own arguments), then the custom op.
  The hook stays outside the op: the stream sanitizer's row-level declaration must replace the
  whole-tensor write the schema would show it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Callable

import torch

from dsa_kernels import contract
from lsconfig import envs

UNSAFE_UNLOCKED_INTERPRETER = False  # documented unsafe switch (tests only): True drops the interpreter lock
INTERPRETER_LOCK = threading.RLock()  # held by every interpreted Triton launch (reentrant: a launcher may nest)
_LAUNCH_HOOK: Callable | None = None  # (op, args, kwargs) -> context manager around an interpreted launch


def set_launch_hook(hook: Callable | None) -> None:
    """``hook(op, args, kwargs)`` returns a context manager entered around every interpreted Triton
    launch, under the interpreter lock; ``None`` removes it. Used by ``hicache.sanitizer.kernel_accesses``."""
    global _LAUNCH_HOOK
    _LAUNCH_HOOK = hook

OPS = {
    # op name -> module that holds it under dsa_kernels.reference / dsa_kernels.triton_ops
    "quantize_index_keys": "index_keys",
    "dequantize_index_keys": "index_keys",
    "pack_mla_kv": "mla_kv",
    "unpack_mla_kv": "mla_kv",
    "indexer_scores": "indexer",
    "sparse_mla_prefill": "sparse_mla",
    "gather_pages": "paged_copy",
    "scatter_pages": "paged_copy",
}
TOPK_OPS = {"topk_indices": "indexer", "topk_merge": "indexer", "topk_slots": "indexer"}


@functools.cache
def _vendor_ops() -> dict[str, object]:
    from dsa_kernels import vendor

    return vendor.available()


def _load(backend: str, op: str) -> Callable:
    package = {"torch": "reference", "triton": "triton_ops"}[backend]
    return getattr(importlib.import_module(f"dsa_kernels.{package}.{(OPS | TOPK_OPS)[op]}"), op)


def _checked(op: str, fn: Callable) -> Callable:
    """``fn`` behind the op's contract (every backend; a Triton launcher checks again by itself)."""
    check = contract.CHECKS.get(op)
    if check is None:  # the top-k selections: torch reference or FlashInfer, no kernel contract
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        check(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


def _interpreter_locked(op: str, fn: Callable) -> Callable:
    """``fn`` under ``INTERPRETER_LOCK`` (the Triton interpreter's state is process-global), inside
    the launch hook's context when one is set."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        hook = _LAUNCH_HOOK
        declared = hook(op, args, kwargs) if hook is not None else contextlib.nullcontext()
        if UNSAFE_UNLOCKED_INTERPRETER:
            with declared:
                return fn(*args, **kwargs)
        with INTERPRETER_LOCK, declared:
            return fn(*args, **kwargs)

    return run


def _wrap(backend: str, op: str, fn: Callable) -> Callable:
    """An interpreted Triton launch under the lock and the launch hook; anything else as it is."""
    return _interpreter_locked(op, fn) if backend == "triton" and envs.triton_interpret() else fn


def _build(backend: str, op: str, fn: Callable) -> Callable:
    """``fn`` as ``resolve`` returns it: the contract check (before the dispatcher, so its messages,
    not the dispatcher's argument errors), then ``_wrap``, then the custom op for Triton and vendor
    (the torch reference's aten ops are on the dispatcher already)."""
    if backend != "torch":
        from dsa_kernels import custom_ops  # registered on first resolve, not when dsa_kernels is imported

        fn = custom_ops.routed(op, fn, backend)
    return _checked(op, _wrap(backend, op, fn))


def resolve(op: str, device: torch.device | str, backend: str | None = None) -> tuple[str, Callable]:
    """Return ``(backend_name, function)`` for ``op`` on ``device`` (cached per op/device type/choice)."""
    return _resolve(op, torch.device(device).type, backend or envs.kernel_backend())


@functools.cache
def _resolve(op: str, device_type: str, choice: str) -> tuple[str, Callable]:
    if op not in OPS and op not in TOPK_OPS:
        raise ValueError(f"op: expected one of {sorted(OPS | TOPK_OPS)}, got {op!r}")
    on_cuda = device_type == "cuda"
    if choice == "vendor":
        if op in _vendor_ops() and on_cuda:
            return "vendor", _build("vendor", op, _vendor_ops()[op])
        choice = "auto"  # ops without a vendor kernel use the next tier
    if choice == "auto":
        if on_cuda and op in _vendor_ops():
            return "vendor", _build("vendor", op, _vendor_ops()[op])
        choice = "triton" if on_cuda else "torch"
    if choice not in ("triton", "torch"):
        raise ValueError(f"backend: expected one of {envs.KERNEL_BACKENDS}, got {choice!r}")
    if op in TOPK_OPS:
        choice = "torch"  # no Triton top-k: the reference's sort is the non-vendor tier
    return choice, _build(choice, op, _load(choice, op))
