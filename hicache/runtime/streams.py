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

The **compute stream** (``rt.compute_stream()``) is where the host thread's own tensor work runs:
on CUDA the current stream; emulated, an :class:`InlineStream` whose ops the host thread runs
inside ``with compute.active():``. Its ``wait_event`` blocks the host on CPU, but it orders only the
compute stream, as on a GPU. Under the stream sanitizer (:mod:`hicache.sanitizer`) every op,
record, wait and synchronize here feeds the happens-before clocks at the moment the stream reaches it.
The CUDA runtime does not feed it (CSAN, ``TORCH_CUDA_SANITIZER=1``, is the GPU's sanitizer): making
a CUDA runtime, or giving its streams work, while the sanitizer is on raises (:data:`BLIND_SANITIZER`).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch

from hicache import sanitizer
from hicache.runtime import syncs

DelayHook = Callable[[str, str], float]  # (stream name, op name) -> seconds to stall before the op


class _Marker:
    """One ``record`` of an emulated event: set when the stream reaches it."""

    __slots__ = ("done", "stream", "snap", "time")

    def __init__(self, stream: "EmulatedStream | InlineStream") -> None:
        self.done = threading.Event()
        self.stream = stream
        self.snap: int | None = None  # the sanitizer's snapshot of the stream's clock at this record
        self.time = 0.0

    def reach(self) -> None:
        """The stream reached this record."""
        san = sanitizer.current()
        if san is not None:
            self.snap = san.record(self.stream)
        self.time = time.perf_counter()
        self.done.set()

    def observed(self) -> None:
        """The host saw this record complete (synchronize, or a query that returned True)."""
        san = sanitizer.current()
        if san is not None:
            san.host_wait(self.snap)


class EmulatedEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self._marker: _Marker | None = None

    def record(self, stream: "EmulatedStream | InlineStream") -> None:
        marker = _Marker(stream)
        self._marker = marker
        stream._record(marker)

    def query(self) -> bool:
        marker = self._marker
        if marker is None:
            return True
        if marker.done.is_set():
            marker.observed()
            return True
        return False

    def synchronize(self) -> None:
        marker = self._marker
        if marker is not None:
            marker.done.wait()
            marker.observed()
            marker.stream._raise_pending()

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        """Milliseconds between this record and ``end``'s (both completed), like ``torch.cuda.Event``."""
        assert self._marker is not None and end._marker is not None, "elapsed_time: both events must be recorded"
        return (end._marker.time - self._marker.time) * 1e3


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
            fn = None  # drop the op's closure (and the tensors it holds) before waiting for the next

    def _put(self, fn: Callable[[], None], name: str) -> None:
        delay = self._runtime.delay_hook(self.name, name) if self._runtime.delay_hook else 0.0
        if delay > 0:
            self._queue.put(lambda: time.sleep(delay))
        san = sanitizer.current()
        if san is not None:  # the op carries the submitting host's clock; accesses are this stream's
            submit, op = san.submit_state(), fn
            fn = lambda: san.run_op(self, submit, op)  # noqa: E731
        guard = syncs.current()
        if guard is not None:  # a host sync inside a stream op blocks the host that submits it on a GPU
            counted = fn
            fn = lambda: guard.run_op(counted)  # noqa: E731
        self._queue.put(fn)

    def _record(self, marker: _Marker) -> None:
        self._put(marker.reach, "record")

    def _drain(self) -> None:
        """Block until everything queued so far ran (no happens-before edge: the sanitizer's own use)."""
        done = threading.Event()
        self._queue.put(done.set)
        done.wait()

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
            def wait() -> None:
                marker.done.wait()
                san = sanitizer.current()
                if san is not None:
                    san.wait(self, marker.snap)
            self._put(wait, "wait_event")

    def synchronize(self) -> None:
        """Block the host until all submitted work ran; raise the first error it raised."""
        marker = _Marker(self)
        self._record(marker)
        marker.done.wait()
        marker.observed()
        self._raise_pending()

    def record_stream(self, tensor: torch.Tensor) -> None:
        """``tensor``'s memory is not reused before this stream's work queued so far (CUDA's
        ``Tensor.record_stream``); emulated, a declaration to the sanitizer."""
        san = sanitizer.current()
        if san is not None:
            san.record_stream(tensor, self)

    def close(self) -> None:
        """Finish queued work and stop the worker thread."""
        self._queue.put(None)
        self._worker.join()


class InlineStream:
    """The emulated **compute stream**: the host thread runs its ops as it reaches them (in
    :meth:`active`), so they complete in program order; ``wait_event`` blocks the host until the
    event completed. For the sanitizer these ops belong to the stream, not to the host: an event the
    compute stream waited for orders the compute stream only, as on a GPU, where the host runs ahead.
    """

    is_compute = True  # the sanitizer books every compute stream (and device tensor creation) as one agent

    def __init__(self, name: str, runtime: "EmulatedRuntime") -> None:
        self.name = name
        self._runtime = runtime

    def _record(self, marker: _Marker) -> None:
        marker.reach()

    def _raise_pending(self) -> None:
        pass  # its ops raise on the host at once

    @contextmanager
    def active(self):
        san = sanitizer.current()
        if san is None:
            yield
        else:
            with san.acting_as(self):
                yield

    def submit(self, fn: Callable[[], object], name: str = "op") -> None:
        with self.active():
            fn()

    def wait_event(self, event: EmulatedEvent) -> None:
        marker = event._marker
        if marker is None or marker.stream is self:
            return
        marker.done.wait()
        marker.stream._raise_pending()
        san = sanitizer.current()
        if san is not None:
            san.wait(self, marker.snap)

    def synchronize(self) -> None:
        marker = _Marker(self)
        marker.reach()
        marker.observed()

    def record_stream(self, tensor: torch.Tensor) -> None:
        san = sanitizer.current()
        if san is not None:
            san.record_stream(tensor, self)


class EmulatedRuntime:
    kind = "emulated"
    pin_memory = False  # host staging memory is pinned only where an accelerator exists

    def __init__(self) -> None:
        self.delay_hook: DelayHook | None = None
        self.device = torch.device("cpu")
        self._streams: dict[str, EmulatedStream] = {}
        self._compute: InlineStream | None = None

    def stream(self, name: str) -> EmulatedStream:
        """The stream called ``name`` (created on first use)."""
        if name not in self._streams:
            self._streams[name] = EmulatedStream(name, self)
        return self._streams[name]

    def compute_stream(self) -> InlineStream:
        """The stream the host thread's own tensor work runs on (its ops inside ``active()``)."""
        if self._compute is None:
            self._compute = InlineStream("compute", self)
        return self._compute

    def event(self, enable_timing: bool = False) -> EmulatedEvent:
        return EmulatedEvent(enable_timing)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()


BLIND_SANITIZER = ("LAYERSPLIT_SANITIZE=1: the stream sanitizer models the emulated runtime only; got a CUDA "
                   "runtime, whose streams and events never feed it (it would report 0 hazards having seen none) "
                   "- run on the emulated runtime (a CPU), or use PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1)")


def refuse_blind_sanitizer() -> None:
    """Raise if the stream sanitizer is on: it cannot see CUDA streams, so it must never say "clean"
    about a CUDA run. Called where the CUDA runtime is made and where its streams take work."""
    if sanitizer.current() is not None:
        raise ValueError(BLIND_SANITIZER)


class CudaEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self._event = torch.cuda.Event(enable_timing=enable_timing)

    def record(self, stream: "CudaStream") -> None:
        refuse_blind_sanitizer()  # a sanitizer enabled after the runtime was made
        self._event.record(stream.raw)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end: "CudaEvent") -> float:
        return self._event.elapsed_time(end._event)


class CudaStream:
    def __init__(self, name: str, runtime: "CudaRuntime", raw: "torch.cuda.Stream | None" = None) -> None:
        self.name = name
        self._runtime = runtime
        self.raw = raw if raw is not None else torch.cuda.Stream(device=runtime.device)

    @contextmanager
    def active(self):
        with torch.cuda.stream(self.raw):
            yield

    def submit(self, fn: Callable[[], object], name: str = "op") -> None:
        refuse_blind_sanitizer()  # a sanitizer enabled after the runtime was made
        delay = self._runtime.delay_hook(self.name, name) if self._runtime.delay_hook else 0.0
        with torch.cuda.stream(self.raw):
            if delay > 0:
                torch.cuda._sleep(int(delay * self._runtime.sleep_cycles_per_s))
            fn()

    def wait_event(self, event: CudaEvent) -> None:
        self.raw.wait_event(event._event)

    def record_stream(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.raw)

    def synchronize(self) -> None:
        self.raw.synchronize()


class CudaRuntime:
    kind = "cuda"
    pin_memory = True  # pinned host memory: H2D / D2H copies with non_blocking=True are asynchronous

    def __init__(self, device: int | None = None) -> None:
        refuse_blind_sanitizer()  # before any CUDA work: LAYERSPLIT_SANITIZE=1 must not pass a CUDA run
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

    def compute_stream(self) -> CudaStream:
        """The device's current stream (where the host's own kernels are queued)."""
        if "compute" not in self._streams:
            self._streams["compute"] = CudaStream("compute", self, torch.cuda.current_stream(self.device))
        return self._streams["compute"]

    def event(self, enable_timing: bool = False) -> CudaEvent:
        return CudaEvent(enable_timing)

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


Runtime = EmulatedRuntime | CudaRuntime
Stream = EmulatedStream | InlineStream | CudaStream
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
