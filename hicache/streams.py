"""Device runtime: streams and events, CUDA or emulated, chosen in one place (:func:`get_runtime`).

All asynchronous work in the project is submitted through this API::

    rt = get_runtime()                       # CUDA if available, else emulated
    load, fwd = rt.stream("load"), rt.stream("forward")
    ready = rt.event()
    load.submit(copy_layer, name="kv[3]")    # runs on the load stream
    ready.record(load)
    fwd.wait_event(ready)                    # the forward stream blocks, the host does not
    fwd.submit(attention)
    fwd.synchronize()                        # raises the first error raised on the stream

Emulated streams: one worker thread per stream runs submitted callables in FIFO order. Torch ops
release the GIL, so two emulated streams really run concurrently and a missing wait really races.
CUDA streams: ``submit`` runs the callable now on the host under ``torch.cuda.stream(s)``, so the
kernels it launches are queued on that stream.

Semantics follow CUDA: ``wait_event`` waits for the event's most recent ``record`` at the time of
the call; waiting on (or querying) a never-recorded event is a no-op (ready).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

DelayHook = Callable[[str, str], float]  # (stream name, op name) -> seconds to stall before the op


class _Marker:
    """One ``record`` of an emulated event: set when the stream reaches it."""

    __slots__ = ("done", "stream")

    def __init__(self, stream: "EmulatedStream") -> None:
        self.done = threading.Event()
        self.stream = stream


class EmulatedEvent:
    def __init__(self) -> None:
        self._marker: _Marker | None = None

    def record(self, stream: "EmulatedStream") -> None:
        marker = _Marker(stream)
        self._marker = marker
        stream._put(marker.done.set, "record")

    def query(self) -> bool:
        marker = self._marker
        return marker is None or marker.done.is_set()

    def synchronize(self) -> None:
        marker = self._marker
        if marker is not None:
            marker.done.wait()
            marker.stream._raise_pending()


class EmulatedStream:
    def __init__(self, name: str, runtime: "EmulatedRuntime") -> None:
        self.name = name
        self._runtime = runtime
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._run, name=f"stream-{name}", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced at the next synchronize
                if self._error is None:
                    self._error = exc

    def _put(self, fn: Callable[[], None], name: str) -> None:
        delay = self._runtime.delay_hook(self.name, name) if self._runtime.delay_hook else 0.0
        if delay > 0:
            self._queue.put(lambda: time.sleep(delay))
        self._queue.put(fn)

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"stream '{self.name}': an operation failed: {exc!r}") from exc

    def submit(self, fn: Callable[[], object], name: str = "op") -> None:
        """Run ``fn()`` on this stream after everything submitted before it."""
        self._put(fn, name)

    def wait_event(self, event: EmulatedEvent) -> None:
        """Later work on this stream waits for the event's latest record; the host does not block."""
        marker = event._marker
        if marker is not None and marker.stream is not self:
            self._put(marker.done.wait, "wait_event")

    def synchronize(self) -> None:
        """Block the host until all submitted work ran; raise the first error it raised."""
        done = threading.Event()
        self._queue.put(done.set)
        done.wait()
        self._raise_pending()

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._queue.put(None)
        self._worker.join()


class EmulatedRuntime:
    kind = "emulated"

    def __init__(self) -> None:
        self.delay_hook: DelayHook | None = None
        self.device = torch.device("cpu")
        self._streams: dict[str, EmulatedStream] = {}

    def stream(self, name: str) -> EmulatedStream:
        """The stream called ``name`` (created on first use)."""
        if name not in self._streams:
            self._streams[name] = EmulatedStream(name, self)
        return self._streams[name]

    def event(self) -> EmulatedEvent:
        return EmulatedEvent()

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()


class CudaEvent:
    def __init__(self) -> None:
        self._event = torch.cuda.Event()

    def record(self, stream: "CudaStream") -> None:
        self._event.record(stream.raw)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class CudaStream:
    def __init__(self, name: str, runtime: "CudaRuntime") -> None:
        self.name = name
        self._runtime = runtime
        self.raw = torch.cuda.Stream(device=runtime.device)

    def submit(self, fn: Callable[[], object], name: str = "op") -> None:
        delay = self._runtime.delay_hook(self.name, name) if self._runtime.delay_hook else 0.0
        with torch.cuda.stream(self.raw):
            if delay > 0:
                torch.cuda._sleep(int(delay * self._runtime.sleep_cycles_per_s))
            fn()

    def wait_event(self, event: CudaEvent) -> None:
        self.raw.wait_event(event._event)

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaRuntime:
    kind = "cuda"

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.delay_hook: DelayHook | None = None
        # torch.cuda._sleep spins for a number of clock cycles; ~1.5e9 cycles/s is an H100/H200-class
        # SM clock (delays only need the right order of magnitude)
        self.sleep_cycles_per_s = 1.5e9
        self._streams: dict[str, CudaStream] = {}

    def stream(self, name: str) -> CudaStream:
        if name not in self._streams:
            self._streams[name] = CudaStream(name, self)
        return self._streams[name]

    def event(self) -> CudaEvent:
        return CudaEvent()

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


Runtime = EmulatedRuntime | CudaRuntime
Stream = EmulatedStream | CudaStream
Event = EmulatedEvent | CudaEvent


def get_runtime(kind: str = "auto") -> Runtime:
    """``auto``: CUDA streams where CUDA is available, else emulated streams."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "emulated"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("runtime: expected CUDA for kind='cuda', got no CUDA device")
        return CudaRuntime()
    if kind == "emulated":
        return EmulatedRuntime()
    raise ValueError(f"runtime: expected 'auto', 'cuda' or 'emulated', got {kind!r}")
