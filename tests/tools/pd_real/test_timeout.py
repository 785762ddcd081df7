"""(a') Mooncake's status gives up — not the batch. Decode is stalled past the writer's transfer timeout
(``MC_TRANSFER_TIMEOUT=5``): ``get_batch_transfer_status`` returns -1 while the batch still runs, and its
bytes land after the report. So the adapter reports such a batch failed and keeps it in flight (its
request's abort is never acknowledged; the process must die); with the guard off
(``unsafe_quiesce_on_timeout``) the batch quiesces — an ack would vouch — while its bytes still land."""

from __future__ import annotations

import os
import signal

import pytest

from layersplit.pd.abort.prefill_kv import PrefillKV, SourceRead
from tools.pd_real import probes
from tools.pd_real.wall_loop import WallLoop
from layersplit.pd.abort.transfer_engine import WriteTag

pytestmark = pytest.mark.timeout(90)
PAGES, PAGE_BYTES = 256, 64 << 10


@pytest.mark.slow
def test_a_timed_out_status_is_not_the_end_of_the_batch():
    r = probes.after_timeout(count=PAGES, page_bytes=PAGE_BYTES, timeout_s=5, watch_s=1.0)
    assert r["warm_status"] == 0 and r["status"] < 0 and r["waited_s"] >= 5.0, r
    assert r["landed_at_report"] < PAGES and r["pages_changed_after_report"] > 0, r  # landed after the report
    assert r["second_status"] < 0 and r["second_wait_s"] < 1.0, r  # and no second wait says when it ends


@pytest.mark.parametrize("unsafe", [False, True], ids=["guarded", "UNSAFE-quiesce-on-timeout"])
@pytest.mark.slow
def test_the_adapter_keeps_a_timed_out_batch_in_flight(unsafe):
    from tools.pd_real.engine import open_engine
    from tools.pd_real.mooncake_engine import DecodeLayout, MooncakeEngine

    with probes.decode_pages(PAGES, PAGE_BYTES) as (pages, dproc, _, session, addr):
        loop, events, timeouts = WallLoop(), [], []
        layout = DecodeLayout(0, session, (addr,), PAGES, PAGE_BYTES)
        with probes.transfer_timeout(5):  # the binding and the adapter both read it when they are made
            raw, _ = open_engine()
            engine = MooncakeEngine(loop, raw, lambda life: layout, PAGES + 1, PAGE_BYTES,
                                    on_timeout=timeouts.append, unsafe_quiesce_on_timeout=unsafe)
        kv = PrefillKV(PAGES + 1)
        warm = kv.alloc(1, room=0)  # the handshake and the connection, before the stall
        engine.post([(0, (0,))], [WriteTag(0, 0, 0)], [SourceRead(kv, warm[0], kv.tags(warm)[0])],
                    lambda b, status: events.append(status), lambda b: events.append("quiesced"), owner=0)
        loop.run(until=loop.now + 10, stop=lambda: "quiesced" in events)
        assert events == ["done", "quiesced"]
        events.clear()
        sources = kv.alloc(PAGES, room=1)
        os.kill(dproc.pid, signal.SIGSTOP)
        engine.post([(p, (0,)) for p in range(PAGES)], [WriteTag(1, 1 + p, 0) for p in range(PAGES)],
                    [SourceRead(kv, p, t) for p, t in zip(sources, kv.tags(sources))],
                    lambda b, status: events.append(status), lambda b: events.append("quiesced"), owner=0)
        loop.run(until=loop.now + 15, stop=lambda: bool(events) and (timeouts or "quiesced" in events))
        at_report = pages.checksums()
        os.kill(dproc.pid, signal.SIGCONT)
        changed = probes.watch(pages, at_report, 1.0)["pages_changed"]
        engine.close()
    assert changed > 0, (events, engine.stats)  # the batch's bytes landed after Mooncake reported it
    if unsafe:
        assert events == ["failed", "quiesced"] and not timeouts  # quiesced: the failure the guard closes
    else:
        assert events == ["failed"] and timeouts == [1] and engine.stats["timeouts"] == 1  # batch 1 (0: warm)
        assert engine.in_flight(lambda owner: True) == 1  # never quiesced: no ack can vouch for it
