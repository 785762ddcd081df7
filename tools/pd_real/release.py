"""Release after a prefill writer's death, on real memory, checked by the landing checker.

Decode (stalled by SIGSTOP, as a GC pause or swap would) holds a dead writer's bytes in its kernel
socket buffers. Decode then releases the request's pages — poisons them and watches them:

- ``legacy``: released as soon as the writer is known dead (the immediate release);
- ``fenced``: decode first deregisters its pages (the fence), and releases once that returned.

The landing checker reports released pages a late write changed, and whose tag that write carried.
"""

from __future__ import annotations

import os
import signal
import time

from tools.pd_real.landing import ReleasedWatch, check, owner
from tools.pd_real.peers import prefill_peer
from tools.pd_real.probes import STEP_S, _answer, _wait_unread, decode_pages, peer
from layersplit.pd.abort.transfer_engine import WriteTag

MODES = ("legacy", "fenced")


def release_after_death(mode: str, count: int = 512, page_bytes: int = 64 << 10, stall_s: float = 0.5,
                        watch_s: float = 1.0) -> dict:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    tags = [WriteTag(room=7, generation=1 + i, life=0) for i in range(count)]
    warm_tag = WriteTag(room=6, generation=0, life=0)
    with decode_pages(count + 1, page_bytes) as (pages, dproc, dconn, session, addr):
        dsts = [addr + i * page_bytes for i in range(count)]
        with peer(prefill_peer, session, page_bytes, 0) as (wproc, conn):
            _answer(conn, "prefill")
            conn.send(("stamped", [addr + count * page_bytes], [warm_tag]))
            _answer(conn, "prefill")
            _, warm_rc, _ = _answer(conn, "prefill")
            warm_ok = check(pages.array[count], warm_tag) == "ok"  # a page read back whole
            os.kill(dproc.pid, signal.SIGSTOP)
            conn.send(("stamped", dsts, tags))
            _answer(conn, "prefill")
            unread = _wait_unread(dproc.pid, page_bytes)
            os.kill(wproc.pid, signal.SIGKILL)
            wproc.join(STEP_S)
        array = pages.array
        watch = ReleasedWatch(array)
        time.sleep(stall_s)
        start = time.monotonic()
        if mode == "legacy":
            watch.release(list(range(count)))
            os.kill(dproc.pid, signal.SIGCONT)
            dereg_rc = None
        else:
            dconn.send("deregister")
            os.kill(dproc.pid, signal.SIGCONT)
            dereg_rc = _answer(dconn, "decode")
            watch.release(list(range(count)))
        release_s = time.monotonic() - start  # decode resumes -> pages released
        time.sleep(watch_s)
        late = watch.late()
        owners = [owner(array[i]) for i in late]
        out = {"mode": mode, "warm_status": warm_rc, "warm_page_ok": warm_ok, "unread_bytes_at_kill": unread,
               "deregister_rc": dereg_rc, "released": count, "late_writes": len(late),
               "late_owners": sorted({t.room for t in owners if t is not None}),
               "late_torn": sum(t is None for t in owners), "resume_to_release_s": release_s}
        del array, watch
        return out
