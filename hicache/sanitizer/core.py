"""Happens-before stream sanitizer for the emulated runtime: finds missing stream edges on a CPU.

In the emulated runtime the compute stream is the host thread and runs synchronously, so a side
stream that forgets to wait for it still reads finished data; a race shows only if a random stall
exposes it. This sanitizer does not rely on timing. It attributes every tensor access to the agent
that would execute it on a GPU and keeps a vector clock per agent; an access that conflicts with an
earlier one (write/read, read/write, write/write on overlapping bytes) that is not ordered before it
is reported with both call sites. A missing edge is reported on every run.

**Agents.**

* ``host``: a host thread outside any stream context; also *host halves* that a GPU runs at submit
  time: a non-copy op on host memory (:func:`mark_host_memory`) inside a stream op (on CUDA a CPU
  op inside ``with torch.cuda.stream(s)`` runs at once on the host, not in stream order). Such an
  access carries the host's clock at submission, not the stream's.
* a stream: each emulated worker stream (its ops run on its thread), and the inline compute stream
  (the host thread inside ``stream.active()``). A copy op between host memory and device memory in
  a stream op is a DMA on that stream (``copy_(non_blocking=True)`` from pinned memory).
* the compute stream is one agent, ``stream compute``, shared by every emulated compute stream
  (``rt.compute_stream()``): on CUDA each is the device's current stream.

**Tensor creation.** A factory op (``zeros``, ``empty``, ``full``, ``randn``, ``*_like``, ...) that a host
thread runs outside any stream op and outside :func:`host_work` creates *device* memory: on CUDA it is a
kernel on the current stream, so it is booked as a write by the compute stream (the host launched it
then), not as host work ordered before every later submission. A side stream that writes or reads
the new tensor must be ordered after the compute stream (an event recorded there), or the zero fill
may land after its access: the init race of a pool zero-filled on the default stream and written by
a non-blocking load stream. Later accesses by the *creating host thread* are ordered after the
creation (on a CPU the host cannot tell a host tensor from a device one: either it was host work, or
its later ops are kernels on the same stream). :func:`mark_host_memory` re-books a creation as host
work (pinned staging made with ``torch.empty`` and then declared host memory).

**Edges** (fed by :mod:`hicache.runtime.streams` when the *stream reaches them*, not when the host calls
them): each submitted op carries the submitting host's clock; ``record`` snapshots the stream's
clock into that record (keyed per record, not per event object); ``wait_event`` joins it into the
waiting stream; ``Event.synchronize``, a ``query()`` that returns True and ``Stream.synchronize``
join it into the host. Implicit syncs (``.item()``, ``.tolist()``) are *not* edges: code that relies
on one must synchronize the stream or event explicitly. Host reads the dispatcher never sees
(``.tolist()``, ``.numpy()``) and device-to-host copies (``.cpu()``, ``.to("cpu", non_blocking=True)``,
modelled as CUDA runs them: a copy on the issuing stream into pinned memory) are in
:mod:`hicache.sanitizer.host_reads`; a blocking copy is the one implicit sync that is an edge (its result is
finished when the host gets it).

**Memory.** Accesses are byte ranges of a storage: a view's extent, refined to the rows an integer
index selects along dim 0 (``pages[ids]``, ``index_put_``, ``index_select``, ``index_copy_``), so
page copies touch only their pages. When a storage dies (a finalizer on it: CPU has no allocator
hooks) its history is dropped and the **caching allocator's stream-bound reuse** is checked: CUDA
hands a freed block to the next allocation on the stream that allocated it at once, so every
access by another stream must be ordered before the free, or declared with ``stream.record_stream(t)``.

What is reused from PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``): ``StreamSynchronizations``
holds the vector clocks (record / wait / ordered-after) and ``zip_arguments`` with the schemas'
``alias_info`` tells reads from writes. What differs: the clocks are driven by our runtime's hooks
instead of CUDA's trace callbacks, the host is an agent of its own whose clock travels with every
submitted op, accesses are byte ranges instead of ``data_ptr`` keys (views of one buffer), and
hazards are collected instead of raised.

What an op touches (schemas, byte ranges, host memory, call sites) is in
:mod:`hicache.sanitizer.access`.

Usage::

    with sanitized() as san:          # or LAYERSPLIT_SANITIZE=1 where the commands read it
        run_the_pipeline()
    assert not san.hazards, san.format()
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.cuda._sanitizer import StreamSynchronizations
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hicache.sanitizer.access import COPIES, SKIP, byte_ranges, index_rows, is_host, op_accesses, where
from hicache.sanitizer.access import mark_host_memory as _mark_host_memory
from dsa_kernels import dispatch
from hicache.sanitizer import host_reads, kernel_accesses

_active: "Sanitizer | None" = None
_CURRENT_STREAM = None  # set by a torch.cuda-shaped device module: the calling host thread's current stream


def follow_current_stream(resolver) -> None:
    """``resolver()``: the emulated stream a host thread's plain torch ops belong to (a device
    module's current stream), or None; ``None`` unsets it."""
    global _CURRENT_STREAM
    _CURRENT_STREAM = resolver


@dataclass(frozen=True)
class Site:
    """One side of a hazard: who accessed, how, and from where."""

    agent: str
    op: str
    write: bool
    where: str

    def __str__(self) -> str:
        return f"{'write' if self.write else 'read'} by {self.agent} in {self.op} at {self.where}"


@dataclass(frozen=True)
class Hazard:
    """Two unordered accesses. ``kind``: ``read-write`` (one side writes), ``write-write``, or
    ``allocator-reuse`` (``first`` accessed a block that its allocating stream may reuse, ``second``).
    The two sites of a conflict are in a canonical order, not the order they happened to run in
    on this CPU, so the same missing edge gives the same report on every run."""

    kind: str
    first: Site
    second: Site

    @property
    def key(self) -> tuple:
        return (self.kind, self.first, self.second)

    def __str__(self) -> str:
        joint = "then reusable by" if self.kind == "allocator-reuse" else "unordered with"
        return f"{self.kind}: {self.first}\n    {joint} {self.second}"


@dataclass
class _Access:
    start: int
    end: int
    agent: int
    seq: int
    write: bool
    op: str
    where: str
    host: int | None = None  # a creation: the host thread that ran it (ordered after it, see the docstring)


@dataclass
class _History:
    accesses: list[_Access] = field(default_factory=list)
    alloc_agent: int | None = None  # the stream that allocated it (None: seen before the sanitizer)
    recorded: set[int] = field(default_factory=set)  # record_stream() declarations
    storage: weakref.ref | None = None  # the storage it belongs to; dead: the address was freed


class _Mode(TorchDispatchMode):
    def __init__(self, san: "Sanitizer") -> None:
        super().__init__()
        self.san = san

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _active is not self.san or func in SKIP or getattr(self.san._tls, "opaque", False):
            return func(*args, **kwargs)
        with self.san.host_op_in_stream_order():
            inputs = self.san.parse_inputs(func, args, kwargs)
            out = func(*args, **kwargs)
            self.san._tls.internal = True  # its own host reads (index rows) are not the program's
            try:
                self.san.on_op(func, args, inputs, out, kwargs)
            finally:
                self.san._tls.internal = False
        return out


class Sanitizer:
    def __init__(self) -> None:
        self.sync = StreamSynchronizations()  # reused from torch: vector clocks per agent and record
        self.hazards: list[Hazard] = []
        self.ops_checked = 0
        self._seen: set[tuple] = set()
        self._names: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._storages: dict[int, _History] = {}
        self._freed: list[tuple[int, _History, dict[int, int]]] = []
        self._inline: set[int] = set()  # compute streams executed by the host thread
        self._agents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # stream -> agent
        self._streams: dict[int, weakref.ref] = {}  # agent -> stream
        self._active: set[int] = set()  # agents that accessed memory
        self._compute: int | None = None  # the compute stream's agent (:meth:`compute_agent`)

    # agents -------------------------------------------------------------------------------------
    def _new_agent(self, name: str) -> int:
        agent = next(self._ids)
        self.sync.create_stream(agent)
        self._names[agent] = name
        return agent

    def host_agent(self) -> int:
        agent = getattr(self._tls, "host", None)
        if agent is None:
            main = threading.current_thread() is threading.main_thread()
            agent = self._tls.host = self._new_agent("host" if main else f"host:{threading.current_thread().name}")
        return agent

    def stream_agent(self, stream) -> int:
        """This sanitizer's agent for ``stream`` (kept here, not on the stream: a later sanitizer
        numbers its agents afresh). Every emulated compute stream is :meth:`compute_agent`."""
        with self._lock:
            agent = self._agents.get(stream)
            if agent is None:
                inline = getattr(stream, "is_compute", False)  # streams.InlineStream (which imports this module)
                agent = self._agents[stream] = self.compute_agent() if inline else self._new_agent(f"stream {stream.name}")
                self._streams.setdefault(agent, weakref.ref(stream))
            return agent

    def compute_agent(self) -> int:
        """The compute stream (the device's current stream on CUDA): one agent for every emulated
        compute stream, and the one that creates device tensors on a host thread (module docstring)."""
        with self._lock:
            if self._compute is None:
                self._compute = self._new_agent("stream compute")
                self._inline.add(self._compute)  # run by the host thread, in program order
            return self._compute

    def _state(self, agent: int) -> dict[int, int]:
        return self.sync.current_sync_states[agent]

    def _join(self, agent: int, other: dict[int, int]) -> None:
        self.sync._state_wait_for_other(self._state(agent), other)

    def _enter_mode(self) -> None:
        if getattr(self._tls, "mode", None) is None:
            self._tls.mode = _Mode(self)
            self._tls.mode.__enter__()

    # hooks called by hicache.runtime.streams ---------------------------------------------------------------
    def submit_state(self) -> tuple[int, dict[int, int]]:
        """(the submitting host, its clock): carried into the op it submits. Work submitted from a
        stream op (nested) carries that stream's clock."""
        with self._lock:
            submit = getattr(self._tls, "submit", None)
            if submit is not None:  # from inside a stream op: on a GPU the host submitted both at once
                return submit[0], dict(submit[1])
            host = self.host_agent()  # not the compute stream's: the host runs ahead of it
            seq = next(self._seq)  # the submission is a host event: its host half (if any) happens here
            self.sync.update_seq_num(host, seq)
            return host, dict(self._state(host))

    def run_op(self, stream, submit: tuple[int, dict[int, int]], fn) -> None:
        """Run ``fn`` as an op of ``stream`` (on its worker thread), submitted with ``submit``."""
        self._enter_mode()
        agent = self.stream_agent(stream)
        with self._lock:
            self._join(agent, submit[1])
        previous = (getattr(self._tls, "stream", None), getattr(self._tls, "submit", None))
        self._tls.stream, self._tls.submit, self._tls.worker = agent, submit, True
        try:
            fn()
        finally:
            self._tls.stream, self._tls.submit = previous
            # the worker drops the closure later; on a GPU the host dropped it right after submitting
            self._tls.free_state = submit[1]

    @contextmanager
    def acting_as(self, stream):
        """The calling host thread executes ``stream``'s ops inline (the emulated compute stream)."""
        self._enter_mode()
        agent = self.stream_agent(stream)
        self._inline.add(agent)
        previous = getattr(self._tls, "stream", None), getattr(self._tls, "submit", None)
        self._tls.stream, self._tls.submit = agent, None
        try:
            yield
        finally:
            self._tls.stream, self._tls.submit = previous

    @contextmanager
    def host_op_in_stream_order(self):
        """Under a ``torch.cuda``-shaped device module (:func:`follow_current_stream`), a plain torch
        op of a host thread is a kernel on that thread's current stream, as on CUDA: the stream is
        drained first (its queued ops run before it) and the op is that stream's."""
        stream = None
        if _CURRENT_STREAM is not None and getattr(self._tls, "stream", None) is None \
                and not getattr(self._tls, "worker", False) and not getattr(self._tls, "host_declared", False):
            stream = _CURRENT_STREAM()
        if stream is None:
            yield
            return
        stream._drain()
        agent = self.stream_agent(stream)
        self._tls.stream, self._tls.submit = agent, None
        try:
            yield
        finally:
            self._tls.stream = None

    @contextmanager
    def as_host(self):
        previous = (getattr(self._tls, "stream", None), getattr(self._tls, "submit", None),
                    getattr(self._tls, "host_declared", False))
        self._tls.stream, self._tls.submit, self._tls.host_declared = None, None, True
        try:
            yield
        finally:
            self._tls.stream, self._tls.submit, self._tls.host_declared = previous

    def record(self, stream) -> int:
        """``stream`` reached a record: a new snapshot id (one per record, not per event object)."""
        agent = self.stream_agent(stream)
        with self._lock:
            snap = next(self._ids)
            self.sync.create_event(snap)
            self.sync.record_state(snap, agent)
            return self, snap

    def wait(self, stream, snap) -> None:
        if snap is not None and snap[0] is self:  # a record made under another sanitizer orders nothing here
            agent = self.stream_agent(stream)
            with self._lock:
                self.sync.stream_wait_for_event(agent, snap[1])

    def host_wait(self, snap: int | None) -> None:
        """The host observed a record complete (event synchronize / query / stream synchronize)."""
        if snap is not None and snap[0] is self:
            with self._lock:
                self.sync.stream_wait_for_event(self.host_agent(), snap[1])

    def declare(self, name: str, reads, writes) -> None:
        """One opaque op's accesses: ``reads`` / ``writes`` are ``(tensor, rows or None)``."""
        with self.host_op_in_stream_order():
            with self._lock:
                self._drain_freed()
                agent, state, seq, _ = self._agent_for(None, [(t, False) for t, _ in reads])
                self._active.add(agent)
                site = where()
                for (t, rows), write in [*((r, False) for r in reads), *((w, True) for w in writes)]:
                    self._access(t, rows, _Access(0, 0, agent, seq, write, name, site), state)

    # host reads the dispatcher does not see (hicache.sanitizer.host_reads) ------------------------------
    def internal(self) -> bool:
        return getattr(self._tls, "internal", False) or getattr(self._tls, "opaque", False)

    def is_host_memory(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        return is_host(storage.data_ptr(), storage)

    def host_read(self, t: torch.Tensor, name: str) -> None:
        """``t.tolist()`` / ``t.numpy()``: a read of its bytes by the agent that runs it."""
        if not self.internal():
            self.declare(name, [(t, None)], ())

    def to_host(self, copy, blocking: bool) -> torch.Tensor:
        """A D2H copy (``copy()`` makes it: an ``_to_copy`` the dispatch mode sees as a read of the
        source and a write of a fresh buffer by the issuing agent) into pinned host memory; blocking:
        the host is ordered after the issuing stream (not inside a worker's op: no host waits there)."""
        out = copy()
        mark_host_memory(out)
        with self._lock:
            hist = self._storages.get(out.untyped_storage().data_ptr())
            if hist is not None:
                hist.alloc_agent = None  # the pinned host allocator fences its own reuse
            stream = getattr(self._tls, "stream", None)
            if blocking and stream is not None and getattr(self._tls, "submit", None) is None:
                self._join(self.host_agent(), self._state(stream))
        return out

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        with self._lock:
            if tensor.untyped_storage().data_ptr():
                self._history(tensor.untyped_storage())[1].recorded.add(self.stream_agent(stream))

    # accesses ------------------------------------------------------------------------------------
    def parse_inputs(self, func, args, kwargs) -> list[tuple[torch.Tensor, bool]]:
        return op_accesses(func, args, kwargs)

    def on_op(self, func, args, inputs, out, kwargs=None) -> None:
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr() for t, _ in inputs}
        fresh = [] if any(r.alias_info is not None for r in func._schema.returns) else [
            t for t in outputs if t.untyped_storage().data_ptr() not in seen]
        indexed = index_rows(func, args)
        with self._lock:
            self._drain_freed()
            creation = self._device_creation(inputs, fresh, kwargs or {})
            agent, state, seq, host_half = self._creation() if creation else self._agent_for(func, inputs)
            self._active.add(agent)
            op, site = func._schema.name, where()
            host = self.host_agent() if creation else None
            self.ops_checked += 1
            for t in fresh:
                self._allocate(t, agent)
            for t, write in [*inputs, *((t, True) for t in fresh)]:
                rows = indexed[1] if indexed is not None and t is indexed[0] else None
                self._access(t, rows, _Access(0, 0, agent, seq, write, op, site, host), state)

    def _device_creation(self, inputs, fresh, kwargs: dict) -> bool:
        """A factory op (reads no tensor, returns fresh ones) of a host thread outside any stream op
        and outside :func:`host_work`, not into pinned memory: device memory made by the compute
        stream (see the module docstring)."""
        tls = self._tls
        on_host_thread = getattr(tls, "stream", None) is None and not getattr(tls, "worker", False)
        return (bool(fresh) and not inputs and on_host_thread and not getattr(tls, "host_declared", False)
                and not kwargs.get("pin_memory", False))

    def _creation(self) -> tuple[int, dict[int, int], int, bool]:
        """Agent, clock and sequence number of a creation: the compute stream, which the host
        launched it on just now (ordered after the host's past, not the host after it)."""
        agent = self.compute_agent()
        self._join(agent, self._state(self.host_agent()))
        seq = next(self._seq)
        self.sync.update_seq_num(agent, seq)
        return agent, self._state(agent), seq, False

    def created_on_host(self, tensors) -> None:
        """``tensors`` are host memory (:func:`mark_host_memory`): their creation was host work,
        and the pinned host allocator fences their reuse itself."""
        with self._lock:
            for t in tensors:
                key = t.untyped_storage().data_ptr()
                hist = self._storages.get(key)
                owner = hist.storage() if hist is not None and hist.storage is not None else None
                if owner is not None and owner.data_ptr() == key:
                    hist.accesses = [a for a in hist.accesses if a.host is None]
                    if hist.alloc_agent == self._compute:
                        hist.alloc_agent = None

    def _agent_for(self, func, inputs) -> tuple[int, dict[int, int], int, bool]:
        stream = getattr(self._tls, "stream", None)
        if stream is not None:
            storages = [(t.untyped_storage().data_ptr(), t.untyped_storage()) for t, _ in inputs]
            host = [is_host(k, s) for k, s in storages]
            submit = getattr(self._tls, "submit", None)
            dma = func is not None and func in COPIES and (func is torch.ops.aten._to_copy.default or not all(host))
            if any(host) and not dma:  # a host half: runs at submit time, with the host's clock then
                if submit is None:  # inline compute stream: the host runs it now
                    agent = self.host_agent()
                    seq = next(self._seq)
                    self.sync.update_seq_num(agent, seq)
                    return agent, self._state(agent), seq, True
                return submit[0], submit[1], submit[1].get(submit[0], 0), True
            if submit is None:  # the inline compute stream: the host launched this op just now
                self._join(stream, self._state(self.host_agent()))
            seq = next(self._seq)
            self.sync.update_seq_num(stream, seq)
            return stream, self._state(stream), seq, False
        agent = self.host_agent()
        seq = next(self._seq)
        self.sync.update_seq_num(agent, seq)
        return agent, self._state(agent), seq, False

    def _history(self, storage) -> tuple[int, _History]:
        key = storage.data_ptr()
        hist = self._storages.get(key)
        owner = hist.storage() if hist is not None and hist.storage is not None else None
        if owner is None or owner.data_ptr() != key:
            # none; or a freed storage's, whose free has not been drained yet (a worker stream reaches
            # its marker later); or one that moved away (``resize_``, ``share_memory_``): this
            # storage's bytes are new. Whether the dispatcher saw the allocation (:meth:`_allocate`) or
            # not (a list index turned into a tensor, ``from_numpy``), it must not inherit the old
            # block's accesses (on a GPU the two would not even be the same kind of memory). The old
            # history stays with its free for the allocator-reuse check.
            hist = self._storages[key] = _History(storage=weakref.ref(storage))
            weakref.finalize(storage, self._on_free, key, hist)
        return key, hist

    def _allocate(self, t: torch.Tensor, agent: int) -> None:
        storage = t.untyped_storage()
        if not storage.data_ptr():
            return
        # a freed block's history at this address is replaced by :meth:`_history` and stays with its
        # pending free, whose allocator-reuse check still runs (it was cleared here once: a reuse hazard
        # then went unreported whenever the CPU allocator happened to hand the same address back)
        _, hist = self._history(storage)
        hist.alloc_agent = agent

    def _access(self, t: torch.Tensor, rows, acc: _Access, state: dict[int, int]) -> None:
        storage = t.untyped_storage()
        if not storage.data_ptr():
            return
        _, hist = self._history(storage)
        for start, end in byte_ranges(t, rows):
            self._check(hist, dataclasses.replace(acc, start=start, end=end), state)

    def _check(self, hist: _History, acc: _Access, state: dict[int, int]) -> None:
        keep = []
        for prev in hist.accesses:
            overlap = prev.start < acc.end and acc.start < prev.end
            mine = prev.agent == acc.agent or prev.host == acc.agent  # the creating host thread: ordered after
            if overlap and not mine and (acc.write or prev.write) and prev.seq > state.get(prev.agent, 0):
                self._report("write-write" if prev.write and acc.write else "read-write", prev, acc)
            covered = prev.start >= acc.start and prev.end <= acc.end
            if covered and (self._settled(prev) if acc.write else prev.agent == acc.agent and not prev.write
                            and prev.where == acc.where and prev.op == acc.op):
                # no later access can conflict with it without also conflicting with ``acc``; a read from
                # another site is kept, or which sites a later write is reported against would depend on
                # whether it ran before or after the second read
                continue
            keep.append(prev)
        keep.append(acc)
        hist.accesses = keep

    def _settled(self, prev: _Access) -> bool:
        """Every agent that has accessed memory is ordered after ``prev``: keeping it would only
        name a second, earlier site for a conflict that is reported anyway. (Dropping an unsettled
        record instead would make the reported sites depend on how the threads interleaved.)"""
        return all(self._state(a).get(prev.agent, 0) >= prev.seq for a in self._names if a != prev.agent)

    def _report(self, kind: str, prev: _Access, acc: _Access) -> None:
        sites = [Site(self._names[a.agent], a.op, a.write, a.where) for a in (prev, acc)]
        if kind != "allocator-reuse":
            sites.sort(key=lambda site: (site.agent, site.where, site.op, site.write))
        hazard = Hazard(kind, *sites)
        if hazard.key not in self._seen:
            self._seen.add(hazard.key)
            self.hazards.append(hazard)

    # the caching allocator -------------------------------------------------------------------------
    def _on_free(self, key: int, hist: _History) -> None:
        """Finalizer of a storage, run on the thread that dropped the last reference. Later
        allocations on the allocating stream are ordered after: the host's clock at the free (a
        stream worker drops an op's closure when the op ran, a GPU host right after submitting it: the
        op's submit state) and the allocating stream's clock where its queue stood at the free (the
        inline compute stream: now; a worker stream: when it reaches a marker queued now)."""
        try:
            with self._lock:
                if getattr(self._tls, "worker", False):
                    state = dict(getattr(self._tls, "free_state", None) or {})
                else:
                    state = dict(self._state(self.host_agent()))
                alloc = hist.alloc_agent
                stream = self._streams.get(alloc, lambda: None)() if alloc is not None else None
                if alloc in self._inline or stream is None:
                    if alloc in self._inline:
                        self.sync._state_wait_for_other(state, self._state(alloc))
                    self._freed.append((key, hist, state))
                    return
        except (KeyError, AttributeError, TypeError):  # interpreter shutdown
            return

        def reached() -> None:  # on the allocating stream's worker, after everything queued before
            with self._lock:
                self.sync._state_wait_for_other(state, self._state(alloc))
                self._freed.append((key, hist, state))
        stream._queue.put(reached)

    def _drain_freed(self) -> None:
        while self._freed:
            key, hist, state = self._freed.pop()
            if self._storages.get(key) is hist:
                del self._storages[key]
            alloc = hist.alloc_agent
            if alloc is None or self._names[alloc].startswith("host"):
                continue  # host memory is not handed out per stream
            for acc in hist.accesses:
                if acc.agent != alloc and acc.agent not in hist.recorded and acc.seq > state.get(acc.agent, 0):
                    free = _Access(0, 0, alloc, 0, True, "free (reusable by its allocating stream)", acc.where)
                    self._report("allocator-reuse", acc, free)

    # results ---------------------------------------------------------------------------------------
    def by_kind(self) -> dict[str, int]:
        with self._lock:
            self._drain_freed()
            return dict(Counter(h.kind for h in self.hazards))

    def format(self, limit: int = 20) -> str:
        lines = [f"{len(self.hazards)} stream-ordering hazard(s) in {self.ops_checked} ops: {self.by_kind()}"]
        lines += [f"  {i + 1}. {h}" for i, h in enumerate(self.hazards[:limit])]
        return "\n".join(lines)


# module API (no-ops when the sanitizer is off) ------------------------------------------------------
def current() -> Sanitizer | None:
    return _active


def mark_host_memory(*tensors: torch.Tensor) -> None:
    """Declare ``tensors`` host memory (host pools, pinned staging): non-copy ops on them inside a
    stream op are host work at submit time, and their creation was host work, not the compute
    stream's (see the module docstring)."""
    _mark_host_memory(*tensors)
    if _active is not None:
        _active.created_on_host(tensors)


def _declare_launch(op: str, args: tuple, kwargs: dict):
    """The dispatch layer's launch hook: an interpreted Triton launch is an :func:`opaque` op with the
    kernel's own reads and writes (:mod:`hicache.sanitizer.kernel_accesses`), not the interpreter's whole-tensor
    copies in and out."""
    san = _active
    if san is None:
        return nullcontext()
    previous, san._tls.internal = getattr(san._tls, "internal", False), True  # its own reads of the index
    try:
        reads, writes = kernel_accesses.accesses(op, args, kernel_accesses.distinct_rows)
    finally:
        san._tls.internal = previous
    return opaque(f"{op} (Triton, interpreted)", reads=reads, writes=writes)


def enable() -> Sanitizer:
    """Start sanitizing (this process): accesses on this thread and on every stream worker."""
    global _active
    if _active is None:
        _active = Sanitizer()
        _active._enter_mode()
        host_reads.install(current)
        dispatch.set_launch_hook(_declare_launch)  # interpreted Triton launches declare their real accesses
    return _active


def disable() -> Sanitizer | None:
    """Stop sanitizing; returns the sanitizer with its hazards."""
    global _active
    san, _active = _active, None
    host_reads.uninstall()
    dispatch.set_launch_hook(None)
    mode = getattr(san._tls, "mode", None) if san is not None else None
    if mode is not None:
        san._tls.mode = None
        mode.__exit__(None, None, None)
    if san is not None:
        san.by_kind()
    return san


@contextmanager
def sanitized():
    san = enable()
    try:
        yield san
    finally:
        if _active is san:
            disable()


def enabled_by_env() -> bool:
    from lsconfig import envs

    return envs.sanitize()


def enable_from_env() -> Sanitizer | None:
    """``LAYERSPLIT_SANITIZE=1``: enable in this process (command entry points and rank workers)."""
    return enable() if enabled_by_env() else None


@contextmanager
def host_work():
    """Declare the enclosed host-thread work host work (not the compute stream's): building page-id
    tensors and other host-side inputs."""
    san = _active
    if san is None:
        yield
        return
    with san.as_host():
        yield


@contextmanager
def opaque(name: str, reads=(), writes=()):
    """An op whose tensor accesses the dispatch mode cannot see as they are on a GPU (a Triton kernel
    under the interpreter copies whole tensors in and out): its ``reads`` and ``writes``
    (``(tensor, rows along dim 0 or None)``) are declared instead, and the ops inside are ignored."""
    san = _active
    if san is None:
        yield
        return
    san.declare(name, reads, writes)
    san._tls.opaque = True
    try:
        yield
    finally:
        san._tls.opaque = False
