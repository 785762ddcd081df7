"""Timeline of one rank in Chrome trace-event JSON (open in chrome://tracing or Perfetto).

Spans (``ph: X``) for compute (indexer, attention, MLP per layer) and waits; instants (``ph: i``)
for broadcast issue and completion. ``pid`` is the rank, ``tid`` the thread ('compute' or 'comm').
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    def __init__(self, rank: int, enabled: bool = True) -> None:
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []
        self._t0 = time.perf_counter_ns()

    def _now_us(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1e3

    def instant(self, name: str, tid: str, **args) -> None:
        if self.enabled:  # list.append is atomic: the comm thread may call this concurrently
            self.events.append({"name": name, "ph": "i", "ts": self._now_us(), "pid": self.rank, "tid": tid,
                                "s": "t", "args": args})

    @contextmanager
    def span(self, name: str, tid: str = "compute", **args):
        start = self._now_us()
        try:
            yield
        finally:
            if self.enabled:
                self.events.append({"name": name, "ph": "X", "ts": start, "dur": self._now_us() - start,
                                    "pid": self.rank, "tid": tid, "args": args})


def write_trace(path: str | Path, events: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
