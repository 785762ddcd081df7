"""The transfer-engine adapter on Mooncake, in one process (two engines on loopback TCP): posts land
whole and stamped, statuses and quiescence reach the protocol's callbacks on the loop's thread, and the
fence is by address — a deregistered region refuses, a re-admitted one lands again. Also the wall-clock
loop and the landing checker on decode's pages."""

from __future__ import annotations

import os

import numpy as np
import pytest

from layersplit.pd.abort.prefill_kv import PrefillKV, SourceRead
from tools.pd_real.engine import POISON
from tools.pd_real.landing import check, stamp
from tools.pd_real.wall_loop import WallLoop
from layersplit.pd.abort.transfer_engine import WriteTag

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pair():
    from tools.pd_real.engine import open_engine
    from tools.pd_real.mooncake_engine import DecodeMemory, MooncakeEngine

    decode_engine, session = open_engine()
    memory = DecodeMemory(decode_engine, session, 0, 8, 4096, ((0,), (1, 2)))
    loop = WallLoop()
    prefill_engine, _ = open_engine()
    engine = MooncakeEngine(loop, prefill_engine, lambda life: memory.layout() if life == 0 else None, 8, 4096)
    yield memory, loop, engine
    engine.close()


def _post(engine, loop, kv, writes, owner):
    """Post ``writes`` = [(decode page, layers, tag)]; run the loop until the batch quiesced."""
    sources = kv.alloc(len(writes), room=1)
    events = []
    batch = engine.post([(page, layers) for page, layers, _ in writes], [tag for *_, tag in writes],
                        [SourceRead(kv, p, t) for p, t in zip(sources, kv.tags(sources))],
                        lambda b, status: events.append(status), lambda b: events.append("quiesced"), owner=owner)
    loop.run(until=loop.now + 10, stop=lambda: "quiesced" in events)
    kv.free(sources, kv.tags(sources))
    return batch, events


def test_a_batch_lands_stamped_in_the_layers_of_its_rank(pair):
    memory, loop, engine = pair
    tags = [WriteTag(7, 1, 0), WriteTag(7, 2, 0)]
    batch, events = _post(engine, loop, PrefillKV(8), [(3, (1, 2), tags[0]), (4, (1, 2), tags[1])], owner=0)
    assert events == ["done", "quiesced"] and engine.poll(batch) == "done"
    for layer in (1, 2):
        assert [check(memory.layers[layer][p], t) for p, t in ((3, tags[0]), (4, tags[1]))] == ["ok", "ok"]
    assert (memory.layers[0] == POISON).all()  # rank 0's layer: untouched
    assert engine.in_flight(lambda owner: True) == 0


def test_the_fence_is_by_address_deregistered_refuses_readmitted_lands(pair):
    memory, loop, engine = pair
    kv, tag = PrefillKV(8), WriteTag(8, 1, 0)
    memory.fence(1, incarnation=0)
    _, events = _post(engine, loop, kv, [(5, (1, 2), tag)], owner=1)  # a *new* writer: refused all the same
    assert events == ["failed", "quiesced"]
    assert (memory.layers[1][5] == POISON).all() and (memory.layers[2][5] == POISON).all()
    memory.readmit(1, incarnation=1)
    _, events = _post(engine, loop, kv, [(5, (1, 2), tag)], owner=1)
    assert events == ["done", "quiesced"] and check(memory.layers[2][5], tag) == "ok"
    with pytest.raises(AssertionError, match="was fenced"):
        memory.readmit(1, incarnation=0)


def test_when_drained_waits_for_the_owners_batches_and_fenced_owners_post_nothing(pair):
    _, loop, engine = pair
    kv = PrefillKV(8)
    woke = []
    engine.when_drained(lambda owner: owner == 0, lambda: woke.append("now"))
    assert woke == ["now"]  # nothing in flight
    engine.fence(5)
    _, events = _post(engine, loop, kv, [(6, (0,), WriteTag(9, 1, 0))], owner=5)
    assert events == ["failed", "quiesced"] and engine.stats["fenced_refused"] == 1


def test_a_life_without_a_layout_fails_the_batch_without_sending(pair):
    _, loop, engine = pair
    before = engine.stats["post_failures"]
    _, events = _post(engine, loop, PrefillKV(8), [(1, (0,), WriteTag(9, 2, life=4))], owner=100)
    assert events == ["failed", "quiesced"] and engine.stats["post_failures"] == before + 1


def test_the_wall_loop_fires_timers_in_order_and_drains_a_source():
    loop = WallLoop()
    fired, r, w = [], *os.pipe()
    loop.after(0.02, fired.append, "b")
    loop.after(0.01, fired.append, "a")
    loop.after(0.01, fired.append, "a2")  # same deadline: FIFO
    loop.add_source(r, lambda: (os.read(r, 64), fired.append("pipe"))[0].__len__())
    loop.after(0.005, os.write, w, b"x")
    loop.run(until=loop.now + 1, stop=lambda: len(fired) == 4)
    assert fired == ["pipe", "a", "a2", "b"]
    with pytest.raises(AssertionError, match="delay must be >= 0"):
        loop.after(-1, fired.append, "x")


class _Memory:
    def __init__(self, pages: int, page_bytes: int, layers: int) -> None:
        self.num_pages, self.layers = pages, [np.full((pages, page_bytes), POISON, np.uint8) for _ in range(layers)]


def test_the_landing_checker_on_decode_pages():
    from tools.pd_real.landing_kv import RealDecodeKV

    memory = _Memory(4, 64, 2)
    kv = RealDecodeKV(memory, 2, life=0)
    pages = kv.alloc(2, room=1)
    tags = kv.tags(pages)
    for layer in memory.layers:
        for p, t in zip(pages, tags):
            layer[p] = stamp(64, t)
    assert kv.intact(pages, 1) and kv.checks["stale_reads"] == 0
    memory.layers[1][pages[1], 40] ^= 1  # a torn layer
    assert not kv.intact(pages, 1) and kv.checks["stale_reads"] == 1
    memory.layers[0][pages[0]] = stamp(64, WriteTag(2, 99, 0))  # another request's write on a held page
    kv.free(pages, tags)
    assert kv.checks["overwrites_at_release"] == 1 and all((layer[pages] == POISON).all() for layer in memory.layers)
    memory.layers[1][pages[0], 20] = 0  # a write after release
    assert kv.scan() == 1 and kv.checks["late_writes_on_free_pages"] == 1 and kv.scan() == 0
    memory.layers[0][pages[1], 0] = 0
    kv.alloc(4, room=3)  # caught when the page is allocated again
    assert kv.checks["late_writes_at_alloc"] == 1 and kv.checks["overwrites"] == 3
    assert kv.overwrite_log[0]["writer"] == [2, 99, 0] and kv.overwrite_log[0]["owner"] == list(tags[0])
