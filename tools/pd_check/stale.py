"""Stale events: pending events whose firing can change nothing, now or ever — a decode timer of a
request decode no longer holds (or no longer in the state the timer serves), a prefill step of a dead
incarnation or of a request that stopped posting, the lease expiry of an incarnation the registry has
moved past. Each guard below is the first line of the handler it mirrors, and each condition is
permanent (rooms are never reused, states and incarnations only move forward, the flags only get set).

The checker neither fires them nor hashes them (a reduction: a state with a stale event pending
behaves exactly like the same state without it), and hashes a request decode no longer holds by its
name only — no handler reads anything else of it again."""

from __future__ import annotations

from layersplit.pd.abort.decode_side import BOOTSTRAPPING, LIVE, TRANSFERRING, WAITING, DecodeNode
from layersplit.pd.abort.prefill_side import PrefillNode

_DECODE_TIMERS = ("_resolve", "_timeout", "_poll", "send_aborts", "_finish", "_queue_timeout")


def stale(cluster, event: tuple) -> bool:
    """Can firing ``event`` (a pending ``(time, seq, fn, args)``) never change anything?"""
    fn, args = event[2], event[3]
    name, target = getattr(fn, "__name__", ""), getattr(fn, "__self__", None)
    if isinstance(target, DecodeNode) and name in _DECODE_TIMERS:
        req = args[0]
        if target.reqs.get(req.room) is not req:
            return True  # every decode timer returns at once for a request decode no longer holds
        return ((name == "_resolve" and req.state != BOOTSTRAPPING)
                or (name == "_poll" and req.state not in (WAITING, TRANSFERRING))
                or (name == "_timeout" and req.state not in LIVE)
                or (name == "_queue_timeout" and (bool(req.pages) or req.state not in LIVE)))
    if isinstance(target, PrefillNode) and name in ("_computed", "_post"):
        req = args[0]
        dead = not (target.alive and req.incarnation == target.incarnation)
        return dead or (name == "_post" and (req.aborted or req.failed))
    if name == "unreachable" and target is cluster.decode.health:
        req = args[0]  # RankHealth.unreachable returns at once for a request decode no longer holds or that is acked
        return cluster.decode.reqs.get(req.room) is not req or not req.unacked
    if name == "renew" and target is cluster:
        node = cluster.prefills[args[0]]  # that process went down (or was never up): nothing heartbeats, ever
        return not (node.up and node.incarnation == args[1])
    if name == "expire" and target is cluster.registry:
        return cluster.registry.serving(args[0]) != args[1]  # incarnations only grow: it never matches again
    return False
