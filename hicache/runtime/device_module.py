"""A ``torch.cuda``-shaped view of the emulated stream runtime, so stream code written against a
device module (``Stream()``, ``Event()``, ``current_stream()``, ``with stream(s):``) runs on CPU with
real asynchrony.

Work is queued on a stream only through :meth:`EmulatedDeviceModule.launch` (on CUDA, a kernel
launched under ``torch.cuda.stream(s)`` is queued the same way); plain torch calls made by the host
run at once. Code that wants to run on both calls ``getattr(device_module, "launch", None)`` and
falls back to calling the function directly.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

from hicache import sanitizer
from hicache.runtime.streams import EmulatedEvent, EmulatedRuntime, EmulatedStream


class DeviceStream:
    def __init__(self, raw: EmulatedStream, module: "EmulatedDeviceModule") -> None:
        self.raw = raw
        self._module = module

    def wait_event(self, event: "DeviceEvent") -> None:
        self.raw.wait_event(event.raw)

    def wait_stream(self, other: "DeviceStream") -> None:
        marker = EmulatedEvent()
        marker.record(other.raw)
        self.raw.wait_event(marker)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        marker = EmulatedEvent()
        marker.record(self.raw)
        return marker.query()


class DeviceEvent:
    def __init__(self, module: "EmulatedDeviceModule", **_: object) -> None:  # enable_timing etc.: ignored
        self.raw = EmulatedEvent()
        self._module = module

    def record(self, stream: DeviceStream | None = None) -> None:
        self.raw.record((stream or self._module.current_stream()).raw)

    def wait(self, stream: DeviceStream | None = None) -> None:
        (stream or self._module.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self.raw.query()

    def synchronize(self) -> None:
        self.raw.synchronize()


class EmulatedDeviceModule:
    """``Stream``/``Event``/``current_stream``/``stream`` over one :class:`EmulatedRuntime`; the
    current stream is per host thread and defaults to the runtime's ``forward`` stream."""

    def __init__(self, runtime: EmulatedRuntime | None = None) -> None:
        self.runtime = runtime or EmulatedRuntime()
        self._default = DeviceStream(self.runtime.stream("forward"), self)
        self._local = threading.local()
        self._count = 0
        self._lock = threading.Lock()
        # for the sanitizer: a host thread's plain torch ops are kernels on its current stream (CUDA)
        sanitizer.follow_current_stream(lambda: self.current_stream().raw)

    def Stream(self, *_, **__) -> DeviceStream:  # noqa: N802 - torch.cuda's spelling
        with self._lock:
            self._count += 1
            name = f"stream{self._count}"
        return DeviceStream(self.runtime.stream(name), self)

    def Event(self, **kwargs) -> DeviceEvent:  # noqa: N802
        return DeviceEvent(self, **kwargs)

    def current_stream(self, *_) -> DeviceStream:
        return getattr(self._local, "stream", None) or self._default

    @contextmanager
    def stream(self, stream: DeviceStream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def launch(self, fn: Callable[[], object], name: str = "op") -> None:
        """Queue ``fn`` on the current stream (what launching a kernel does on CUDA)."""
        self.current_stream().raw.submit(fn, name)

    def synchronize(self, *_) -> None:
        for stream in list(self.runtime._streams.values()):
            stream.synchronize()

    def close(self) -> None:
        sanitizer.follow_current_stream(None)
        self.runtime.close()
