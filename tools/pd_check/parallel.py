"""One breadth-first level expanded by worker processes: the frontier split into spans, each span expanded
in a forked child, the results handed back in span order.

Why fork, and a fresh pool per level: a worker must see the search as it stood when the level began —
the fingerprints of every state no deeper than the level (the duplicate check and the partial-order
reduction's cycle proviso read them) and the frontier's pickled states — and forking gives it exactly
that snapshot without sending any of it (copy-on-write pages). Nothing a worker changes flows back but
its return value; the parent merges the spans in order, so a level's outcome does not depend on how
the spans were dealt out. Levels number a few dozen, so the cost of a fork per level is small beside a
level's work (seconds to minutes).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Callable, Iterator

_SPAN_JOB: list[Callable[[int, int], object]] = []  # the level's job, set before the fork, read in the children


def resolve_workers(workers: int | str) -> int:
    """``workers`` as a count: an integer >= 1, or ``"auto"`` (the CPUs this process may run on)."""
    if workers == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: expected an integer >= 1 or 'auto', got {workers!r}")
    return workers


def spans(n: int, workers: int, per_worker: int = 8, most: int = 512) -> list[tuple[int, int]]:
    """[start, end) slices of ``range(n)``: about ``per_worker`` per worker (so a slow span does not idle
    the others), at most ``most`` states each (so a stop by time or state count is not far behind)."""
    size = max(1, min(most, -(-n // (workers * per_worker))))
    return [(i, min(n, i + size)) for i in range(0, n, size)]


def map_spans(job: Callable[[int, int], object], n: int, workers: int) -> Iterator[object]:
    """``job(start, end)`` over :func:`spans` of ``range(n)``, in order; in ``workers`` forked processes
    when there are more than one (and more than one span), else here. Closing the iterator early (a
    violation, a stop) terminates the workers."""
    parts = spans(n, workers)
    if workers == 1 or len(parts) == 1:
        for start, end in parts:
            yield job(start, end)
        return
    _SPAN_JOB[:] = [job]
    pool = multiprocessing.get_context("fork").Pool(min(workers, len(parts)), initializer=_worker_signals)
    try:
        yield from pool.imap(_run_span, parts)
    finally:
        pool.terminate()
        pool.join()
        _SPAN_JOB.clear()


def _worker_signals() -> None:
    """A worker leaves Ctrl-C to the parent (which then ends the pool) and dies quietly when it is ended;
    it would otherwise inherit the CLI's handlers, which turn both into exceptions."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_span(part: tuple[int, int]) -> object:
    return _SPAN_JOB[0](*part)
