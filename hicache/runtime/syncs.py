"""Count host synchronizations: operations that make the host wait for the device.

On a GPU, reading a value or a data-dependent size of a device tensor on the host blocks until every
kernel queued before it has run, and so does a blocking copy between device and host memory; a
forward with one per layer cannot run ahead of its GPU. On CPU nothing blocks, so
:class:`SyncCounter` flags the operations instead:

* dispatched: ``.item()`` / ``int()`` / ``float()`` / ``bool()`` / ``__index__`` (all
  ``_local_scalar_dense``), ``nonzero``, ``unique``, ``masked_select``, ``equal``, boolean-mask
  indexing, ``repeat_interleave`` without ``output_size``; ``copy_`` between device and host memory
  that blocks (D2H without ``non_blocking`` or into unpinned memory, H2D from unpinned memory or
  without ``non_blocking``); with ``factories_on_device``, a device op given a host tensor operand
  (an implicit H2D copy);
* not dispatched (Python-level methods, patched while the counter is active): ``.tolist()``,
  ``.numpy()`` (and ``__array__``), ``.cpu()`` of a device tensor, ``.to(...)`` that moves a host
  tensor to the device from unpinned memory or without ``non_blocking``, and ``.to("cpu")`` of a
  device tensor without ``non_blocking`` on an accelerator (on a CPU ``.to("cpu")`` and
  ``.to(device)`` are the same call: there ``.cpu()`` is the D2H that is seen).

**Device and host tensors.** A *device* tensor is one passed to :meth:`SyncCounter.device` (or found
by :meth:`SyncCounter.device_reachable` in an object: an engine's weights, pools, scratch), every
result of an op with a device input and, with ``factories_on_device=True``, every tensor a factory
(``zeros``, ``arange``, ``empty``) makes inside the counted region (device code passes ``device=``).
Everything else is *host*: tensors made from Python data (``torch.tensor(list)``), results of host
tensors only, host memory (:func:`hicache.sanitizer.access.mark_host_memory`: host pools and
staging buffers, which are pinned where an accelerator exists) and :meth:`SyncCounter.host`.
*Pinned* host memory is ``is_pinned()`` or marked host memory on an accelerator; on a CPU, where
nothing can be pinned, any host tensor (so there a transfer counts when it lacks ``non_blocking``).

Work on emulated worker streams (:mod:`hicache.runtime.streams`) is counted too: on a GPU the host runs a
stream op's Python at submit time. Example::

    with SyncCounter() as guard:
        guard.device(forward_batch.seq_lens, req_to_token)
        hook(backend, forward_batch)
    assert guard.syncs == [], guard.sites()
"""

from __future__ import annotations

import os
import threading
import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hicache.sanitizer.access import is_host

aten = torch.ops.aten

# ops whose result the host must wait for, whatever their arguments
_ALWAYS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
           aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
           aten.masked_select.default, aten.is_nonzero.default, aten.equal.default}
# ops whose host operands are not copied to the device (views, metadata, copies handled apart)
_NO_OPERAND_COPY = {aten.copy_.default, aten._to_copy.default, aten.lift_fresh.default, aten.detach.default,
                    aten.record_stream.default, aten.set_.source_Storage_storage_offset}
_HERE = os.path.dirname(os.path.abspath(__file__))
_PLUMBING = tuple(os.path.join(_HERE, f) for f in ("syncs.py", "streams.py")) + ("sync_guard.py", "threading.py")
_INTERPRETER = os.path.join("triton", "runtime", "interpreter.py")
_active: "SyncCounter | None" = None


def current() -> "SyncCounter | None":
    return _active


def _caller() -> str:
    """The two innermost call sites outside torch and this module: ``path:line (function) < ...``."""
    sites = []
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename
        if "/torch/" not in name and not name.endswith(_PLUMBING) and not name.startswith("<"):
            shown = os.path.relpath(name) if name.startswith(os.getcwd()) else name
            sites.append(f"{shown}:{frame.lineno} ({frame.name})")
            if len(sites) == 2:
                break
    return " < ".join(sites) or "?"


def _is_bool_index(func, args) -> bool:
    """``t[mask]`` / ``t[mask] = v``: the result's size is the mask's number of True values."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


def _is_sizing_repeat(func, kwargs) -> bool:
    return func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
        kwargs.get("output_size") is None


def _target(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """(target device or None, non_blocking) of a ``Tensor.to`` call."""
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    args = args[:2] if len(args) > 2 and not isinstance(args[0], torch.Tensor) and \
        isinstance(args[1], torch.dtype) else args[:3] if len(args) > 3 else args  # drop a positional copy
    try:
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    except (RuntimeError, TypeError):  # a signature _parse_to does not take: parse the device only
        device = next((torch.device(a) for a in args if isinstance(a, (str, torch.device))), None)
        non_blocking = bool(kwargs.get("non_blocking", False))
    return device, non_blocking


class _Mode(TorchDispatchMode):
    """The counter's dispatch mode on one thread (the host thread, or an emulated stream worker)."""

    def __init__(self, guard: "SyncCounter") -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.guard._dispatch(func, args, kwargs or {})


class SyncCounter:
    """Records each synchronizing operation on a device tensor in :attr:`syncs` (what) and
    :attr:`where` (the caller outside torch: ``path:line (function)``)."""

    def __init__(self, factories_on_device: bool = False, device: torch.device | None = None) -> None:
        self.syncs: list[str] = []
        self.where: list[str] = []
        self.factories_on_device = factories_on_device
        self.on_accelerator = (device or torch.device("cuda" if torch.cuda.is_available() else "cpu")).type != "cpu"
        self._device_storages: set[int] = set()
        self._host_storages: set[int] = set()
        self._tls = threading.local()
        self._patched: dict[str, object] = {}
        self._mode: _Mode | None = None

    # marking -------------------------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def device(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as device-resident."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device_storages.add(self._key(t))
                self._host_storages.discard(self._key(t))

    def host(self, *tensors: torch.Tensor) -> None:
        """Mark ``tensors`` as host memory (host metadata the forward may read freely)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._host_storages.add(self._key(t))
                self._device_storages.discard(self._key(t))

    def device_reachable(self, obj, depth: int = 6) -> int:
        """Mark every tensor reachable from ``obj`` (attributes, dataclass fields, containers) as
        device-resident, except host memory; returns how many were marked."""
        seen, count = set(), 0

        def walk(o, d: int) -> None:
            nonlocal count
            if d < 0 or id(o) in seen or isinstance(o, (str, bytes, int, float, bool, type(None))):
                return
            seen.add(id(o))
            if isinstance(o, torch.Tensor):
                if not is_host(self._key(o), o.untyped_storage()):
                    self.device(o)
                    count += 1
                return
            items = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple, set)) else \
                vars(o).values() if hasattr(o, "__dict__") else ()
            for v in list(items):
                walk(v, d - 1)

        walk(obj, depth)
        return count

    def is_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        key = self._key(t)
        return key in self._device_storages and not is_host(key, t.untyped_storage())

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Pinned host memory. Nothing can be pinned without an accelerator, so on a CPU every host
        tensor counts as pinned (code pins where an accelerator exists: ``pin_memory=`` chosen in one
        place); what a CPU run checks is ``non_blocking``. On a GPU the pinning itself is checked."""
        return not self.on_accelerator or is_host(self._key(t), t.untyped_storage()) or t.is_pinned()

    # recording -----------------------------------------------------------------------------------
    def _counting(self) -> bool:
        return _active is self and not getattr(self._tls, "paused", False)

    def _flag(self, what: str) -> None:
        if any(f.filename.endswith(_INTERPRETER) for f in traceback.extract_stack()):
            return  # the Triton interpreter emulating a kernel's loads and stores: device work on a GPU
        self.syncs.append(what)
        self.where.append(_caller())

    def sites(self) -> list[tuple[str, str]]:
        return list(zip(self.syncs, self.where))

    @contextmanager
    def paused(self):
        """Neither count nor track on this thread (set-up that stands for state the forward finds)."""
        previous = getattr(self._tls, "paused", False)
        self._tls.paused = True
        try:
            yield
        finally:
            self._tls.paused = previous

    def _dispatch(self, func, args, kwargs):
        if not self._counting():
            return func(*args, **kwargs)
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = any(self.is_device(t) for t in flat)
        if on_device and (func in _ALWAYS or _is_bool_index(func, args) or _is_sizing_repeat(func, kwargs)):
            self._flag(str(func))
        elif func is aten.copy_.default:
            self._check_copy(args[0], args[1], bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False))
        elif self.factories_on_device and on_device and func not in _NO_OPERAND_COPY and any(
                t.dim() > 0 and not self.is_device(t) for t in flat):
            self._flag(f"{func} (implicit H2D copy of a host operand)")
        out = func(*args, **kwargs)
        self._track(func, flat, out, on_device)
        return out

    def _check_copy(self, dst, src, non_blocking: bool) -> None:
        dst_dev, src_dev = self.is_device(dst), self.is_device(src)
        if src_dev and not dst_dev and not (non_blocking and self.is_pinned(dst)):
            self._flag("copy_ D2H (blocking, or into unpinned memory)")
        elif dst_dev and not src_dev and not (non_blocking and self.is_pinned(src)):
            self._flag("copy_ H2D (blocking, or from unpinned memory)")

    def _track(self, func, flat, out, on_device: bool) -> None:
        for t in tree_flatten(out)[0]:  # results of device tensors live on the device
            if not isinstance(t, torch.Tensor):
                continue
            if func is aten.lift_fresh.default:  # torch.tensor(python data): host memory
                self.host(t)
            elif on_device or (self.factories_on_device and not flat):
                self.device(t)
            elif not any(a is t for a in flat):  # a fresh host result (maybe at a freed device address)
                self._device_storages.discard(self._key(t))

    # the methods that do not dispatch ----------------------------------------------------------
    def _read(self, name: str, original):
        guard = self

        def read(t, *args, **kwargs):
            if guard._counting() and guard.is_device(t):
                guard._flag(name)
            return original(t, *args, **kwargs)
        return read

    def _moved(self, t: torch.Tensor, out: torch.Tensor, to_device: bool) -> torch.Tensor:
        """The result of a transfer: a copy in the other memory (on a CPU ``.to`` returns ``t``)."""
        if out is t:
            with self.paused():
                out = t.clone()
        (self.device if to_device else self.host)(out)
        return out

    def _cpu(self, original):
        guard = self

        def cpu(t, *args, **kwargs):
            out = original(t, *args, **kwargs)
            if guard._counting() and guard.is_device(t):
                guard._flag(".cpu() (blocking D2H)")
                return guard._moved(t, out, to_device=False)
            return out
        return cpu

    def _to(self, original):
        guard = self

        def to(t, *args, **kwargs):
            out = original(t, *args, **kwargs)
            if not guard._counting():
                return out
            device, non_blocking = _target(args, kwargs)
            if device is None:
                return out
            if guard.is_device(t):
                if device.type == "cpu" and guard.on_accelerator:
                    if not non_blocking:
                        guard._flag(".to('cpu') (blocking D2H)")
                    return guard._moved(t, out, to_device=False)
                return out
            if not (non_blocking and guard.is_pinned(t)):
                guard._flag(".to(device) H2D (blocking, or from unpinned memory)")
            return guard._moved(t, out, to_device=True)
        return to

    # activation ------------------------------------------------------------------------------------
    def __enter__(self) -> "SyncCounter":
        global _active
        assert _active is None, "SyncCounter: one counter at a time"
        patches = {"tolist": self._read("tolist", torch.Tensor.tolist),
                   "numpy": self._read("numpy", torch.Tensor.numpy),
                   "cpu": self._cpu(torch.Tensor.cpu), "to": self._to(torch.Tensor.to)}
        for name, fn in patches.items():
            self._patched[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, fn)
        _active = self
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self._mode.__exit__(*exc)
        for name, fn in self._patched.items():
            setattr(torch.Tensor, name, fn)
        self._patched.clear()
        _active = None

    def run_op(self, fn) -> None:
        """Run a stream op on its worker thread under this counter (hook of :mod:`hicache.runtime.streams`)."""
        with _Mode(self):
            fn()
