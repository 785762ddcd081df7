"""Copies of a world for the search and the walks: pickles that leave its frozen configuration out.

Every state the checker keeps, and every copy it branches from, is a pickle of the whole world — and a
third of that pickle, and some 40% of the time to load it, is configuration no step ever changes: the
bounds, the stress configuration and the frozen dataclasses inside it (decode's and prefill's configs,
the topology, the back-off, the fault rates). :class:`Snapshots` pickles those objects as references to
the one instance the initial world was built with, so every copy shares it.

That sharing is safe only for objects nothing can change, so an object is shared only if it is a frozen
dataclass whose fields are all immutable (numbers, strings, ``None``, enums, tuples and frozensets of
those, other such dataclasses); anything else — and any instance built later, e.g. by a restart — is
pickled by value as before. The references are keys into a table of this process: a blob is loaded by the
process that wrote it or by one forked after the table was filled (the search's workers are forked per
level, after the initial world is built), never saved.
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import itertools
import pickle

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_SHARED: dict[int, object] = {}  # key -> the shared instance (of every open Snapshots in this process)
_KEYS = itertools.count()


def shared(key: int) -> object:
    """The instance a shared reference names (what a blob's reference calls on load)."""
    return _SHARED[key]


class Snapshots:
    """``dumps`` / ``loads`` of worlds built like ``world``, sharing its immutable configuration.
    Use as a context manager: leaving it forgets the shared instances (blobs written inside cannot be
    loaded after)."""

    def __init__(self, world) -> None:
        self._key_of: dict[int, int] = {}  # id(shared instance) -> key
        for obj in _immutable_parts(world):
            key = next(_KEYS)
            _SHARED[key] = obj
            self._key_of[id(obj)] = key
        self._table = copyreg.dispatch_table.copy()
        for cls in {type(_SHARED[k]) for k in self._key_of.values()}:
            self._table[cls] = self._reduce

    def __enter__(self) -> "Snapshots":
        return self

    def __exit__(self, *exc) -> None:
        for key in self._key_of.values():
            _SHARED.pop(key, None)
        self._key_of.clear()

    @property
    def shared_count(self) -> int:
        return len(self._key_of)

    def dumps(self, world) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, _PROTOCOL)
        pickler.dispatch_table = self._table
        pickler.dump(world)
        return buffer.getvalue()

    @staticmethod
    def loads(blob: bytes):
        return pickle.loads(blob)

    def _reduce(self, obj):
        key = self._key_of.get(id(obj))
        if key is None:  # an instance of a shared type built later (a restart's config): by value
            return obj.__reduce_ex__(_PROTOCOL)
        return shared, (key,)


def _immutable_parts(world) -> list:
    """The frozen, all-immutable dataclass instances ``world`` holds (each once): found by pickling it once
    with a hook that sees every object on the way."""
    found: dict[int, object] = {}

    class _Finder(pickle.Pickler):
        def reducer_override(self, obj):
            if id(obj) not in found and dataclasses.is_dataclass(obj) and not isinstance(obj, type) \
                    and _immutable(obj):
                found[id(obj)] = obj
            return NotImplemented

    _Finder(io.BytesIO(), _PROTOCOL).dump(world)
    return list(found.values())


def _immutable(value) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, enum.Enum)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        extra = set(getattr(value, "__dict__", {})) - set(names)  # an attribute set behind the dataclass's back
        return value.__dataclass_params__.frozen and not extra and all(_immutable(getattr(value, n)) for n in names)
    return False
