"""The protocol's assumptions about the data plane, measured on Mooncake's TCP transport between two
real processes (issue 28, item 4). Each probe returns plain numbers; the verdicts are the tests'.

The watcher is this process: it maps decode's page buffer (shared memory) and takes per-page CRC32
snapshots, so it sees every byte that lands — after the engine reported the batch, after the writer
is dead, after decode deregistered the buffer — whether or not decode is running.

    (a) ``after_complete``: does any byte land after ``get_batch_transfer_status`` returned 0?
    (a') ``after_timeout``: and after it gave up (-1, Mooncake's transfer timeout) on a stalled decode?
    (b) ``after_kill``: once the writer is SIGKILLed and reaped, can its bytes still land? For how long?
    (c) ``after_deregister``: a write aimed at memory decode has deregistered (or re-registered).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from contextlib import contextmanager

from tools.pd_real.engine import POISON, Pages
from tools.pd_real.peers import decode_peer, prefill_peer

CTX = mp.get_context("spawn")
STEP_S = 10.0  # longest wait for one answer of a peer


def _answer(conn, what: str):
    if not conn.poll(STEP_S):
        raise TimeoutError(f"no answer from the {what} peer within {STEP_S} s")
    return conn.recv()


@contextmanager
def peer(target, *args):
    """A spawned peer process and the parent's end of its pipe; killed (SIGKILL) if still alive after."""
    here, there = CTX.Pipe()
    proc = CTX.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    try:
        yield proc, here
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(STEP_S)


@contextmanager
def decode_pages(count: int, page_bytes: int):
    """Poisoned pages, and a decode peer that registered them: yields (pages, proc, conn, session, addr)."""
    pages = Pages.create(count, page_bytes)
    try:
        with peer(decode_peer, pages.name, count, page_bytes) as (proc, conn):
            session, addr = _answer(conn, "decode")
            yield pages, proc, conn, session, addr
    finally:
        pages.close()


def unread_bytes(pid: int) -> int:
    """Bytes waiting in the receive queues of ``pid``'s TCP sockets (the kernel's, from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    total += int(fields[4].split(":")[1], 16)
    return total


def _wait_unread(pid: int, nbytes: int, timeout_s: float = STEP_S) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := unread_bytes(pid)) < nbytes and time.monotonic() < deadline:
        time.sleep(0.005)
    return n


def watch(pages: Pages, before: list[int], seconds: float, poll_s: float = 0.002) -> dict:
    """Snapshot every ``poll_s`` for ``seconds``: which pages differ from ``before`` and when each last changed."""
    start, last = time.monotonic(), list(before)
    changed_at: dict[int, float] = {}
    while time.monotonic() - start < seconds:
        now = pages.checksums()
        for i, (a, b) in enumerate(zip(last, now)):
            if a != b:
                changed_at[i] = time.monotonic() - start
        last = now
        time.sleep(poll_s)
    return {"pages_changed": len(changed_at), "last_change_s": max(changed_at.values(), default=None),
            "final": last}


def _landed(pages: Pages, value: int) -> int:
    """Pages holding ``value`` in every byte."""
    return int((pages.array == value).all(axis=1).sum())


def after_complete(rounds: int = 5, count: int = 64, page_bytes: int = 64 << 10, watch_s: float = 0.5) -> dict:
    """(a) Each round a new value into every page; at the completion report: pages not yet complete,
    then bytes changing in the next ``watch_s``."""
    out = {"rounds": rounds, "status": [], "incomplete_at_report": [], "changed_after_report": []}
    with decode_pages(count, page_bytes) as (pages, _, _, session, addr):
        dsts = [addr + i * page_bytes for i in range(count)]
        for r in range(rounds):
            value = 1 + r  # never POISON
            with peer(prefill_peer, session, page_bytes, value) as (_, conn):
                _answer(conn, "prefill")
                conn.send(("write", dsts))
                _answer(conn, "prefill")  # submitted
                _, rc, _ = _answer(conn, "prefill")
                at_report = pages.checksums()
                out["status"].append(rc)
                out["incomplete_at_report"].append(count - _landed(pages, value))
                out["changed_after_report"].append(watch(pages, at_report, watch_s)["pages_changed"])
    return out


def after_kill(count: int = 1024, page_bytes: int = 64 << 10, stall_s: float = 1.0, watch_s: float = 1.0,
               stall_decode: bool = True, kill_after_s: float = 0.2, fence: bool = False) -> dict:
    """(b) The writer posts ``count`` pages and is SIGKILLed once it reported the batch submitted;
    after it is reaped, the pages are snapshot and watched. With ``stall_decode`` decode is SIGSTOPped
    before the batch and continued ``stall_s`` after the writer's death (a decode paused by GC, swap or
    a debugger), and the writer dies once decode's sockets hold at least a page of unread bytes: those
    arrive then. Without the stall, the writer dies ``kill_after_s`` after the submission.

    ``fence`` (with the stall): decode's first act on resuming is to deregister its pages (the
    command is queued before SIGCONT); the pages are snapshot when it answered and watched after."""
    value = 0x5A
    if fence and not stall_decode:
        raise ValueError("after_kill: fence=True needs stall_decode=True")
    with decode_pages(count + 1, page_bytes) as (pages, dproc, dconn, session, addr):
        dsts = [addr + i * page_bytes for i in range(count)]
        warm = [addr + count * page_bytes]  # the last page: the handshake and connection, before the stall
        with peer(prefill_peer, session, page_bytes, value) as (wproc, conn):
            _answer(conn, "prefill")
            conn.send(("sync", warm))
            _, warm_rc, _ = _answer(conn, "prefill")
            if stall_decode:
                os.kill(dproc.pid, signal.SIGSTOP)
            conn.send(("write", dsts))
            _answer(conn, "prefill")  # submitted
            if stall_decode:  # the kill waits until decode's kernel holds a page of bytes it has not read
                unread = _wait_unread(dproc.pid, page_bytes)
            else:
                unread = None
                time.sleep(kill_after_s)  # the writer's engine pushes bytes meanwhile
            os.kill(wproc.pid, signal.SIGKILL)
            wproc.join(STEP_S)
            assert wproc.exitcode == -signal.SIGKILL, wproc.exitcode
            at_death = pages.checksums()[:count]
            landed_at_death = int((pages.array[:count] == value).all(axis=1).sum())
            fenced = None
            if stall_decode:
                time.sleep(stall_s)
                if fence:
                    dconn.send("deregister")
                os.kill(dproc.pid, signal.SIGCONT)
                if fence:
                    dereg_rc = _answer(dconn, "decode")
                    at_fence = pages.checksums()[:count]
                    after = watch(pages, at_fence + [0], watch_s)
                    fenced = {"deregister_rc": dereg_rc,
                              "pages_changed_before_fence": sum(a != b for a, b in zip(at_death, at_fence)),
                              "pages_changed_after_fence": after["pages_changed"] - 1}
            late = watch(pages, at_death + [0], watch_s)  # index ``count`` (warm page) excluded below
        written = pages.array[:count] != POISON
        return {"warm_status": warm_rc, "pages": count, "unread_bytes_at_kill": unread,
                "landed_at_death": landed_at_death,
                "pages_changed_after_death": late["pages_changed"] - 1,  # the warm page's fake snapshot
                "last_change_s_after_death": late["last_change_s"] + (stall_s if stall_decode else 0.0)
                if late["pages_changed"] > 1 else None,
                "bytes_written_total": int(written.sum()), "stalled_s": stall_s if stall_decode else 0.0,
                "fence": fenced}


def after_deregister(count: int = 16, page_bytes: int = 64 << 10, reregister: bool = False,
                     watch_s: float = 0.5) -> dict:
    """(c) Decode deregisters its pages (and, with ``reregister``, registers the same range again, as
    for another request); then a writer aims a batch at them. Returns the engine codes, the pages
    that changed, and whether decode is still alive."""
    value = 0x3C
    with decode_pages(count, page_bytes) as (pages, dproc, dconn, session, addr):
        dconn.send("deregister")
        dereg_rc = _answer(dconn, "decode")
        rereg_rc = None
        if reregister:
            dconn.send("register")
            rereg_rc = _answer(dconn, "decode")
        before = pages.checksums()
        dsts = [addr + i * page_bytes for i in range(count)]
        with peer(prefill_peer, session, page_bytes, value) as (_, conn):
            _answer(conn, "prefill")
            conn.send(("write", dsts))
            _answer(conn, "prefill")
            _, rc, _ = _answer(conn, "prefill")
            seen = watch(pages, before, watch_s)
        alive = dproc.is_alive()
        return {"deregister_rc": dereg_rc, "reregister_rc": rereg_rc, "write_status": rc,
                "pages_changed": seen["pages_changed"], "landed": _landed(pages, value), "decode_alive": alive}


@contextmanager
def transfer_timeout(seconds: int):
    """Mooncake's ``MC_TRANSFER_TIMEOUT`` for the engines created inside (its binding reads it then)."""
    saved = os.environ.get("MC_TRANSFER_TIMEOUT")
    os.environ["MC_TRANSFER_TIMEOUT"] = str(seconds)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MC_TRANSFER_TIMEOUT")
        else:
            os.environ["MC_TRANSFER_TIMEOUT"] = saved


def after_timeout(count: int = 256, page_bytes: int = 64 << 10, timeout_s: int = 5, watch_s: float = 1.0) -> dict:
    """(a') Decode is SIGSTOPped while this process (the writer, transfer timeout ``timeout_s``) waits on
    a batch of ``count`` pages: the status gives up after the timeout; decode is continued and its
    pages watched. A second wait on the same batch is timed too."""
    from tools.pd_real.engine import fill, open_engine, register

    value = 0x66
    with decode_pages(count + 1, page_bytes) as (pages, dproc, _, session, addr):
        with transfer_timeout(timeout_s):
            engine, _ = open_engine()
        source = fill(page_bytes * count, value)
        register(engine, source.ctypes.data, source.nbytes)
        warm = engine.batch_transfer_sync_write(session, [source.ctypes.data], [addr + count * page_bytes],
                                                [page_bytes])
        os.kill(dproc.pid, signal.SIGSTOP)
        start = time.monotonic()
        handle = engine.batch_transfer_async_write(session, [source.ctypes.data + i * page_bytes for i in range(count)],
                                                   [addr + i * page_bytes for i in range(count)], [page_bytes] * count)
        rc = engine.get_batch_transfer_status([handle])
        waited = time.monotonic() - start
        at_report = pages.checksums()
        landed_at_report = _landed(pages, value) - 1  # the warm page
        again = time.monotonic()
        rc_again = engine.get_batch_transfer_status([handle])
        again = time.monotonic() - again
        os.kill(dproc.pid, signal.SIGCONT)
        late = watch(pages, at_report, watch_s)
        return {"warm_status": warm, "status": rc, "waited_s": round(waited, 3), "pages": count,
                "landed_at_report": landed_at_report, "second_status": rc_again, "second_wait_s": round(again, 3),
                "pages_changed_after_report": late["pages_changed"], "landed_in_the_end": _landed(pages, value) - 1}
