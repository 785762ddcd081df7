"""One state of the checked system — the stress's own :class:`~layersplit.pd.abort.cluster.PDCluster` (decode, prefill
ranks, engines, router) wired to a :class:`ChoiceChannel` — and the actions enabled in it.

Time orders nothing here: every pending event of the loop (a timer, a landing write, a forward pass
finishing, a router retry, a restart) may fire next, as may any channel choice, fault or cancel the
budgets allow. An action is a plain tuple, so it applies to any copy of the state; its label is how a
trace reads and how a replay finds it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from layersplit.pd.abort.backoff import AbortBackoff
from tools.pd_check.bounds import CheckBounds
from tools.pd_check.choice_channel import ChoiceChannel
from tools.pd_check.stale import stale
from layersplit.pd.abort.channel import ChannelFaults
from layersplit.pd.abort.cluster import PDCluster
from layersplit.pd.abort.decode_side import DecodeConfig, DecodeRequest
from layersplit.pd.abort.guards import decode_config_off
from layersplit.pd.abort.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from layersplit.pd.abort.prefill_side import PrefillConfig, PrefillNode, PrefillRequest
from layersplit.pd.abort.stress_config import PDStressConfig
from layersplit.pd.abort.topology import PrefillTopology
from layersplit.pd.abort.transfer_engine import EngineFaults, TransferEngine

# optional actions: they are choices, not events the system owes (a terminal state may still allow them).
# crash: a prefill process dies and restarts; kill: it dies for good (its lease expires, decode fences it);
# decode_restart: the decode worker starts a new life; misaddress: a prefill reply is also delivered naming
# another peer (from its own link) or a non-owner (from that one's link); partition: a rank's control link
# is cut until the (owed) heal; lease_loss: a live rank's lease expires (a false suspicion: its heartbeat is
# starved), the renewal of that heartbeat is then owed. A stale registry needs no action: a lease expires
# some time after a crash.
FAULTS = ("drop", "duplicate", "reorder", "crash", "fail", "kill", "decode_restart", "misaddress", "partition",
               "lease_loss")
CANCEL = "cancel"
OWED = ("event", "deliver", "late", "heal")


@dataclass
class World:
    bounds: CheckBounds
    cluster: PDCluster
    channel: ChoiceChannel
    faults_used: int = 0
    cancels_used: int = 0
    floors_told: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (rank, incarnation, life) -> floor
    polls: dict[int, int] = field(default_factory=dict)  # room -> decode poll timers fired


class ChoiceRandom:
    """The checker's random source: delays and draws are fixed (time orders nothing here, faults and
    cancels are choices), abort tokens are a counter — fresh, which is all the protocol asks of them.
    (A ``random.Random`` also costs ~0.2 ms to copy; a world is copied once per explored transition.)"""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def __getstate__(self):
        return self._next

    def __setstate__(self, state) -> None:
        self._next = state

    def random(self) -> float:
        return 0.0  # below any fault probability: the stress's faults never fire (cfg rates are 0 anyway)

    def uniform(self, a: float, b: float) -> float:
        return a

    def randint(self, a: int, b: int) -> int:
        return a

    def getrandbits(self, k: int) -> int:
        self._next += 1
        return self._next


def build_world(bounds: CheckBounds) -> World:
    """The initial state: ``bounds.requests`` submissions pending, nothing else."""
    r, p = bounds.requests, bounds.pages
    cfg = PDStressConfig(
        requests=r, seed=0, legacy_immediate_release=bounds.legacy,
        topology=PrefillTopology(tuple((rank,) for rank in range(bounds.prefill_ranks))),
        max_retries=bounds.retries, min_pages=p, max_pages=p, cancel=0.0, restart_mean_s=None,
        channel=ChannelFaults(), engine=EngineFaults(),  # unused: the checker chooses deliveries and failures
        prefill=PrefillConfig(pages_per_batch=1, source_pages=r * p),
        decode=decode_config_off(DecodeConfig(num_pages=r * p, abort_backoff=AbortBackoff(max_sends=bounds.abort_sends),
                                              fence_unreachable_s=1.0 if bounds.fence_unreachable else None),
                                 bounds.guards_off))
    channel = ChoiceChannel()
    cluster = PDCluster(cfg, channel=channel)
    cluster.rng = cluster.fault_rng = cluster.decode.rng = cluster.misaddress_rng = ChoiceRandom()
    for node in cluster.prefills:
        node.engine.rng = ChoiceRandom()
    for rid in range(r):
        cluster.loop.after(0.0, cluster.submit, rid)
    return World(bounds, cluster, channel)


# enumerating and applying actions ------------------------------------------------------------------
def enabled(w: World) -> list[tuple]:
    """Every action possible in ``w``: pending events and deliveries first (the owed ones), then
    faults and cancels while their budgets last."""
    stale_off = w.bounds.stale_events
    actions = [("event", e[1]) for e in w.cluster.loop.events()
               if not _poll_spent(w, e) and not (stale_off and stale(w.cluster, e))]
    actions += [("deliver", pair, 0) for pair, q in sorted(w.channel.queues.items()) if q]
    actions += [("late", i) for i in range(len(w.channel.late))]
    actions += [("heal", rank) for rank in sorted(w.cluster.partitioned)]
    if w.faults_used < w.bounds.faults:
        actions += [a for a in _faults(w) if a[0] in w.bounds.fault_kinds]
    if w.cancels_used < w.bounds.cancels:
        actions += [(CANCEL, rid) for rid in sorted(w.cluster.latest)]
    return actions


def _faults(w: World) -> list[tuple]:
    c, actions, ranks = w.cluster, [], len(w.cluster.prefills)
    for pair, q in sorted(w.channel.queues.items()):
        if q:
            actions += [("drop", pair), ("duplicate", pair)]
            actions += [("reorder", pair, i) for i in range(1, len(q))]
            if pair[1] == "decode":
                sender = int(pair[0][len("prefill"):])
                actions += [("misaddress", pair, peer) for peer in range(ranks + 1) if peer != sender]
    alive = [n.peer for n in c.prefills if n.alive]
    actions += [("crash", r) for r in alive] + [("kill", r) for r in alive]
    for rank, node in enumerate(c.prefills):
        actions += [("fail", rank, b) for b in sorted(node.engine._batches) if node.engine.poll(b) == "pending"]
    actions.append(("decode_restart",))
    actions += [("partition", r) for r in range(ranks) if r not in c.partitioned]
    actions += [("lease_loss", n.peer) for n in c.prefills if n.up and c.registry.serving(n.peer) == n.incarnation]
    return actions


def _poll_spent(w: World, event: tuple) -> bool:
    """Decode's poll re-sends its TransferRequests for ever while it waits; the checker lets it fire
    ``bounds.polls`` times per room (a bound, like the fault budget: the timeout still fires)."""
    return getattr(event[2], "__name__", "") == "_poll" and w.polls.get(event[3][0].room, 0) >= w.bounds.polls


def owed(actions: list[tuple]) -> bool:
    """Does any action in ``actions`` have to happen eventually (an event or a delivery)?"""
    return any(a[0] in OWED for a in actions)


def apply(w: World, action: tuple) -> None:
    kind, c = action[0], w.cluster
    if kind in FAULTS:
        w.faults_used += 1
    if kind == "event":
        event = next(e for e in c.loop.events() if e[1] == action[1])
        if getattr(event[2], "__name__", "") == "_poll":
            w.polls[event[3][0].room] = w.polls.get(event[3][0].room, 0) + 1
        c.loop.fire(event)
    elif kind in ("deliver", "reorder"):
        _deliver(w, action[1], action[2])
    elif kind == "late":
        pair, msg = w.channel.late[action[1]]
        _note_floor(w, pair, msg)
        w.channel.deliver_late(action[1])
    elif kind == "drop":
        w.channel.drop(action[1])
    elif kind == "duplicate":
        _note_floor(w, action[1], w.channel.queues[action[1]][0])
        w.channel.duplicate(action[1])
    elif kind == "crash":
        node = c.prefills[action[1]]
        node.crash()
        c.loop.after(0.0, node.restart)  # the restart is owed: a crashed rank comes back
    elif kind == "kill":
        c.prefills[action[1]].crash()  # no restart: its lease expires, decode fences it
    elif kind == "fail":
        c.prefills[action[1]].engine.fail(action[2])
    elif kind == "decode_restart":
        c.decode.restart()
    elif kind == "misaddress":
        pair, peer = action[1], action[2]
        forged = replace(w.channel.queues[pair][0], peer=peer)
        w.channel._deliver("decode", forged, pair[0] if peer < len(c.prefills) else f"prefill{peer}")
    elif kind == "partition":
        c.partitioned.add(action[1])
    elif kind == "lease_loss":
        c.lose_lease(action[1])  # its renewal is a pending event: fired at any later moment
    elif kind == "heal":
        c.partitioned.discard(action[1])
    elif kind == CANCEL:
        w.cancels_used += 1
        c.decode.abort(c.latest[action[1]], "client")
    else:
        raise AssertionError(f"unknown action {action!r}")


def _deliver(w: World, pair: tuple[str, str], index: int) -> None:
    _note_floor(w, pair, w.channel.queues[pair][index])
    w.channel.deliver(pair, index)


def _note_floor(w: World, pair: tuple[str, str], msg: object) -> None:
    """Remember the highest floor decode told each prefill process (the window invariant's bound)."""
    if pair[1].startswith("prefill"):
        node = w.cluster.prefills[int(pair[1][len("prefill"):])]
        if node.up and msg.decode_life >= node.decode_life:  # an older life's message is dropped
            key = (node.peer, node.incarnation, msg.decode_life)
            w.floors_told[key] = max(w.floors_told.get(key, 0), msg.floor)


# labels ------------------------------------------------------------------------------------------------
def label(w: World, action: tuple) -> str:
    """A one-line, human-readable name of ``action`` in ``w`` (also what a replay matches)."""
    kind = action[0]
    if kind == "event":
        return _event_label(w, next(e for e in w.cluster.loop.events() if e[1] == action[1]))
    if kind in ("deliver", "reorder", "drop", "duplicate"):
        pair = action[1]
        index = action[2] if kind != "drop" and kind != "duplicate" else 0
        what = {"deliver": "deliver", "reorder": f"REORDER: deliver #{index + 1} of", "drop": "DROP",
                "duplicate": "DUPLICATE (deliver, re-send later)"}[kind]
        return f"net: {what} {pair[0]}->{pair[1]} {message_text(w.channel.queues[pair][index])}"
    if kind == "late":
        pair, msg = w.channel.late[action[1]]
        return f"net: deliver the late re-sent duplicate {pair[0]}->{pair[1]} {message_text(msg)}"
    if kind == "crash":
        return f"fault: prefill{action[1]} crashes (incarnation {w.cluster.prefills[action[1]].incarnation})"
    if kind == "kill":
        return f"fault: prefill{action[1]} dies for good (incarnation {w.cluster.prefills[action[1]].incarnation})"
    if kind == "fail":
        return f"fault: engine{action[1]} reports batch {action[2]} failed (its writes still land)"
    if kind == "decode_restart":
        return f"fault: decode restarts (life {w.cluster.decode.life} -> {w.cluster.decode.life + 1})"
    if kind == "misaddress":
        pair = action[1]
        return (f"fault: MISADDRESS {pair[0]}->{pair[1]} {message_text(w.channel.queues[pair][0])} "
                f"also delivered naming prefill{action[2]}")
    if kind == "partition":
        return f"fault: prefill{action[1]}'s control link is cut"
    if kind == "lease_loss":
        return (f"fault: prefill{action[1]}'s lease expires while it runs (a false suspicion; incarnation "
                f"{w.cluster.prefills[action[1]].incarnation})")
    if kind == "heal":
        return f"net: prefill{action[1]}'s control link heals"
    if kind == CANCEL:
        return f"client: cancel rid {action[1]} (room {w.cluster.latest[action[1]].room})"
    raise AssertionError(f"unknown action {action!r}")


_EVENTS = {"submit": "router: submit", "_resolve": "decode: bootstrap lookup", "_timeout": "decode: wait timeout",
           "_poll": "decode: poll (re-send TransferRequest)", "send_aborts": "decode: abort re-send timer",
           "_finish": "decode: finish decoding", "abort": "decode: abort", "_computed": "forward pass done",
           "_post": "post write batch", "restart": "restart", "_write": "write lands", "fail": "batch fails",
           "_quiesce": "empty batch quiesces", "expire": "registry: lease expires", "_suspect": "decode: fence timer",
           "_queue_timeout": "decode: queue timeout", "unreachable": "decode: unreachable-fence timer",
           "renew": "registry: a live process's heartbeat returns (rank, incarnation)"}


def _event_label(w: World, event: tuple) -> str:
    fn, args = event[2], event[3]
    target, name = getattr(fn, "__self__", None), getattr(fn, "__name__", repr(fn))
    text = _EVENTS.get(name, name)
    if isinstance(target, TransferEngine):
        rank = next(i for i, n in enumerate(w.cluster.prefills) if n.engine is target)
        if name == "_write":
            batch, (page, layers), tag = args[0], args[1], args[2]
            return (f"engine{rank}: write of batch {batch} lands on decode page {page} layers {list(layers)} "
                    f"as (room {tag.room}, gen {tag.generation})")
        return f"engine{rank}: {text} {args}"
    who = f"prefill{target.peer}: {text}" if isinstance(target, PrefillNode) else text
    if name == "submit":
        return f"{who} rid {args[0]}"
    if name == "_post":
        return f"{who} {_arg_text(args[0])} from page {args[1]}"
    return f"{who} {', '.join(_arg_text(a) for a in args)}".rstrip()


def _arg_text(arg: object) -> str:
    if isinstance(arg, DecodeRequest):
        return f"room {arg.room} (rid {arg.rid})"
    if isinstance(arg, PrefillRequest):
        return f"room {arg.msg.room} (incarnation {arg.incarnation})"
    return repr(arg)


def message_text(msg: object) -> str:
    life = f", decode life {msg.decode_life}" if getattr(msg, "decode_life", 0) else ""
    if isinstance(msg, TransferRequest):
        return (f"TransferRequest(room {msg.room}, epoch {msg.epoch}, incarnation {msg.incarnation}, "
                f"floor {msg.floor}, pages {list(msg.pages)}{life})")
    if isinstance(msg, Abort):
        return f"Abort(room {msg.room}, epoch {msg.epoch}, floor {msg.floor}{life})"
    if isinstance(msg, AbortAck):
        return f"AbortAck(room {msg.room}, from prefill{msg.peer} incarnation {msg.incarnation}{life})"
    if isinstance(msg, (TransferStarted, TransferDone, TransferFailed)):
        inc = f" incarnation {msg.incarnation}" if msg.incarnation else ""
        return f"{type(msg).__name__}(room {msg.room}, from prefill{msg.peer}{inc}{life})"
    return repr(msg)

