"""What a tensor op touches, for the stream-ordering sanitizer (:mod:`hicache.sanitizer`).

* reads and writes from the op's schema (``alias_info``; reused from ``torch.cuda._sanitizer``:
  ``zip_arguments`` and its factory-function rule), c10d's collectives by their semantics (their
  schemas carry no alias annotations);
* byte ranges of a storage: a view's extent, narrowed to the rows an integer index selects along
  dim 0 (``pages[ids]``, ``index_put_``, ``index_select``, ``index_copy_``, ``index_fill_``);
* host memory (:func:`mark_host_memory`): host pools and pinned buffers, whose non-copy ops inside a
  stream op are host work at submit time;
* the call site: the first frames outside torch and the runtime.
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
from torch.cuda._sanitizer import FACTORY_FUNCTION_REGEX, zip_arguments
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
COPIES = {aten.copy_.default, aten._to_copy.default}
_INDEX_READS = {aten.index.Tensor: 1, aten.index.Tensor_out: 1, aten.index_select.default: 2,
                aten.index_select.out: 2}  # op -> position of the index
_INDEX_WRITES = {aten.index_put_.default: 1, aten._index_put_impl_.default: 1, aten.index_copy_.default: 2,
                 aten.index_fill_.int_Scalar: 2, aten.index_fill_.int_Tensor: 2, aten.index_add_.default: 2}
SKIP = {aten.record_stream.default, aten.set_.source_Storage_storage_offset}
_HICACHE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL_FILES = {os.path.join(_HICACHE, f) for f in ("sanitizer/core.py", "sanitizer/access.py", "runtime/streams.py",
                                                       "runtime/device_module.py")}
_LIBRARY_FILES = ("threading.py", "contextlib.py")  # the runtime's own plumbing, not a call site
_HOST_MEMORY: dict[int, weakref.ref] = {}  # storage data_ptr -> the storage, for host (pinned) memory


def mark_host_memory(*tensors: torch.Tensor) -> None:
    """Declare ``tensors`` host memory (host pools, pinned staging): non-copy ops on them inside a
    stream op are host work at submit time."""
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr():
            _HOST_MEMORY[storage.data_ptr()] = weakref.ref(storage)


def is_host(key: int, storage) -> bool:
    ref = _HOST_MEMORY.get(key)
    return ref is not None and ref() is storage


def where() -> str:
    """The two innermost call sites outside torch, installed packages and the runtime itself."""
    frame, sites = sys._getframe(1), []
    while frame is not None and len(sites) < 2:
        name = frame.f_code.co_filename
        internal = (name in _INTERNAL_FILES or name.startswith("<") or name.endswith(_LIBRARY_FILES)
                    or "site-packages" in name)
        if not internal:
            shown = os.path.relpath(name) if name.startswith(os.getcwd()) else name
            sites.append(f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(sites) or "?"


_MAX_ROW_RANGES = 4096  # a strided view with more rows is taken by its whole extent


def byte_ranges(t: torch.Tensor, rows: list[int] | None = None) -> list[tuple[int, int]]:
    """Byte ranges of ``t``'s storage it covers: its extent; or per row along dim 0 (``rows``, or
    every row of a view with gaps between its rows, such as a column slice ``buf[:, :8]``)."""
    if t.numel() == 0:
        return []
    es, base = t.element_size(), t.storage_offset()
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    if rows is None and t.dim() >= 2 and extent > t.numel() and t.shape[0] <= _MAX_ROW_RANGES:
        rows = range(t.shape[0])  # gaps: cover each row, not the span across them
    if rows is None or t.dim() == 0:
        return [(base * es, (base + extent) * es)]
    row_extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape[1:], t.stride()[1:]))
    out: list[tuple[int, int]] = []
    for r in rows:
        start = (base + r * t.stride(0)) * es
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + row_extent * es)
        else:
            out.append((start, start + row_extent * es))
    return out


def index_rows(func, args: tuple) -> tuple[torch.Tensor, list[int]] | None:
    """(indexed tensor, its rows along dim 0) for an integer-index op on dim 0, else None."""
    pos = _INDEX_READS.get(func, _INDEX_WRITES.get(func))
    if pos is None or len(args) <= pos:
        return None
    self, index = args[0], args[pos]
    if pos == 2 and args[1] != 0:  # index_select / index_copy_ along another dim
        return None
    if isinstance(index, (list, tuple)):  # advanced indexing: the first index picks the rows of dim 0
        if not index or index[0] is None:
            return None
        index = index[0]
    if not isinstance(index, torch.Tensor) or index.dtype in (torch.bool, torch.uint8) or self.dim() == 0:
        return None
    n = self.shape[0]
    return self, sorted({v % n for v in index.flatten().tolist()}) if n else []


def _collective_access(func, args: tuple) -> list[tuple[torch.Tensor, bool]] | None:
    """c10d's schemas carry no alias annotations: broadcast_ writes its tensors except on the root,
    allgather_ reads its inputs and writes its outputs."""
    name = func._schema.name
    if name == "c10d::broadcast_":
        root = torch.distributed.ProcessGroup.unbox(args[1]).rank() == args[2]
        return [(t, not root) for t in tree_flatten(args[0])[0]]
    if name == "c10d::allgather_":
        return [(t, True) for t in tree_flatten(args[0])[0]] + [(t, False) for t in tree_flatten(args[1])[0]]
    if name.startswith("c10d::"):
        return [(t, True) for t in tree_flatten(list(args))[0] if isinstance(t, torch.Tensor)]
    return None


def op_accesses(func, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, bool]]:
    """``(tensor, is_write)`` for every tensor argument ``func`` reads or writes (not views, not
    the metadata-only inputs of ``*_like`` factories)."""
    collective = _collective_access(func, args)
    if collective is not None:
        return collective
    factory = bool(FACTORY_FUNCTION_REGEX.match(func._schema.name))
    out = []
    for argument, value in zip_arguments(func._schema, args, kwargs):
        alias = argument.alias_info
        write = alias is not None and alias.is_write
        if factory or (alias is not None and not write):
            continue  # metadata only (a view, or a *_like factory)
        out.extend((t, write) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out
