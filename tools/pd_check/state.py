"""State hashing: a canonical fingerprint of a :class:`~tools.pd_check.world.World`, so revisits are pruned.

The fingerprint keeps everything the protocol's future depends on and drops what it does not: counters
and statistics, virtual times, random-number states (they only draw delays, which the checker does not
use, and fresh abort tokens, which are only ever compared for equality). Values that are fresh names —
abort tokens, page generations, engine batch ids, the request objects themselves — are renamed by
first appearance, so two interleavings that reach the same state up to those names hash alike.
:data:`FIELDS` classifies every attribute of every class a world holds, as *state* (hashed) or
*ignored*; ``unclassified`` (run by a test) catches a new attribute nobody has classified yet.
An invariant may read only hashed state: a revisit is pruned before it is checked.
"""

from __future__ import annotations

import itertools
from functools import partial

from tools.pd_check.choice_channel import ChoiceChannel
from tools.pd_check.stale import stale
from layersplit.pd.abort.cluster import PDCluster
from layersplit.pd.abort.decode_side import TRANSFERRING, WAITING, DecodeNode, DecodeRequest
from layersplit.pd.abort.messages import Abort, AbortAck, TransferRequest
from layersplit.pd.abort.prefill_kv import PrefillKV, SourceRead
from layersplit.pd.abort.prefill_side import PrefillNode, PrefillRequest
from layersplit.pd.abort.transfer_engine import TransferEngine, WriteTag

_COUNTERS = {"stats", "rng"}
FIELDS: dict[type, tuple[set[str], set[str]]] = {  # class -> (state, ignored)
    DecodeNode: ({"reqs", "queue", "watermarks", "_epoch", "kv", "life", "fenced"},
                 _COUNTERS | {"loop", "cfg", "send", "topology", "registry", "on_finish", "release_latencies",
                              "abort_reasons", "fence_writer", "fences", "releases", "held_aborted_pages", "health",
                              "peak_held_aborted_pages",
                              "heard"}),  # only whether a count moved since a request's snapshot matters: hashed there
    DecodeRequest: ({"rid", "room", "n_pages", "state", "pages", "tags", "epoch", "incarnations", "told", "done_peers",
                     "open_ranks", "abort_reason", "abort_token", "unacked", "sends", "quarantined", "resend_armed",
                     "heard"},
                    {"aborted_at"}),
    PrefillNode: ({"incarnation", "alive", "up", "book", "kv", "queue", "engine", "decode_life", "orphans"},
                  _COUNTERS | {"peer", "loop", "cfg", "send", "layers", "fraction", "registry", "_past_peaks",
                               "on_late_reject"}),
    PrefillRequest: ({"msg", "incarnation", "sources", "source_tags", "computing", "lease", "aborted", "token",
                      "failed", "posted_all", "done", "orphaned"}, set()),
    TransferEngine: ({"_status", "_batches", "_in_flight", "_drain_waiters", "fenced_upto"},
                     _COUNTERS | {"loop", "land", "faults", "_next"}),
    PDCluster: ({"rooms", "attempts", "latest", "decode", "prefills", "channel", "loop", "registry", "partitioned"},
                _COUNTERS | {"cfg", "fault_rng", "outcomes", "retries", "misaddress_rng", "watch",
                             "past_decodes"}),  # crashed decode processes (the stress's fresh_decode): statistics
    ChoiceChannel: ({"queues", "late"}, {"stats", "_handlers"}),
}


# WaitingForInput and Transferring differ only in statistics: every decision of DecodeNode treats them
# alike (both live, both polled, both accept TransferDone), so states that differ only there are one state
_STATE = {TRANSFERRING: WAITING}


def unclassified(world) -> list[str]:
    """``Class.attribute`` names present in ``world`` that :data:`FIELDS` does not classify."""
    c = world.cluster
    objects = [c, c.decode, c.channel, *c.prefills, *(n.engine for n in c.prefills), *c.decode.reqs.values(),
               *(r for n in c.prefills for r in n.book.records.values())]
    missing = set()
    for obj in objects:
        state, ignored = FIELDS[type(obj)]
        missing |= {f"{type(obj).__name__}.{a}" for a in vars(obj) if a not in state | ignored}
    return sorted(missing)


class _Canon:
    """Renames fresh values and objects by first appearance, and — for the symmetry reduction — prefill
    ranks by ``ranks[r]`` and request ids by ``rids[i]`` (every place a rank or a rid occurs goes through
    :meth:`rank` / :meth:`rid`; the checker's topology gives rank r exactly layer r)."""

    def __init__(self, world, ranks: tuple[int, ...] | None = None, rids: tuple[int, ...] | None = None) -> None:
        self.names: dict[tuple, int] = {}
        self.world = world
        n = len(world.cluster.prefills)
        self.ranks = ranks or tuple(range(n))
        self.order = sorted(range(n), key=self.ranks.__getitem__)  # old rank at each new position
        self.rids = rids
        self.gone = False
        # past the re-send bound the count changes nothing but a (capped) delay, which orders nothing here:
        # without the cap a rank that never answers would make the state space infinite
        self.sends_bound = world.bounds.abort_sends

    def name(self, kind: str, raw) -> int | None:
        return None if raw is None else self.names.setdefault((kind, raw), len(self.names))

    def rank(self, r: int) -> int:
        return self.ranks[r] if 0 <= r < len(self.ranks) else r  # a non-owner peer id stays itself

    def rid(self, rid: int) -> int:
        return rid if self.rids is None or not 0 <= rid < len(self.rids) else self.rids[rid]

    def per_rank(self, values) -> tuple:
        """A per-rank sequence in the renamed ranks' order."""
        return tuple(values[old] for old in self.order)

    def ranks_of(self, ranks) -> tuple[int, ...]:
        return tuple(sorted(self.rank(r) for r in ranks))

    def pair(self, pair: tuple[str, str]) -> tuple[str, str]:
        return tuple(f"prefill{self.rank(int(e[len('prefill'):]))}" if e.startswith("prefill") else e for e in pair)

    def tag(self, t: WriteTag | None):
        return None if t is None else (t.room, self.name("gen", t.generation), t.life)

    def obj(self, o):
        key = ("obj", id(o))
        if key in self.names:
            return ("ref", self.names[key])
        self.names[key] = len(self.names)
        if isinstance(o, DecodeRequest) and self.gone and self.world.cluster.decode.reqs.get(o.room) is not o:
            return ("gone", self.rid(o.rid), o.room)  # released or lost: no handler reads it again
        if isinstance(o, DecodeRequest):
            return ("D", self.rid(o.rid), o.room, o.n_pages, _STATE.get(o.state, o.state), tuple(o.pages),
                    tuple(self.tag(t) for t in o.tags), o.epoch, self.per_rank(o.incarnations) if o.incarnations else (),
                    self.ranks_of(o.told), self.ranks_of(o.done_peers), self.ranks_of(o.open_ranks), o.abort_reason,
                    self.name("tok", o.abort_token), self.ranks_of(o.unacked), min(o.sends, self.sends_bound),
                    o.quarantined, o.resend_armed, self.heard_since(o))
        assert isinstance(o, PrefillRequest), f"no canonical form for {type(o).__name__}"
        return ("P", self.msg(o.msg), o.incarnation, tuple(o.sources), tuple(self.tag(t) for t in o.source_tags),
                o.computing, o.lease, o.aborted, self.name("tok", o.token), o.failed, o.posted_all, o.done, o.orphaned)

    def heard_since(self, o: DecodeRequest) -> tuple:
        """Per rank (renamed order): has decode heard from it since ``o``'s unreachable timer was armed?
        (the counts themselves only grow; no decision reads more than that)"""
        if not o.heard:
            return ()
        heard = self.world.cluster.decode.heard
        return self.per_rank([heard[r] != o.heard[r] for r in range(len(o.heard))])

    def msg(self, m):
        if isinstance(m, TransferRequest):
            return ("TR", self.rid(m.rid), m.room, m.epoch, m.incarnation, m.floor, m.pages,
                    tuple(self.name("gen", g) for g in m.generations), m.decode_life)
        if isinstance(m, Abort):
            return ("A", self.rid(m.rid), m.room, self.name("tok", m.token), m.epoch, m.floor, m.decode_life)
        if isinstance(m, AbortAck):
            return ("AA", self.rid(m.rid), m.room, self.name("tok", m.token), self.rank(m.peer), m.incarnation,
                    m.decode_life)
        return (type(m).__name__, self.rid(m.rid), m.room, self.rank(m.peer), m.incarnation, m.decode_life)

    def value(self, v):
        if isinstance(v, (DecodeRequest, PrefillRequest)):
            return self.obj(v)
        if isinstance(v, WriteTag):
            return self.tag(v)
        if isinstance(v, SourceRead):
            return ("src", self.name("kv", id(v.kv)), v.page, self.tag(v.tag))
        if isinstance(v, tuple):
            return tuple(self.value(x) for x in v)
        if isinstance(v, partial):
            return (self.fn(v.func), tuple(self.value(a) for a in v.args))
        if callable(v):
            return self.fn(v)
        if isinstance(v, (TransferRequest, Abort, AbortAck)) or hasattr(v, "peer"):
            return self.msg(v)
        return v

    def fn(self, f):
        target = getattr(f, "__self__", None)
        return (getattr(f, "__name__", repr(f)), self.owner(target))

    def owner(self, target):
        c = self.world.cluster
        if target is c.decode:
            return "decode"
        if isinstance(target, PrefillNode):
            return ("prefill", self.rank(target.peer))
        if isinstance(target, TransferEngine):
            return ("engine", self.rank(next(i for i, n in enumerate(c.prefills) if n.engine is target)))
        if isinstance(target, PrefillKV):
            return ("kv", self.name("kv", id(target)))
        if target is c:
            return "router"
        return None if target is None or isinstance(target, type(len)) else type(target).__name__


def _sort_key(k: _Canon, event) -> str:
    fn, args = event[2], event[3]
    name = getattr(fn, "__name__", "")
    if name in _RANK_ARG or name == "submit":
        args = (k.rank(args[0]) if name in _RANK_ARG else k.rid(args[0]),) + tuple(args[1:])
    elif name == "_write":
        args = (args[0], _dest(k, args[1])) + tuple(args[2:])

    def raw(a) -> str:
        if isinstance(a, DecodeRequest):
            return f"d{a.room}"
        if isinstance(a, PrefillRequest):
            return f"p{a.msg.room}.{a.incarnation}"
        if isinstance(a, WriteTag):
            return f"t{a.room}"
        if isinstance(a, SourceRead):
            return f"s{a.page}"
        return str(a)
    owner = k.owner(getattr(fn, "__self__", None))
    return f"{name}|{owner}|" + "|".join(raw(a) for a in args)


_RANK_ARG = ("_suspect", "expire", "renew")  # events whose first argument is a prefill rank


def _dest(k: _Canon, dest) -> tuple:
    page, layers = dest  # the checker's topology: rank r owns layer r
    return (page, tuple(sorted(k.rank(layer) for layer in layers)))


def symmetries(world) -> list[tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """The (rank renaming, rid renaming) pairs the symmetry reduction minimises over: prefill ranks are
    interchangeable (each owns one layer, the protocol treats them alike), so are request ids (all
    submitted at once). Not every renaming: only those that list the ranks (and the rids) in the order of
    a *naming-independent* key of their parts (:func:`_rank_key`, :func:`_rid_key`); ties are tried every
    way. A renaming ``s`` of the state maps its candidates to those of ``s(state)`` (the keys travel with
    the names), so the least hash over the candidates is still the same for every state of one orbit — a
    canonical fingerprint — and most states have one candidate instead of 4 (2 ranks x 2 requests).
    The identity comes first when it is a candidate."""
    ranks = _orderings([_rank_key(world, r) for r in range(len(world.cluster.prefills))])
    rids = _orderings([_rid_key(world, rid) for rid in range(world.bounds.requests)])
    pairs = [(p, q) for p in ranks for q in rids]
    identity = (tuple(range(len(world.cluster.prefills))), tuple(range(world.bounds.requests)))
    return sorted(pairs, key=lambda pq: pq != identity)


def every_renaming(world) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The whole group (ranks x request ids): what :func:`symmetries` narrows down (the tests compare)."""
    ranks = list(itertools.permutations(range(len(world.cluster.prefills))))
    rids = list(itertools.permutations(range(world.bounds.requests)))
    return [(p, q) for p in ranks for q in rids]


def _orderings(keys: list) -> list[tuple[int, ...]]:
    """Every renaming ``new = names[old]`` under which the new names list the keys in sorted order
    (ties: each order of the tied)."""
    keys = [repr(k) for k in keys]  # a total order (keys hold None beside ints); equal values, equal text
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or keys[order[i]] != keys[order[start]]:
            groups.append((start, order[start:i]))
            start = i
    out = []
    for choice in itertools.product(*(itertools.permutations(members) for _, members in groups)):
        names = [0] * len(keys)
        for (first, _), members in zip(groups, choice):
            for offset, old in enumerate(members):
                names[old] = first + offset
        out.append(tuple(names))
    return out


def _rank_key(world, r: int) -> tuple:
    """Rank r's parts as no rank or rid name sees them (hashed state only: equal states, equal keys)."""
    c = world.cluster
    n, e, q = c.prefills[r], c.prefills[r].engine, world.channel.queues
    return (n.incarnation, n.alive, n.up, n.decode_life, n.book.floor, tuple(sorted(n.book.records)),
            tuple(sorted(n.book.tombstones.items())), tuple(x.msg.room for x in n.queue),
            tuple(sorted(e._status[b] for b in e._batches)), e.fenced_upto, len(q.get(("decode", f"prefill{r}"), ())),
            len(q.get((f"prefill{r}", "decode"), ())), c.decode.fenced[r], c.registry._serving[r],
            c.registry.revoked[r], r in c.partitioned)


def _rid_key(world, rid: int) -> tuple:
    c = world.cluster
    latest = c.latest.get(rid)
    return (c.attempts.get(rid, 0), -1 if latest is None else latest.room)


def fingerprint(world, symmetry: bool = False, stale_events: bool = False) -> int:
    """A hash of ``world``'s canonical form (equal for states equal up to fresh names); with ``symmetry``,
    the least over every renaming of ranks and request ids (equal for states equal up to those too); with
    ``stale_events``, blind to pending events that can change nothing (see tools.pd_check.stale)."""
    if not symmetry:
        return hash(canonical(world, stale_events=stale_events))
    return min(hash(canonical(world, ranks, rids, stale_events)) for ranks, rids in symmetries(world))


def orbit_fingerprint(world, stale_events: bool = False) -> int:
    """The least hash over *every* renaming (the whole group): a second canonical form, slower, that
    the tests hold :func:`fingerprint` against (equal orbits, equal classes)."""
    return min(hash(canonical(world, ranks, rids, stale_events)) for ranks, rids in every_renaming(world))


def canonical(world, ranks: tuple[int, ...] | None = None, rids: tuple[int, ...] | None = None,
              stale_events: bool = False) -> tuple:
    k, c = _Canon(world, ranks, rids), world.cluster
    k.gone = stale_events  # hash a request decode no longer holds by its name only
    d = c.decode
    decode = (_pages(k, d.kv, d.kv.data, len(d.kv.overwrites), layers=True),
              tuple(k.obj(d.reqs[room]) for room in sorted(d.reqs)), tuple(k.obj(r) for r in d.queue), d._epoch,
              k.per_rank([(tuple(sorted(e for e in w._open if e not in w._closed)), w._next) for w in d.watermarks]),
              d.stats["checksum_mismatches"], d.life, k.per_rank(d.fenced))  # the statistic an invariant reads
    # d.life is also the registry's decode-life counter: the registry issued it last (DecodeNode asserts it)
    prefills = tuple(
        (n.incarnation, n.alive, n.up, k.name("kv", id(n.kv)), _pages(k, n.kv, n.kv.content, len(n.kv.stale_reads)),
         tuple((room, k.obj(n.book.records[room])) for room in sorted(n.book.records)),
         tuple(sorted(n.book.tombstones.items())), n.book.floor, tuple(sorted(n.book._by_epoch)),
         tuple(k.obj(r) for r in n.queue), n.decode_life,
         tuple(k.obj(r) for r in sorted(n.orphans, key=lambda r: (r.msg.room, r.incarnation))))
        for n in k.per_rank(c.prefills))
    engines = tuple(
        (tuple((k.name("batch", (rank, b)), e._status[b], rec.owner, rec.remaining, k.value(rec.on_status),
                k.value(rec.on_quiesced)) for b, rec in sorted(e._batches.items())),
         tuple(sorted((o, v) for o, v in e._in_flight.items() if v)),
         tuple((k.value(owners), k.value(fn)) for owners, fn in e._drain_waiters),
         e.fenced_upto, e.stats["fenced_landed"])  # the statistic an invariant reads
        for rank, e in k.per_rank(list(enumerate(n.engine for n in c.prefills))))
    queues = sorted((k.pair(pair), q) for pair, q in world.channel.queues.items() if q)
    channel = (tuple((pair, tuple(k.msg(m) for m in q)) for pair, q in queues),
               tuple(sorted(((k.pair(pair), k.msg(m)) for pair, m in world.channel.late), key=repr)))
    pending = [e for e in c.loop.events() if not (stale_events and stale(c, e))]
    events = tuple(_event(k, e) for e in sorted(pending, key=lambda e: _sort_key(k, e)))
    return (decode, prefills, engines, k.per_rank(c.registry._serving), k.per_rank(c.registry.revoked), channel,
            events, c.rooms, k.ranks_of(c.partitioned), c.stats["false_late_rejections"],
            tuple(sorted((k.rid(rid), n) for rid, n in c.attempts.items())),
            tuple(sorted((k.rid(rid), k.obj(c.latest[rid])) for rid in sorted(c.latest))),
            world.faults_used, world.cancels_used,
            tuple(sorted(((k.rank(r), inc, life), floor) for (r, inc, life), floor in world.floors_told.items())),
            tuple(sorted(world.polls.items())))


def _event(k: _Canon, e) -> tuple:
    fn, args = e[2], e[3]
    name = getattr(fn, "__name__", "")
    if name in ("_write", "fail", "_quiesce"):  # engine events: batch ids are fresh names
        rank = next(i for i, n in enumerate(k.world.cluster.prefills) if n.engine is fn.__self__)
        rest = ((_dest(k, args[1]),) + tuple(k.value(a) for a in args[2:])) if name == "_write" else ()
        return (k.fn(fn), k.name("batch", (rank, args[0])), rest)
    if name in _RANK_ARG:
        return (k.fn(fn), (k.rank(args[0]),) + tuple(k.value(a) for a in args[1:]))
    if name == "submit":
        return (k.fn(fn), (k.rid(args[0]),))
    return (k.fn(fn), tuple(k.value(a) for a in args))


def _pages(k: _Canon, pages, content, extra: int = 0, layers: bool = False) -> tuple:
    rows = tuple(k.per_rank(r) if layers else _row(r) for r in content)  # decode rows: one layer per rank
    return (tuple(k.tag(t) for t in pages.owner), tuple(pages.free_pages), rows, len(pages.bad_frees), extra)


def _row(r):
    return tuple(r) if isinstance(r, list) else r
