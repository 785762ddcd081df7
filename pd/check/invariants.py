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
Liveness under fairness, terminal states (faults stopped, every owed event fired, every message gone):
  * ``stuck``: every request decode still holds is quarantined (or queued behind quarantined pages);
  * ``needless_quarantine``: only pages some rank may still write are quarantined;
  * ``leak``: every decode page and prefill source page is free or held by a live record.
"""

from __future__ import annotations

from pd.pages import TaggedPages
from pd.prefill_kv import SourceRead


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
    found += _window(w)
    return found


def terminal_violations(w) -> list[str]:
    """The liveness invariants a terminal ``w`` breaks."""
    c, found = w.cluster, []
    d = c.decode
    quarantine_holds = any(r.quarantined for r in d.reqs.values())
    for room in sorted(d.reqs):
        r = d.reqs[room]
        if r.quarantined and not (r.told - r.done_peers):
            found.append(f"needless_quarantine: room {room}'s pages are quarantined but no rank was ever told them "
                         f"(told {sorted(r.told)}, done {sorted(r.done_peers)})")
        elif not r.quarantined and not (r in d.queue and quarantine_holds):
            found.append(f"stuck: room {room} ({r.state}) is still held with nothing left to move it")
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
        floor = w.floors_told.get((n.peer, n.incarnation), 0)
        below = sorted({r.msg.room for r in n.book.records.values() if r.msg.epoch < floor}
                       | {room for room, epoch in n.book.tombstones.items() if epoch < floor})
        if below:
            found.append(f"prefill_window: prefill{n.peer} still holds room(s) {below} below the floor {floor} "
                         f"decode told it")
    return found


def _tag(tag) -> str:
    return "free" if tag is None else f"(room {tag.room}, gen {tag.generation})"
