"""Host reads the dispatcher never sees, for the stream-ordering sanitizer (:mod:`hicache.sanitizer`).

On a CPU, ``Tensor.tolist()`` reads the data directly and ``Tensor.numpy()`` (and ``__array__``,
which calls it) dispatches only a ``detach`` (a view, no access); ``.cpu()`` and ``.to("cpu")`` return
the tensor itself. (``.item()``, ``bool()``, ``int()``, ``float()`` and ``__index__`` dispatch
``_local_scalar_dense``, which the dispatch mode already sees as a read.) While the sanitizer is on,
these methods are patched:

* ``tolist`` / ``numpy``: a read of the tensor's bytes by the agent that runs it (the host thread:
  the host; inside a stream op: that stream, as a D2H copy on it would). Reading a side stream's
  result on the host therefore needs an event or stream synchronize first, like any host access.
* ``.to("cpu", non_blocking=True)`` of device memory (not :func:`mark_host_memory`): as on CUDA, a
  copy into a fresh pinned host buffer, written by the stream that issued it when that stream gets
  there; the host may read the result only after a host-side wait (the copy's event synchronized).
  The device is recognised as the *string* ``"cpu"``: on a CPU the runtime's ``torch.device`` and
  the host's compare equal, and ``.to(rt.device)`` of a device tensor is no copy on a GPU.
* ``.cpu()`` and ``.to("cpu")`` without ``non_blocking``: the same copy, and the host waits for it
  (a blocking D2H returns finished data: the host is ordered after the issuing stream; inside a
  worker stream's op, where the emulated host does not block, no edge is added).

The copies' results are host memory (pinned on CUDA: its allocator fences reuse itself, so no
stream-bound reuse is checked for them).
"""

from __future__ import annotations

import torch

_original: dict[str, object] = {}


def _d2h(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """(a copy to the host named as ``"cpu"``, non_blocking) of a ``Tensor.to`` call."""
    device = kwargs.get("device", args[0] if args else None)
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    return device == "cpu" and isinstance(device, str), bool(non_blocking)


def install(current) -> None:
    """Patch the methods; ``current()`` returns the active sanitizer or None."""
    if _original:
        return
    for name in ("tolist", "numpy", "cpu", "to"):
        _original[name] = getattr(torch.Tensor, name)

    def reader(name: str):
        original = _original[name]

        def read(t, *args, **kwargs):
            san = current()
            if san is not None:
                san.host_read(t, name)
            return original(t, *args, **kwargs)
        return read

    def cpu(t, *args, **kwargs):
        san = current()
        if san is None or san.is_host_memory(t) or t.device.type != "cpu" or san.internal():
            return _original["cpu"](t, *args, **kwargs)
        return san.to_host(lambda: _original["to"](t, "cpu", copy=True), blocking=True)

    def to(t, *args, **kwargs):
        san = current()
        if san is None or san.is_host_memory(t) or t.device.type != "cpu" or san.internal():
            return _original["to"](t, *args, **kwargs)
        d2h, non_blocking = _d2h(args, kwargs)
        if not d2h:
            return _original["to"](t, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k != "copy"}
        return san.to_host(lambda: _original["to"](t, *args, **rest, copy=True), blocking=not non_blocking)

    torch.Tensor.tolist, torch.Tensor.numpy = reader("tolist"), reader("numpy")
    torch.Tensor.cpu, torch.Tensor.to = cpu, to


def uninstall() -> None:
    for name, fn in _original.items():
        setattr(torch.Tensor, name, fn)
    _original.clear()
