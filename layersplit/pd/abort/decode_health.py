"""Decode's view of its prefill ranks' health: the bootstrap registry is the failure detector.

* A rank registers (again): a live request addressed to an older process of it (resolved while the
  registry was stale) is re-addressed, and every abort waiting on it is re-sent at once — quarantine
  heals the moment the rank is back, not at the next backoff timer.
* A lease expires: ``fence_after_s`` later, unless the rank registered again meanwhile, its processes up
  to that incarnation are **fenced** — the registration torn down first (the transfer engine refuses their
  writes from then on), then every request waiting only on them released (a live one is aborted).

* An abort stays unacknowledged ``fence_unreachable_s`` by a rank that still holds its lease and sent
  nothing meanwhile (decode's control link to it is cut; the bootstrap server still hears it): that
  serving process is fenced the same way, and told *revoked* at its next heartbeat it exits — the rank
  comes back as a newer incarnation.

It holds no state of its own: everything it reads and changes is the :class:`~layersplit.pd.abort.decode_side.DecodeNode`'s.
"""

from __future__ import annotations

import logging

from layersplit.pd.abort.decode_request import TRANSFERRING, WAITING

log = logging.getLogger("layersplit.pd.abort.decode_side")  # one logger for decode's warnings


class RankHealth:
    def __init__(self, node) -> None:  # a DecodeNode (not imported: it imports this)
        self.node = node

    def changed(self, rank: int, incarnation: int | None, expired: int | None = None) -> None:
        node = self.node
        if incarnation is not None:
            self._readdress(rank, incarnation)
            self._resume(rank)
        elif node.cfg.fence_after_s is not None and expired is not None:
            node.loop.after(node.cfg.fence_after_s, self._suspect, rank, expired)

    def _readdress(self, rank: int, incarnation: int) -> None:
        """A newer process of ``rank`` serves: a live request addressed to an older one (resolved while
        the registry was stale) is re-sent to it. Safe: the new process served only once every write of
        its previous lives had drained, so nothing of theirs can land any more."""
        node = self.node
        for req in [r for r in node.reqs.values() if r.state in (WAITING, TRANSFERRING)]:
            if rank in req.told and rank not in req.done_peers and req.incarnations[rank] < incarnation:
                req.incarnations = req.incarnations[:rank] + (incarnation,) + req.incarnations[rank + 1:]
                node.send_transfers(req, (rank,))

    def _resume(self, rank: int) -> None:
        """``rank`` registered (again): re-send every abort that waits on it now, not at the next timer."""
        node = self.node
        if node.cfg.unsafe_terminal_quarantine:
            return
        for req in [r for r in node.reqs.values() if rank in r.unacked]:
            node.stats["resumed_sends"] += 1
            node.send_abort(req, rank)
            if not req.resend_armed:
                req.resend_armed = True
                node.loop.after(node.cfg.abort_backoff.delay(max(req.sends, 1), node.rng), node.send_aborts, req)

    def _suspect(self, rank: int, incarnation: int) -> None:
        """``incarnation``'s lease expired ``fence_after_s`` ago: unless the rank came back, fence it."""
        node = self.node
        if node.registry.serving(rank) is not None:
            return  # a newer process serves: it drained every write of its previous lives first
        self.fence(rank, incarnation)

    def watch_unacked(self, req) -> None:
        """Arm ``req``'s unreachable timer: ``fence_unreachable_s`` from now, counting what is heard meanwhile."""
        node = self.node
        req.heard = tuple(node.heard)
        node.loop.after(node.cfg.fence_unreachable_s, self.unreachable, req)

    def unreachable(self, req) -> None:
        """``req``'s abort went unacknowledged ``fence_unreachable_s``: fence every rank it still waits for
        whose serving process holds its lease (an expired one is the lease path's: ``_suspect``) and that
        sent decode nothing meanwhile. A rank heard from is reachable (draining, or its ack was lost): the
        timer is armed again, so a link cut later is still caught."""
        node = self.node
        if not node.current(req) or not req.unacked:
            return  # released meanwhile
        for rank in sorted(req.unacked):
            serving = node.registry.serving(rank)
            if serving is None or node.heard[rank] != req.heard[rank] or not node.current(req):
                continue  # down (the lease path fences it), heard from, or released by a fence already
            node.stats["unreachable_fences"] += 1
            self.fence(rank, serving, f"abort of room {req.room} unacknowledged and nothing heard for "
                                      f"{node.cfg.fence_unreachable_s:.1f} s, lease still held")
        if node.current(req) and req.unacked:
            self.watch_unacked(req)

    def fence(self, rank: int, incarnation: int, why: str | None = None) -> None:
        """Declare ``rank``'s processes up to ``incarnation`` dead: tear down their registration first
        (the engine refuses their writes from now on), then release what waited only on them."""
        node = self.node
        if node.fence_writer is not None:
            node.fence_writer(rank, incarnation)
        node.registry.revoke(rank, incarnation)
        node.fenced[rank] = max(node.fenced[rank], incarnation)
        node.fences.append((rank, incarnation, node.loop.now))
        node.stats["fences"] += 1
        log.warning("prefill%d: incarnations <= %d fenced (%s)", rank, incarnation,
                    why or f"lease expired {node.cfg.fence_after_s or 0.0:.1f} s ago")
        for req in list(node.reqs.values()):
            if rank not in req.told or req.incarnations[rank] > incarnation:
                continue
            if node._abortable(req):
                node.abort(req, "fenced")  # it can never complete; the fenced rank is not waited for
            elif rank in req.unacked and node.current(req):
                node.stats["released_by_fence"] += 1
                node.acked(req, rank)
