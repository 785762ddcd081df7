"""What must hold in every reachable state, and in every terminal one (no event or message left).

Safety, every state:
  * ``overwrite``: no write landed on a decode page owned by another (room, generation);
  * ``freed_while_writing``: no decode page is freed (or handed on) while a write to it may still land —
    every pending write still targets a page its own (room, generation) owns;
  * ``source_freed_while_writing``: likewise for the prefill source pages a pending write reads;
  * ``double_free``: every page freed at most once — no stale free, the free list holds each page once
    and exactly the pages nobody owns;
  * ``corrupt_read``: decode never starts on KV that is not wholly its own (checksum);
  * ``prefill_window``: a prefill process holds no record or tombstone below the floor decode told it.
  * ``fenced_write_landed``: no write of a fenced prefill process reached decode's memory;
  * ``false_late_rejection``: no prefill rank rejects, as late, a TransferRequest decode still waits on.
A pending write the engine or decode's memory will refuse (a fenced process's, an old decode life's)
threatens no page. Liveness under fairness, terminal states (faults stopped, every owed event fired —
restarts, lease expiries, fence timers, heals — every message gone):
  * ``held_for_ever``: decode holds no request any more — none quarantined for ever, none queued behind
    one — since every rank is up again or was fenced (issue 25: quarantine was terminal);
  * ``leak``: every decode page and prefill source page is free or held by a live record.
"""

from __future__ import annotations

from layersplit.pd.abort.pages import TaggedPages
from layersplit.pd.abort.prefill_kv import SourceRead


def violations(w) -> list[str]:
    """The safety invariants ``w`` breaks, each as ``name: detail``."""
    c = w.cluster
    d, found = c.decode, []
    if d.kv.overwrites:
        page, tag, owner = d.kv.overwrites[0]
        found.append(f"overwrite: a write of {_tag(tag)} landed on decode page {page} owned by {_tag(owner)}")
    for e in c.loop.events():
        if getattr(e[2], "__name__", "") != "_write":
            continue
        (page, _), tag, payload = e[3][1], e[3][2], e[3][3]
        engine = e[2].__self__
        if engine._refuses(engine._batches[e[3][0]].owner) or not d.kv.accepts(tag):
            continue  # refused where it lands (fenced process / dead decode life): it threatens nothing
        if d.kv.owner[page] != tag:
            found.append(f"freed_while_writing: decode page {page} is {_tag(d.kv.owner[page])} while a write of "
                         f"{_tag(tag)} to it is still in flight")
        if isinstance(payload, SourceRead) and payload.kv.owner[payload.page] != payload.tag:
            found.append(f"source_freed_while_writing: prefill source page {payload.page} is "
                         f"{_tag(payload.kv.owner[payload.page])} while a write reading it as {_tag(payload.tag)} "
                         f"is in flight")
    for where, pages in (("decode", d.kv), *((f"prefill{n.peer}", n.kv) for n in c.prefills)):
        found += [f"double_free: {where} {m}" for m in _free_list_errors(pages)]
    for n in c.prefills:
        if n.kv.stale_reads:
            page, tag, owner = n.kv.stale_reads[0]
            found.append(f"source_freed_while_writing: prefill{n.peer} page {page} read as {_tag(tag)}, owned by {_tag(owner)}")
    if d.stats["checksum_mismatches"]:
        found.append("corrupt_read: decode started on KV that is not wholly its request's")
    for n in c.prefills:
        if n.engine.stats["fenced_landed"]:
            found.append(f"fenced_write_landed: a write of a fenced prefill{n.peer} process reached decode's memory")
    if c.stats["false_late_rejections"]:
        found.append("false_late_rejection: a prefill rank rejected as late a TransferRequest decode still waits on")
    found += _window(w)
    return found


def terminal_violations(w) -> list[str]:
    """The liveness invariants a terminal ``w`` breaks."""
    c, found = w.cluster, []
    d = c.decode
    for room in sorted(d.reqs):
        r = d.reqs[room]
        what = "quarantined" if r.quarantined else "queued for pages" if not r.pages else r.state
        found.append(f"held_for_ever: room {room} ({what}, waiting on ranks {sorted(r.unacked)}) is still held "
                     f"though every rank is up or fenced and nothing is left to move it")
    if c.leaked_pages():
        found.append(f"leak: {c.leaked_pages()} decode page(s) neither free nor held by a request")
    if c.prefill_leaked_pages():
        found.append(f"leak: {c.prefill_leaked_pages()} prefill source page(s) held by no record")
    return found


def _free_list_errors(pages: TaggedPages) -> list[str]:
    errors = [f"stale free of page {p} as {_tag(t)} (owned by {_tag(o)})" for p, t, o in pages.bad_frees[:1]]
    free = list(pages.free_pages)
    if len(set(free)) != len(free):
        errors.append(f"page freed twice: free list {free}")
    unowned = {p for p, o in enumerate(pages.owner) if o is None}
    if set(free) != unowned:
        errors.append(f"free list {sorted(set(free))} but unowned pages {sorted(unowned)}")
    return errors


def _window(w) -> list[str]:
    found = []
    for n in w.cluster.prefills:
        if not n.alive:
            continue
        floor = w.floors_told.get((n.peer, n.incarnation, n.decode_life), 0)
        below = sorted({r.msg.room for r in n.book.records.values() if r.msg.epoch < floor}
                       | {room for room, epoch in n.book.tombstones.items() if epoch < floor})
        if below:
            found.append(f"prefill_window: prefill{n.peer} still holds room(s) {below} below the floor {floor} "
                         f"decode told it")
    return found


def _tag(tag) -> str:
    return "free" if tag is None else f"(room {tag.room}, gen {tag.generation})"
