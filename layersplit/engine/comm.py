"""CP collectives on a dedicated comm stream; every call returns the event that guards its result.

All collectives of a rank run on one FIFO stream, so every rank issues them in the same order
(a requirement of gloo and NCCL) while the compute stream goes on. On CPU the comm stream is an
emulated worker thread calling gloo; on CUDA the NCCL calls are queued under the comm stream.
fp8 caches travel as their uint8 page views (gloo has no fp8). With one rank nothing is sent.

Hazards handled here, for every collective:

* **comm reads what compute wrote**: the comm stream first waits on an event recorded on the
  compute stream at issue time, so it never reads a send buffer (``local``, the owner's pool pages)
  or overwrites a receive buffer (a scratch slot) before the compute work queued before the issue;
* **buffers used on two streams stay alive**: send and receive buffers are ``record_stream``-ed on
  the comm stream, so the caching allocator does not hand their memory to the compute stream while
  the collective still reads or writes it.

``unsafe_skip`` ({'compute_wait'}) drops the first edge: for the sanitizer's teeth tests only.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from hicache.streams import Event, Runtime
from layersplit.engine.trace import Tracer

UNSAFE_CHOICES = ("compute_wait", "record_stream")


class CPComm:
    def __init__(self, runtime: Runtime, rank: int, world_size: int, tracer: Tracer,
                 unsafe_skip: frozenset[str] = frozenset()) -> None:
        bad = set(unsafe_skip) - set(UNSAFE_CHOICES)
        if bad:
            raise ValueError(f"unsafe_skip: expected a subset of {UNSAFE_CHOICES}, got {sorted(bad)}")
        self.rt, self.rank, self.world_size, self.tracer = runtime, rank, world_size, tracer
        self.stream = runtime.stream("comm")
        self.compute = runtime.compute_stream()
        self.unsafe_skip = frozenset(unsafe_skip)

    def _issue(self, name: str, after: list[Event], tensors: list[torch.Tensor], **args) -> None:
        self.tracer.instant(f"issue {name}", "compute", **args)
        if "compute_wait" not in self.unsafe_skip:  # hazard: the compute work queued so far comes first
            issued = self.rt.event()
            issued.record(self.compute)
            self.stream.wait_event(issued)
        for event in after:
            self.stream.wait_event(event)
        if "record_stream" not in self.unsafe_skip:  # hazard: no reuse of these while comm uses them
            for t in tensors:
                self.stream.record_stream(t)

    def _done(self, name: str, **args) -> Event:
        self.stream.submit(lambda: self.tracer.instant(f"complete {name}", "comm", **args), name="trace")
        event = self.rt.event()
        event.record(self.stream)
        return event

    def broadcast(self, name: str, src: int, send: Callable[[], torch.Tensor], recv: torch.Tensor | None,
                  after: list[Event] = (), **args) -> Event:
        """Rank ``src`` sends ``send()`` (built on the comm stream, after ``after``); the others
        receive into ``recv`` in place. Returns the event after which ``recv`` is valid (and, on
        ``src``, after which the rows it sent may be overwritten)."""
        self._issue(name, list(after), [recv] if recv is not None else [], **args)

        def run() -> None:
            buf = send() if self.rank == src else recv
            if self.world_size > 1:
                dist.broadcast(buf, src=src)
        self.stream.submit(run, name=name)
        return self._done(name, **args)

    def all_gather(self, name: str, local: torch.Tensor, out: list[torch.Tensor], **args) -> Event:
        """``out[r] = local`` of rank ``r`` (equal shapes); returns the event after which ``out`` is valid."""
        self._issue(name, [], [local, *out], **args)

        def run() -> None:
            if self.world_size > 1:
                dist.all_gather(out, local)
            else:
                out[0].copy_(local)
        self.stream.submit(run, name=name)
        return self._done(name, **args)
