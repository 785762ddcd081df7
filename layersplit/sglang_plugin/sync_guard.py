"""Count host synchronizations: operations that make the host wait for the device.

On a GPU, reading a value or a data-dependent size of a device tensor on the host (``.item()``,
``int()``, ``bool()``, ``.tolist()``, ``nonzero``, ``unique``, boolean-mask indexing,
``masked_select``, ``repeat_interleave`` without ``output_size``) blocks until every kernel queued
before it has run; in SGLang's overlap scheduler that stalls the next batch's CPU work behind this
one's GPU work. On CPU nothing blocks, so :class:`SyncCounter` flags the operations instead.

Which tensors count as *device* tensors: those passed to :meth:`SyncCounter.device` (what SGLang
keeps on the device: ``req_to_token``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``, the
pool buffers) and every result computed from one. Host metadata SGLang already holds
(``seq_lens_cpu``, ``extend_prefix_lens_cpu``) and tensors built from it are free to read.

Example::

    with SyncCounter() as guard:
        guard.device(forward_batch.seq_lens, req_to_token)
        hook(backend, forward_batch)
    assert guard.syncs == [], guard.syncs
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose result the host must wait for, whatever their arguments
_ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
           aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
           aten.masked_select.default, aten.is_nonzero.default, aten.equal.default}


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("sync_guard.py"):
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


def _is_bool_index(func, args) -> bool:
    """``t[mask]`` / ``t[mask] = v``: the result's size is the mask's number of True values."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


def _is_sizing_repeat(func, kwargs) -> bool:
    return func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
        kwargs.get("output_size") is None


class SyncCounter(TorchDispatchMode):
    """Records each synchronizing op on a device tensor (name and the op) in :attr:`syncs`."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self.where: list[str] = []  # the caller of each, outside torch (file:line function)
        self._device_storages: set[int] = set()
        self._tolist = None

    def device(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as device-resident."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device_storages.add(t.untyped_storage().data_ptr())

    def _on_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._device_storages

    def __enter__(self):
        guard, original = self, torch.Tensor.tolist

        def tolist(t):  # not dispatched: reads the data directly
            if guard._on_device(t):
                guard.syncs.append("tolist")
                guard.where.append(_caller())
            return original(t)

        self._tolist, torch.Tensor.tolist = original, tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in args if isinstance(a, torch.Tensor)] + \
            [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)] + \
            [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        on_device = any(self._on_device(t) for t in flat)
        if on_device and (func in _ALWAYS or _is_bool_index(func, args) or _is_sizing_repeat(func, kwargs)):
            self.syncs.append(str(func))
            self.where.append(_caller())
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        for t in outs:  # results of device tensors live on the device; fresh host results do not
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if on_device:
                    self._device_storages.add(ptr)
                elif not any(a is t for a in flat):  # a reused address of a freed device tensor
                    self._device_storages.discard(ptr)
        return out
