"""Partial-order reduction: a persistent set of one prefill rank's local steps (or of one quiet delivery
into decode), explored alone. Why it is sound: see docs/pd.md#why-the-partial-order-reduction-is-sound.

**The set.** For prefill rank r, ``T_r(s)`` is every action enabled in s that *belongs* to r: a delivery
into r (the head of decode->r, or a late duplicate to r), and r's own pending events (``_computed``,
``_post``, a restart, its engine's events). It is expanded alone only when, for some r (the smallest such
set is taken):

1. **no fault can touch r** from s on: the fault budget is spent, or the only kind allowed is
   ``decode_restart`` (faults share one budget, so a fault is dependent on every other fault);
2. **every action of T_r(s) is local** to r: deliveries into r and r's ``_computed`` / ``_post`` — not a
   landing write (it reads decode's page owner), a restart (the registry), a heal (decode's sends), nor a
   TransferRequest r might reject as late (the tap reads decode's request);
3. **the decode->r queue is not empty** (its head is in T_r; FIFO order then keeps every other delivery
   into r behind it).

A delivery of the head of r->decode is **quiet** when decode's handler changes nothing the fingerprint
holds and stays so on every path that does not take it (:func:`_quiet_into_decode` lists the cases);
``{t}`` is expanded alone under condition 1 and only while the unreachable fence is off (its timer reads
``heard``, which every delivery moves). It crosses requests.

Invariants and hazards:

* both sets come with the breadth-first cycle proviso: a reduced state's successors must all be one level
  deeper, else the state is expanded fully; an action pruned by the channel capacity makes the set
  incomplete, and the state is then expanded fully too;
* the reduction keeps every violation and every terminal state, **not the shortest counterexample**: the
  result says ``shortest: false`` where a state was reduced; ``--shortest`` re-runs without it;
* where the quiet test leans on a guarded method (the transport's identity, ``owners-only``'s membership)
  it asks the method in force, so a guard switched off is checked as it behaves;
* any pending event the argument does not cover (a protocol step added later, e.g. the cluster's lease
  renewal) switches the reduction off in that state until its footprint is added here and to the proof.

``unsound_quiet`` (tests only) takes every delivery into decode as quiet, which it is not (a TransferDone
from an owner completes a request).
``unsound_independence`` (tests only) declares r's landing writes local — wrong, since a write reads decode's
page owner — and drops condition 3 (so a later delivery into r is taken as independent of r's steps), so the
cross-check that compares reduced and unreduced runs can show it would catch a bad entry.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from layersplit.pd.abort.decode_request import FAILED, SUCCESS, TRANSFERRING, WAITING
from layersplit.pd.abort.decode_side import DecodeNode
from layersplit.pd.abort.messages import AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from layersplit.pd.abort.prefill_side import PrefillNode

_LOCAL_EVENTS = ("_computed", "_post")
_RECORD_DONE = DecodeNode._record_done  # the guarded method as shipped (layersplit.pd.abort.guards swaps it while off)
_UNSOUND = {"writes_local": False, "every_delivery_quiet": False}


@contextlib.contextmanager
def _unsound(entry: str) -> Iterator[None]:
    _UNSOUND[entry] = True
    try:
        yield
    finally:
        _UNSOUND[entry] = False


def unsound_independence():
    """TEST ONLY: deliberately wrong independence (r's landing writes counted local, condition 3 dropped)."""
    return _unsound("writes_local")


def unsound_quiet():
    """TEST ONLY: deliberately wrong independence (every delivery into decode taken as quiet)."""
    return _unsound("every_delivery_quiet")


def persistent_set(w, actions: list[tuple]) -> list[tuple] | None:
    """A quiet delivery into decode, else the smallest ``T_r`` (docs/pd.md, the soundness argument) that is persistent in
    ``w``; None: expand fully."""
    b = w.bounds
    if w.faults_used < b.faults and not set(b.fault_kinds) <= {"decode_restart"}:
        return None  # condition 1: a fault could still touch any rank
    if not all(_analysed(w, e) for e in w.cluster.loop.events()):
        return None  # an event whose footprint the argument above does not cover (a newer protocol step)
    quiet = next((a for a in actions if _quiet_into_decode(w, a)), None)
    if quiet is not None and len(actions) > 1:
        return [quiet]
    best = None
    for rank, node in enumerate(w.cluster.prefills):
        if not w.channel.queues.get(("decode", f"prefill{rank}")) and not _UNSOUND["writes_local"]:
            continue  # condition 3
        mine = [a for a in actions if _belongs(w, node, a)]
        if mine and all(_local(w, node, a) for a in mine) and (best is None or len(mine) < len(best)):
            best = mine
    return best if best is not None and len(best) < len(actions) else None


# the pending events whose footprints the soundness argument covers (docs/pd.md): decode's timers (decode, the registry, the
# fence of an engine, pushes onto decode->r), the router's submit, the registry's lease expiry, and the ranks'
# own (prefill process and engine) events
_DECODE_EVENTS = ("_resolve", "_timeout", "_poll", "send_aborts", "_finish", "_queue_timeout", "_suspect", "abort",
                  "unreachable")


def _analysed(w, event: tuple) -> bool:
    fn, c = event[2], w.cluster
    target, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if target is c.decode or target is c.decode.health:  # the fence timer is the health monitor's
        return name in _DECODE_EVENTS
    if target is c:
        return name == "submit"
    if target is c.registry:
        return name == "expire"
    return any(target is n or target is n.engine for n in c.prefills)


def _belongs(w, node: PrefillNode, a: tuple) -> bool:
    kind = a[0]
    if kind == "event":
        target = getattr(_event(w, a)[2], "__self__", None)
        return target is node or target is node.engine
    if kind == "deliver":
        return a[1][1] == f"prefill{node.peer}"
    if kind == "late":
        return w.channel.late[a[1]][0][1] == f"prefill{node.peer}"
    return kind == "heal" and a[1] == node.peer  # faults: none is enabled under condition 1 but decode_restart


def _local(w, node: PrefillNode, a: tuple) -> bool:
    kind = a[0]
    if kind == "event":
        fn = _event(w, a)[2]
        if fn.__self__ is node.engine:
            return _UNSOUND["writes_local"] and fn.__name__ == "_write"
        return fn.__name__ in _LOCAL_EVENTS
    if kind == "deliver":
        return not _may_reject_late(node, w.channel.queues[a[1]][a[2]])
    if kind == "late":
        return not _may_reject_late(node, w.channel.late[a[1]][1])
    return False


def _may_reject_late(node: PrefillNode, msg: object) -> bool:
    """Could delivering ``msg`` to ``node`` reach the late-rejection tap (which reads decode's request)?
    Conservative: a guard switched off only ever rejects less (or the same)."""
    if not isinstance(msg, TransferRequest) or not node.up or msg.decode_life < node.decode_life:
        return False
    return msg.room in node.book.tombstones or msg.epoch < max(node.book.floor, msg.floor)


def _quiet_into_decode(w, a: tuple) -> bool:
    """Is ``a`` the delivery of the head of r->decode that changes nothing decode's hashed state holds,
    in ``w`` and on every path from ``w`` that does not take it?"""
    if a[0] != "deliver" or a[1][1] != "decode":
        return False
    if _UNSOUND["every_delivery_quiet"]:
        return True
    d, msg, src = w.cluster.decode, w.channel.queues[a[1]][a[2]], a[1][0]
    if d.cfg.fence_unreachable_s is not None:
        return False  # the unreachable fence's timer reads whether anything was heard from src meanwhile
    rank = int(src[len("prefill"):])
    if msg.decode_life != d.life or not d._from_peer(msg, rank):  # the method: a guard switched off believes it
        return True  # an older life's reply (lives only rise), or one naming a peer it did not come from
    req = d.reqs.get(msg.room)
    if isinstance(msg, AbortAck):
        return req is None or req.abort_token is None or req.abort_token != msg.token or msg.peer not in req.unacked
    if req is None or req.state in (SUCCESS, FAILED):
        return True  # late: a room decode no longer holds never comes back, nor does a request come back to life
    if req.state not in (WAITING, TRANSFERRING):
        return False
    if isinstance(msg, TransferStarted):
        return True  # Waiting -> Transferring: one state to every decision (and to the fingerprint)
    owner = msg.peer in req.told and msg.incarnation == req.incarnations[msg.peer]  # fixed from the announce on
    if isinstance(msg, TransferDone):  # with owners-only off, a non-owner's report counts
        return msg.peer in req.done_peers or (not owner and DecodeNode._record_done is _RECORD_DONE)
    return isinstance(msg, TransferFailed) and not owner


def _event(w, a: tuple) -> tuple:
    return next(e for e in w.cluster.loop.events() if e[1] == a[1])
