"""What the plug-in pool did in this prefill worker, for an operator: Prometheus counters and gauges.

Exported through prometheus_client where it is installed (an SGLang dependency: SGLang's metrics
exporter collects every process's prometheus_client metrics through ``PROMETHEUS_MULTIPROC_DIR``), and
always readable as exposition text from :meth:`PoolMetrics.to_prometheus`:

* ``layersplit_broadcast_bytes_total{part}``: bytes this rank entered into layer broadcasts, by part
  (``kv`` rows, ``index_prefix`` pages staged one layer ahead, ``index_new`` pages on the indexer's
  critical path);
* ``layersplit_forward_wait_seconds_total{on}`` and ``layersplit_forward_waits_total{on}``: the forward
  stream's waits on a staged broadcast (``broadcast``) and on HiCache loads (``index_ready``: the
  indexer's keys; ``kv_ready``: the whole layer). Seconds are host time spent in the wait call: with
  the emulated streams (CPU) the forward stream *is* the host thread, so that is the stall; on CUDA a
  wait is queued on the stream and the host does not block, so there it counts ~0 and the count is
  the signal (device-side stall needs a timeline, e.g. ``layersplit prefill --trace``);
* ``layersplit_admission_deferrals_total{why}``: requests the admission hook held for a later batch
  because the batch's de-duplicated pages would outgrow a staging slot (``why="slot"``; the slots are
  allocated once at start-up and never grow);
* ``layersplit_kv_pool_tokens{layout}``: tokens the pool holds (``plugin``) and what upstream's
  layer-split layout would hold in the same bytes (``upstream``: its pool-sized landing layer on top).
"""

from __future__ import annotations

import time
from collections import Counter

_PROM: dict = {}

METRICS = (
    ("broadcast_bytes", "layersplit_broadcast_bytes_total", "counter", "part",
     "Bytes this rank entered into layer broadcasts, by part."),
    ("wait_seconds", "layersplit_forward_wait_seconds_total", "counter", "on",
     "Host seconds the forward stream spent waiting, by what it waited on."),
    ("waits", "layersplit_forward_waits_total", "counter", "on",
     "Waits of the forward stream, by what it waited on."),
    ("deferred", "layersplit_admission_deferrals_total", "counter", "why",
     "Requests held for a later batch so that the batch's pages fit a staging slot."),
    ("pool_tokens", "layersplit_kv_pool_tokens", "gauge", "layout",
     "KV tokens the pool holds (plugin) and what upstream's layout would hold in the same bytes."),
)
LABELS = {"broadcast_bytes": ("kv", "index_prefix", "index_new"),
          "wait_seconds": ("broadcast", "index_ready", "kv_ready"), "waits": ("broadcast", "index_ready", "kv_ready"), "deferred": ("slot",),
          "pool_tokens": ("plugin", "upstream")}


class PoolMetrics:
    """This process's plug-in metrics (one set per worker process; see the module docstring)."""

    def __init__(self) -> None:
        self.values: dict[str, Counter] = {key: Counter() for key, *_ in METRICS}
        self._prom: dict | None = None

    def bind_prometheus(self) -> bool:
        """Mirror into prometheus_client metrics; False where it is not installed."""
        try:
            import prometheus_client
        except ImportError:
            return False
        if not _PROM:  # one set per process: prometheus_client refuses a metric name twice
            for key, name, kind, label, doc in METRICS:
                cls = prometheus_client.Counter if kind == "counter" else prometheus_client.Gauge
                _PROM[key] = cls(name.removesuffix("_total") if kind == "counter" else name, doc, [label])
        self._prom = _PROM
        return True

    def add(self, key: str, label: str, amount: float) -> None:
        self.values[key][label] += amount
        if self._prom:
            self._prom[key].labels(label).inc(amount)

    def set(self, key: str, label: str, value: float) -> None:
        self.values[key][label] = value
        if self._prom:
            self._prom[key].labels(label).set(value)

    def timed_wait(self, on: str, wait) -> None:
        """Run ``wait()`` (a stream wait) and count it under ``on``."""
        start = time.perf_counter()
        wait()
        self.add("wait_seconds", on, time.perf_counter() - start)
        self.add("waits", on, 1)

    def to_prometheus(self) -> str:
        """Exposition text, zeros included."""
        lines = []
        for key, name, kind, label, doc in METRICS:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{{label}="{value}"}} {self.values[key][value]:g}' for value in LABELS[key]]
        return "\n".join(lines) + "\n"


_shared: PoolMetrics | None = None


def shared() -> PoolMetrics:
    """The process's metrics (bound to prometheus_client where installed)."""
    global _shared
    if _shared is None:
        _shared = PoolMetrics()
        _shared.bind_prometheus()
    return _shared
