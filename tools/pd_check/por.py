"""Partial-order reduction: a persistent set of one prefill rank's local steps (or of one quiet delivery
into decode), explored alone.

**The set.** For prefill rank r, ``T_r(s)`` is every action enabled in s that *belongs* to r: a delivery
into r (the head of decode->r, or a late duplicate to r), and r's own pending events — its forward pass
finishing (``_computed``), its next batch post (``_post``), a restart, and its engine's events (a write
landing, a batch failing or quiescing). The explorer expands ``T_r(s)`` instead of every enabled action
when, for some r (the smallest such set is taken):

1. **no fault can touch r** from s on: the fault budget is spent (``faults_used == faults``) or the kinds
   allowed are only ``decode_restart`` (which changes decode alone, and the registry's decode-life counter,
   which no prefill step reads). Faults share one budget, so a fault is dependent on every other fault;
   with budget left, a crash / drop / fail / partition of r's parts could be taken by a path outside the
   set and would not commute with r's steps;
2. **every action of T_r(s) is local** to r: it reads and writes only r's process (book, queue, records,
   source pages), the posting side of r's engine (new batches and write events: ``post`` reads no fence),
   the head of the decode->r queue, the *tail* of the r->decode queue, ``floors_told`` of r and the
   ``partitioned`` flag of r (read only). Concretely: deliveries into r and r's ``_computed`` / ``_post``,
   and not a TransferRequest r might reject as late (that calls a tap that reads decode's request:
   conservatively, any that is tombstoned or below max(r's floor, its own floor)). Not local: a write
   landing (decode's page and page owner), a restart (the registry, hence decode), a heal (decode's sends);
3. **the decode->r queue is not empty**. Its head delivery is then in T_r, and FIFO order means no other
   message can be delivered into r (a reorder is a fault; late duplicates come only from a fault) by any
   path that avoids T_r — a path outside T_r cannot start anything new on r.

Then no action outside T_r, now or on any path from s that avoids T_r, is dependent on one in it: decode's
steps touch decode, the registry, the fence of r's engine (which ``post`` does not read), and *push onto*
decode->r or *pop* r->decode — a push and a pop of one FIFO commute and neither disables the other (nor, under
the channel capacity, does the pop: it only makes room; r->decode is pushed by r alone); the other ranks'
steps touch their own parts. Every shared counter the steps move (the event sequence, virtual time, page
generations of another pool, channel statistics) is one the fingerprint ignores or names by appearance. So
T_r(s) is **persistent** (Godefroid 1996, def. 4.1). It is also made of **owed** actions only.

**What that preserves.**

* *Terminal states* (no owed action: the liveness checks ``held_for_ever``, ``leak``): a path from s to one
  must take an action of T_r (each stays enabled and owed off T_r), and the first such one commutes to the
  front, so by induction on the path's length every terminal state reachable is reached.
* *Safety violations.* Take a path from s to a first bad state b. If it takes an action of T_r, commute the
  first to the front (shorter remaining path). If not, t(b) is reached from t(s) by the same actions, for t
  in T_r, and **t(b) is still bad**: the only violations a local step of r could repair are r's own
  (``prefill_window`` of r — a higher floor prunes a record below it —, r's source pages' stale reads,
  bad frees and free list, a pending write of r's engine reading a freed source page), and none of those
  can change on a path that avoids T_r (no delivery into r, by 3; no write of r's engine pending, by 2,
  and none posted but by r; no crash, by 1) — they were fine in s, which was checked. Every other
  invariant reads what a local step of r does not write, except the pending writes it *adds* (which can
  break ``freed_while_writing``, never mend it).
  The remaining path then has the same length, but the **cycle proviso** bounds how long that can go on:
  a reduced state's successors in T_r must all be one level deeper than it (new, or found already at that
  level), otherwise it is fully expanded. Along every cycle of the explored graph the breadth-first depth
  cannot only rise, so each cycle has an edge to a state no deeper than its source, and that source was
  fully expanded (Bosnacki & Holzmann's proviso for breadth-first search). The sequence of states the
  argument follows would cycle, and at the fully expanded one the path shortens.
  An exception raised by the protocol's code is found the same way (an action independent of t raises
  after t as before it).
* An action whose result is pruned by the channel capacity is not enabled (the pruned graph is the one
  checked), and persistence there needs every action of T_r enabled: the explorer then expands fully too.

**A second kind of set: one quiet delivery into decode.** A delivery of the head of r->decode is *quiet*
in s when decode's handler changes nothing the fingerprint holds — only statistics, and the
Waiting -> Transferring step the fingerprint folds (every decision treats the two alike) — and stays quiet
on every path from s that does not take it: a reply to an older decode life (lives only rise) or naming a
peer it did not come from (the transport's identity); a reply for a room decode no longer holds (a room
number never comes back) or holds as succeeded or failed (neither comes back to life); a TransferStarted
for a request waiting or transferring;
a TransferDone from a rank already done (``done_peers`` only grows) or from a non-owner (``told`` and the
incarnations are fixed from the announce on); a TransferFailed from a non-owner; an AbortAck whose room is
gone, not aborted (its future token is fresh), of another abort's token or from a rank no longer awaited
(the token is set once, ``unacked`` only shrinks). ``{t}`` for such a t is persistent under condition 1
(only a drop, duplicate, reorder or misaddress of r->decode reads its head; decode_restart turns the
reply into an older life's, still quiet) and while the unreachable fence is off (its timer reads
``heard``, which every delivery moves): every other action pushes onto a tail, pops another queue or
touches another process, and commutes with t (the pop only makes room under the channel capacity).
Terminal states are kept as above (t stays enabled and owed off the set), and so are violations: t
changes no hashed state an invariant reads (the channel queues are read by none). Unlike ``T_r`` it
crosses requests: a quiet reply for one room is ordered once against the other room's steps. Where the
test leans on a guarded method (the transport's identity, ``owners-only``'s membership), it asks the
method in force or gives up, so a guard switched off is checked as it behaves.

**What it does not preserve: the shortest counterexample.** A violation found under the reduction may not
be at the least depth (the reduced graph skips orders). The result says so (``shortest: false`` where a
state was reduced); ``--shortest`` (or ``run_check(replace(bounds, por=False, max_depth=n))``) re-runs
without it to that depth, which gives a breadth-first, hence shortest, trace.

Any other pending event (a protocol step added later, e.g. the cluster's lease renewal) switches the
reduction off in that state until its footprint is added here.

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
    """A quiet delivery into decode, else the smallest ``T_r`` of the module docstring that is persistent in
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


# the pending events whose footprints the module docstring covers: decode's timers (decode, the registry, the
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
