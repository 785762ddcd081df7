"""Decode's view of its prefill ranks' health: the bootstrap registry is the failure detector.

* A rank registers (again): a live request addressed to an older process of it (resolved while the
  registry was stale) is re-addressed, and every abort waiting on it is re-sent at once — quarantine
  heals the moment the rank is back, not at the next backoff timer.
* A lease expires: ``fence_after_s`` later, unless the rank registered again meanwhile, its processes up
  to that incarnation are **fenced** — the registration torn down first (the transfer engine refuses their
  writes from then on), then every request waiting only on them released (a live one is aborted).

It holds no state of its own: everything it reads and changes is the :class:`~pd.abort.decode_side.DecodeNode`'s.
"""

from __future__ import annotations

import logging

from pd.abort.decode_request import TRANSFERRING, WAITING

log = logging.getLogger("pd.abort.decode_side")  # one logger for decode's warnings


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

    def fence(self, rank: int, incarnation: int) -> None:
        """Declare ``rank``'s processes up to ``incarnation`` dead: tear down their registration first
        (the engine refuses their writes from now on), then release what waited only on them."""
        node = self.node
        if node.fence_writer is not None:
            node.fence_writer(rank, incarnation)
        node.registry.revoke(rank, incarnation)
        node.fenced[rank] = max(node.fenced[rank], incarnation)
        node.fences.append((rank, incarnation, node.loop.now))
        node.stats["fences"] += 1
        log.warning("prefill%d: incarnations <= %d fenced (lease expired %.1f s ago)", rank, incarnation,
                    node.cfg.fence_after_s or 0.0)
        for req in list(node.reqs.values()):
            if rank not in req.told or req.incarnations[rank] > incarnation:
                continue
            if node._abortable(req):
                node.abort(req, "fenced")  # it can never complete; the fenced rank is not waited for
            elif rank in req.unacked and node.current(req):
                node.stats["released_by_fence"] += 1
                node.acked(req, rank)
