"""CP collectives on a dedicated comm stream; every call returns the event that guards its result.

All collectives of a rank run on one FIFO stream, so every rank issues them in the same order
(a requirement of gloo and NCCL) while the compute thread goes on. On CPU the comm stream is an
emulated worker thread calling gloo; on CUDA the NCCL calls are queued under the comm stream.
fp8 caches travel as their uint8 page views (gloo has no fp8). With one rank nothing is sent.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from hicache.streams import Event, Runtime
from layersplit.trace import Tracer


class CPComm:
    def __init__(self, runtime: Runtime, rank: int, world_size: int, tracer: Tracer) -> None:
        self.rt, self.rank, self.world_size, self.tracer = runtime, rank, world_size, tracer
        self.stream = runtime.stream("comm")

    def _done(self, name: str, **args) -> Event:
        self.stream.submit(lambda: self.tracer.instant(f"complete {name}", "comm", **args), name="trace")
        event = self.rt.event()
        event.record(self.stream)
        return event

    def broadcast(self, name: str, src: int, send: Callable[[], torch.Tensor], recv: torch.Tensor,
                  after: list[Event] = (), **args) -> Event:
        """Rank ``src`` sends ``send()`` (built on the comm stream, after ``after``); the others
        receive into ``recv`` in place. Returns the event after which ``recv`` is valid."""
        self.tracer.instant(f"issue {name}", "compute", **args)
        for event in after:
            self.stream.wait_event(event)

        def run() -> None:
            buf = send() if self.rank == src else recv
            if self.world_size > 1:
                dist.broadcast(buf, src=src)
        self.stream.submit(run, name=name)
        return self._done(name, **args)

    def all_gather(self, name: str, local: torch.Tensor, out: list[torch.Tensor], **args) -> Event:
        """``out[r] = local`` of rank ``r`` (equal shapes); returns the event after which ``out`` is valid."""
        self.tracer.instant(f"issue {name}", "compute", **args)

        def run() -> None:
            if self.world_size > 1:
                dist.all_gather(out, local)
            else:
                out[0].copy_(local)
        self.stream.submit(run, name=name)
        return self._done(name, **args)
