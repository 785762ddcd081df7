"""The happens-before order of the work issued through a runtime, as vector clocks (an exported stream DAG).

``HBRuntime(rt)`` wraps any runtime of :mod:`hicache.runtime.streams` (CUDA or emulated) and forwards every
call; beside it, it keeps what the issued program *orders*, independent of timing::

    hb = HBRuntime(get_runtime())
    comm, compute = hb.stream("comm"), hb.compute_stream()
    comm.submit(send, name="bcast"); done = hb.event(); done.record(comm)
    hb.mark(done_label := "complete bcast", comm)      # a point on comm's program
    compute.wait_event(done)
    hb.mark("attention", compute)
    assert hb.ordered("complete bcast", "attention")    # attention cannot start before it

Rules (CUDA's): each stream's operations are ordered in issue order (FIFO); ``record`` snapshots the
recording stream's clock; ``wait_event`` joins the event's *latest* record at the time of the call
into the waiting stream; a host synchronize (event, stream) joins into the host, and every later
submission carries the host's clock. A point ``a`` happens before ``b`` iff ``clock(b)[s] >=
clock(a)[s]`` for ``a``'s stream ``s``. The order is that of the *program*, so it is the same on every
run and on every device: it says what a consumer waits for, whatever the machine's speed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class HappensBefore:
    """Vector clocks per agent (a stream or the host) and named marks."""

    def __init__(self) -> None:
        self._clock: dict[str, dict[str, int]] = {"host": {"host": 0}}
        self._lock = threading.Lock()
        self.marks: dict[str, tuple[str, dict[str, int]]] = {}

    def _issue(self, agent: str, tick: bool) -> dict[str, int]:
        """``agent``'s clock as the host issues something to it (an op ticks it; a record, a wait or
        a mark is a point between ops and does not)."""
        clock = self._clock.setdefault(agent, {agent: 0})
        for k, v in self._clock["host"].items():  # the host issued this: everything it knew comes first
            clock[k] = max(clock.get(k, 0), v)
        if tick:
            clock[agent] += 1
        return clock

    def op(self, agent: str) -> None:
        with self._lock:
            self._issue(agent, tick=True)

    def snapshot(self, agent: str) -> dict[str, int]:
        with self._lock:
            return dict(self._issue(agent, tick=False))

    def join(self, agent: str, other: dict[str, int] | None) -> None:
        if other is None:  # a never-recorded event orders nothing (CUDA: waiting on it is a no-op)
            return
        with self._lock:
            clock = self._issue(agent, tick=False)
            for k, v in other.items():
                clock[k] = max(clock.get(k, 0), v)

    def mark(self, label: str, agent: str) -> None:
        """Name the current point of ``agent``'s program: after the ops issued there so far."""
        self.marks[label] = (agent, self.snapshot(agent))

    def ordered(self, before: str, after: str) -> bool:
        """Whether mark ``before`` happens before mark ``after`` in the issued program."""
        (agent, a), (_, b) = self.marks[before], self.marks[after]
        return b.get(agent, 0) >= a[agent]  # b has seen every op of ``agent`` that came before ``a``


class HBEvent:
    def __init__(self, hb: HappensBefore, raw) -> None:
        self._hb, self.raw, self._clock = hb, raw, None

    def record(self, stream: "HBStream") -> None:
        self.raw.record(stream.raw)
        self._clock = self._hb.snapshot(stream.agent)

    def query(self) -> bool:
        done = self.raw.query()
        if done:
            self._hb.join("host", self._clock)
        return done

    def synchronize(self) -> None:
        self.raw.synchronize()
        self._hb.join("host", self._clock)

    def elapsed_time(self, end: "HBEvent") -> float:
        return self.raw.elapsed_time(end.raw)


class HBStream:
    def __init__(self, hb: HappensBefore, raw, agent: str) -> None:
        self._hb, self.raw, self.agent = hb, raw, agent
        self.name = raw.name

    def submit(self, fn, name: str = "op") -> None:
        self._hb.op(self.agent)
        self.raw.submit(fn, name=name)

    def wait_event(self, event: HBEvent) -> None:
        self._hb.join(self.agent, event._clock)
        self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()
        self._hb.join("host", self._hb.snapshot(self.agent))

    def record_stream(self, tensor) -> None:
        self.raw.record_stream(tensor)

    @contextmanager
    def active(self):
        with self.raw.active():
            yield

    def __getattr__(self, name: str):  # anything else (e.g. a CUDA stream's own methods) goes to the stream
        return getattr(self.raw, name)


class HBRuntime:
    """A runtime whose streams and events feed a :class:`HappensBefore` (``.hb``) as they are used."""

    def __init__(self, runtime) -> None:
        self.raw, self.hb = runtime, HappensBefore()
        self._streams: dict[str, HBStream] = {}

    def stream(self, name: str) -> HBStream:
        if name not in self._streams:
            self._streams[name] = HBStream(self.hb, self.raw.stream(name), name)
        return self._streams[name]

    def compute_stream(self) -> HBStream:
        if "compute" not in self._streams:
            self._streams["compute"] = HBStream(self.hb, self.raw.compute_stream(), "compute")
        return self._streams["compute"]

    def event(self, enable_timing: bool = False) -> HBEvent:
        return HBEvent(self.hb, self.raw.event(enable_timing=enable_timing))

    def mark(self, label: str, stream: HBStream) -> None:
        self.hb.mark(label, stream.agent)

    def ordered(self, before: str, after: str) -> bool:
        return self.hb.ordered(before, after)

    def close(self) -> None:
        self.raw.close()

    @property
    def delay_hook(self):
        return self.raw.delay_hook

    @delay_hook.setter
    def delay_hook(self, hook) -> None:
        self.raw.delay_hook = hook

    def __getattr__(self, name: str):  # device, kind, sleep_cycles_per_s, ...
        return getattr(self.raw, name)
