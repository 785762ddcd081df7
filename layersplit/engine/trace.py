"""Timeline of one rank in Chrome trace-event JSON (open in chrome://tracing or Perfetto).

Spans (``ph: X``) for compute (indexer, attention, MLP per layer) and waits; instants (``ph: i``)
for broadcast issue and completion. ``pid`` is the rank, ``tid`` the stream ('compute', 'comm',
'comm_kv').

Timestamps are **stream time**, taken with timing events recorded on the stream itself
(:meth:`Tracer.stream_span`, :meth:`Tracer.stream_instant`) and placed on the host clock by
:meth:`Tracer.resolve` against one origin event: on CUDA the host only queues work, so a host clock
would stamp a collective's completion at its issue. On the emulated runtime stream time is the
time the stream reached the record (the host thread, for the compute stream). ``issue`` instants
are host time (when the host queued the collective). A span's host-side time is kept in
``args.host_ts`` / ``args.host_dur``.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    def __init__(self, rank: int, enabled: bool = True, runtime=None) -> None:
        self.rank, self.enabled, self.rt = rank, enabled, runtime
        self.events: list[dict] = []
        self._t0 = time.perf_counter_ns()
        self._pending: list[tuple[dict, object, object | None]] = []  # (entry, start event, end event)
        self._origin: tuple[object, float] | None = None

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1e3

    def start(self, stream) -> None:
        """Record the origin of stream time on ``stream`` (the compute stream, before any traced work)."""
        if self.enabled and self.rt is not None:
            origin = self.rt.event(enable_timing=True)
            origin.record(stream)
            self._origin = (origin, self._now_us())

    def instant(self, name: str, tid: str, **args) -> None:
        """A host-time instant (e.g. the host queuing a collective)."""
        if self.enabled:  # list.append is atomic
            self.events.append({"name": name, "ph": "i", "ts": self._now_us(), "pid": self.rank, "tid": tid,
                                "s": "t", "args": args})

    def stream_instant(self, name: str, stream, tid: str, **args) -> None:
        """An instant at the point ``stream`` reaches now in its program (resolved later)."""
        if not self.enabled or self._origin is None:
            return
        event = self.rt.event(enable_timing=True)
        event.record(stream)
        entry = {"name": name, "ph": "i", "ts": None, "pid": self.rank, "tid": tid, "s": "t", "args": args}
        self.events.append(entry)
        self._pending.append((entry, event, None))

    @contextmanager
    def span(self, name: str, tid: str = "compute", stream=None, **args):
        """A span of the work issued inside; with ``stream`` its time is that stream's (resolved later)."""
        if not self.enabled:
            yield
            return
        timed = stream is not None and self._origin is not None
        if timed:
            start_ev = self.rt.event(enable_timing=True)
            start_ev.record(stream)
        start = self._now_us()
        try:
            yield
        finally:
            entry = {"name": name, "ph": "X", "ts": start, "dur": self._now_us() - start, "pid": self.rank,
                     "tid": tid, "args": args}
            self.events.append(entry)
            if timed:
                end_ev = self.rt.event(enable_timing=True)
                end_ev.record(stream)
                self._pending.append((entry, start_ev, end_ev))

    def resolve(self) -> None:
        """Stamp every stream-timed entry (call after the streams it used were synchronized)."""
        if self._origin is None:
            return
        origin, origin_us = self._origin
        for entry, start, end in self._pending:
            ts = origin_us + origin.elapsed_time(start) * 1e3
            if entry["ph"] == "X":
                entry["args"].update(host_ts=entry["ts"], host_dur=entry["dur"])
                entry["dur"] = start.elapsed_time(end) * 1e3
            entry["ts"] = ts
        self._pending.clear()


def write_trace(path: str | Path, events: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
