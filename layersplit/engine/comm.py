"""CP collectives on comm streams; every call returns the event that guards its result.

Two **channels**, each a FIFO stream with its own communicator:

* ``main`` (stream ``comm``, the default process group): the new rows' all-gather and the
  indexer-key broadcast — what the indexer waits for;
* ``kv`` (stream ``comm_kv``, a second process group made once per process by :func:`kv_group`):
  the MLA KV broadcast, which only sparse attention waits for.

Why two: one FIFO stream (or one NCCL communicator, whose collectives run in issue order on its own
internal stream) would queue layer ``l``'s all-gather behind layer ``l``'s KV broadcast, so the
indexer, which needs the all-gather, would wait for the KV broadcast too: nothing would overlap.
Upstream SGLang's layer split also gives its broadcast stream a dedicated NCCL communicator. Each
communicator sees its collectives in the same order on every rank (the engine issues them in program
order), which is what gloo and NCCL require; the two never share one. (On CUDA, with
``CUDA_DEVICE_MAX_CONNECTIONS=1``, as Megatron-style launchers set, every stream shares one hardware
queue and the all-gather can sit behind the KV broadcast there: leave it unset for the overlap.) With ``channels=1`` (the
``legacy`` schedule) both names map to the one ``comm`` stream and group.

On CPU each stream is an emulated worker thread calling gloo; on CUDA the collectives are queued
under the stream (NCCL runs them after the stream's queued work and the stream waits for them).
fp8 caches travel as their uint8 page views (gloo has no fp8). With one rank nothing is sent.

**Transports.** The collective itself is a pluggable transport (:class:`DistTransport`, the default:
``torch.distributed``; :class:`LoopbackTransport`: one process that plays one rank, for timing the
schedule on one device). ``CPComm`` keeps the streams, events and hazards, the same for every
transport; the transport is asked, at issue time on the host, for the op the stream then runs
(``broadcast(...) -> op(data)``, ``all_gather(...) -> op()``), so it may stage buffers on the compute
stream before the comm stream's issue-time wait (below) orders them. Both are in this file.

Hazards handled here, for every collective:

* **comm reads what compute wrote**: the comm stream first waits on an event recorded on the
  compute stream at issue time, so it never reads a send buffer (``local``, the owner's pool pages)
  or overwrites a receive buffer (a scratch slot) before the compute work queued before the issue;
* **buffers used on two streams stay alive**: send and receive buffers are ``record_stream``-ed on
  the comm stream, so the caching allocator does not hand their memory to the compute stream while
  the collective still reads or writes it;
* **the sender's rows may change after the send**: a broadcast also returns the event after which
  its source was copied into the send buffer (``Sent.source_read``): a writer of those rows on another
  stream waits for it (the owner's new rows go into the last prefix page its KV broadcast sends).

``unsafe_skip`` ({'compute_wait', 'record_stream'}) drops the first two: for the sanitizer's teeth tests only.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from hicache.runtime.streams import Event, Runtime
from layersplit.engine.trace import Tracer

UNSAFE_CHOICES = ("compute_wait", "record_stream")
CHANNEL_STREAMS = {"main": "comm", "kv": "comm_kv"}

_KV_GROUP: list = []  # [(the default group it was made under, the second communicator)]


def kv_group():
    """The KV channel's process group: made on first use, by every rank at the same point of its
    program (engine construction; ``new_group`` is collective), and reused by every later engine of
    the process while the same default group lives (a re-initialized one gets a new KV group)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if not _KV_GROUP or _KV_GROUP[0][0] is not world:
        _KV_GROUP[:] = [(world, dist.new_group(ranks=list(range(dist.get_world_size()))))]
    return _KV_GROUP[0][1]


class Sent(NamedTuple):
    done: Event  # the receive buffer is valid (receivers) / the collective finished (sender)
    source_read: Event  # the sender's source rows were copied out: they may be overwritten now


# transports: asked on the host at issue time (compute stream current), they return the stream's op ------
class DistTransport:
    """``torch.distributed`` collectives (gloo on CPU; NCCL or gloo on CUDA): rank and size are the
    process group's."""

    def bind(self, rank: int, world_size: int) -> None:
        """Nothing to keep: the process group already knows this rank and the world size."""

    def group(self, channel: str):
        return kv_group() if channel == "kv" else None  # None: the default group

    def broadcast(self, channel: str, src: int, recv: torch.Tensor | None, group) -> Callable[[torch.Tensor], None]:
        return lambda data: dist.broadcast(data, src=src, group=group)

    def all_gather(self, local: torch.Tensor, out: list[torch.Tensor]) -> Callable[[], None]:
        return lambda: dist.all_gather(out, local)


class Link(NamedTuple):
    """A link's model: an op moving ``nbytes`` takes ``latency_s + nbytes / bytes_per_s``."""
    bytes_per_s: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s  # bytes_per_s inf: an instant link


class LoopbackTransport:
    """One process plays rank ``r`` of ``world_size`` (set by :meth:`bind`): no peer, no process group.

    A receive writes the right number of bytes into the receive buffer with an asynchronous device copy
    from a zero buffer of the same shape and dtype (made once, on the compute stream, at the first
    issue); an all-gather fills the other ranks' outputs likewise and copies ``local`` into this rank's.
    Then the op occupies its stream for ``links[channel].seconds(bytes)`` through ``sleep(seconds)``,
    which the caller supplies (emulated: ``time.sleep`` on the stream's worker thread; CUDA:
    ``torch.cuda._sleep``, queued on the stream); a sender occupies its stream for its bytes too.
    The peers' rows are zeros, so **hidden states are not meaningful, only timing is**. Every op is
    logged as ``(channel, kind, nbytes, seconds)`` (``kind``: send / recv / gather).

    Hazard: the zero sources are read on the comm streams and never freed while a prefill runs (each
    ends with ``CPComm.synchronize``); keep the transport alive until its streams are synchronized.
    """

    def __init__(self, links: dict[str, Link], sleep: Callable[[float], None]) -> None:
        missing = {"main", "kv"} - set(links)
        if missing:
            raise ValueError(f"links: expected a Link for channels 'main' and 'kv', missing {sorted(missing)}")
        self.links, self.sleep = dict(links), sleep
        self.rank, self.world_size = 0, 1
        self.log: list[tuple[str, str, int, float]] = []  # appended on stream threads (list.append is atomic)
        self._sources: dict[tuple, torch.Tensor] = {}

    def bind(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def group(self, channel: str):
        return None

    def _source(self, like: torch.Tensor) -> torch.Tensor:
        """Zeros shaped like ``like``, made once per shape (on the host's current stream: compute)."""
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._sources:
            self._sources[key] = torch.zeros_like(like)
        return self._sources[key]

    def _occupy(self, channel: str, kind: str, nbytes: int) -> None:
        seconds = self.links[channel].seconds(nbytes)
        self.log.append((channel, kind, nbytes, seconds))
        self.sleep(seconds)

    def broadcast(self, channel: str, src: int, recv: torch.Tensor | None, group) -> Callable[[torch.Tensor], None]:
        source = self._source(recv) if recv is not None else None

        def op(data: torch.Tensor) -> None:
            if source is not None:  # comm-stream work into the receive buffer, as the collective's write
                data.copy_(source, non_blocking=True)
            self._occupy(channel, "send" if source is None else "recv", data.nbytes)
        return op

    def all_gather(self, local: torch.Tensor, out: list[torch.Tensor]) -> Callable[[], None]:
        source = self._source(local)

        def op() -> None:
            for r, o in enumerate(out):
                o.copy_(local if r == self.rank else source, non_blocking=True)
            self._occupy("main", "gather", local.nbytes * (self.world_size - 1))
        return op


class CPComm:
    def __init__(self, runtime: Runtime, rank: int, world_size: int, tracer: Tracer,
                 unsafe_skip: frozenset[str] = frozenset(), channels: int = 2, transport=None) -> None:
        bad = set(unsafe_skip) - set(UNSAFE_CHOICES)
        if bad:
            raise ValueError(f"unsafe_skip: expected a subset of {UNSAFE_CHOICES}, got {sorted(bad)}")
        if channels not in (1, 2):
            raise ValueError(f"channels: expected 1 (legacy: one FIFO) or 2, got {channels!r}")
        self.rt, self.rank, self.world_size, self.tracer = runtime, rank, world_size, tracer
        self.transport = transport if transport is not None else DistTransport()
        self.transport.bind(rank, world_size)
        self.compute = runtime.compute_stream()
        self.unsafe_skip = frozenset(unsafe_skip)
        main = runtime.stream("comm")
        self.streams = {"main": main, "kv": runtime.stream("comm_kv") if channels == 2 else main}
        # the owner packs its KV send buffer on a stream of its own: queued behind the KV channel's
        # earlier broadcasts (which wait for every receiver), the owner's write of its new rows would
        # wait for them too; behind other packs only, it waits for a gather of its own pages
        self._pack = runtime.stream("comm_kv_pack") if channels == 2 else None
        self._groups = {"main": None, "kv": self.transport.group("kv") if channels == 2 and world_size > 1 else None}

    @property
    def stream(self):
        return self.streams["main"]

    def synchronize(self) -> None:
        for stream in {id(s): s for s in [*self.streams.values(), self._pack] if s is not None}.values():
            stream.synchronize()

    def _issue(self, name: str, stream, after: list[Event], tensors: list[torch.Tensor], **args) -> None:
        self.tracer.instant(f"issue {name}", "compute", **args)
        if "compute_wait" not in self.unsafe_skip:  # hazard: the compute work queued so far comes first
            issued = self.rt.event()
            issued.record(self.compute)
            stream.wait_event(issued)
        for event in after:
            stream.wait_event(event)
        if "record_stream" not in self.unsafe_skip:  # hazard: no reuse of these while comm uses them
            for t in tensors:
                stream.record_stream(t)

    def _done(self, name: str, channel: str, **args) -> Event:
        stream = self.streams[channel]
        self.tracer.stream_instant(f"complete {name}", stream, stream.name, **args)
        event = self.rt.event()
        event.record(stream)
        mark = getattr(self.rt, "mark", None)  # a happens-before-tracking runtime names this point
        if mark is not None:
            mark(f"complete {name}", stream)
        return event

    def broadcast(self, name: str, src: int, send: Callable[[], torch.Tensor], recv: torch.Tensor | None,
                  after: list[Event] = (), channel: str = "main", **args) -> Sent:
        """Rank ``src`` sends ``send()`` (built on the channel's stream, after ``after``); the others
        receive into ``recv`` in place."""
        stream = self.streams[channel]
        # planned before ``_issue``: a transport's staging buffers, made on compute, precede the issue-time wait
        collective = self.transport.broadcast(channel, src, recv, self._groups[channel]) if self.world_size > 1 else None
        buf: list[torch.Tensor] = []
        read = self.rt.event()
        if self.rank == src and channel == "kv" and self._pack is not None:
            self._issue(name, self._pack, list(after), [], **args)  # after compute's writes and the load

            def pack() -> None:
                packed = send()
                stream.record_stream(packed)  # hazard: made on the pack stream, read by the KV stream
                buf.append(packed)
            self._pack.submit(pack, name=f"pack {name}")
            read.record(self._pack)
            stream.wait_event(read)
        else:
            self._issue(name, stream, list(after), [recv] if recv is not None else [], **args)
            if self.rank == src:  # the send buffer is built on the stream, in order with the rows' writers
                stream.submit(lambda: buf.append(send()), name=f"pack {name}")
            read.record(stream)

        def run() -> None:
            data = buf.pop() if self.rank == src else recv
            if collective is not None:
                collective(data)
        stream.submit(run, name=name)
        return Sent(self._done(name, channel, **args), read)

    def all_gather(self, name: str, local: torch.Tensor, out: list[torch.Tensor], **args) -> Event:
        """``out[r] = local`` of rank ``r`` (equal shapes); returns the event after which ``out`` is valid."""
        collective = self.transport.all_gather(local, out) if self.world_size > 1 else None  # before the wait
        self._issue(name, self.stream, [], [local, *out], **args)

        def run() -> None:
            if collective is not None:
                collective()
            else:
                out[0].copy_(local)
        self.stream.submit(run, name=name)
        return self._done(name, "main", **args)
