"""The explorer's state hasher: :func:`~tools.pd_check.state.fingerprint` with a memo.

With the symmetry reduction a fingerprint is the least hash over the candidate renamings of ranks and
request ids (:func:`~tools.pd_check.state.symmetries`: those that sort a naming-independent key; one for
most states, at most 4 at 2 ranks x 2 requests). Where the identity is one of several candidates, the
plain canonical hash is computed first and, if it was seen before, its fingerprint is reused: most
revisits reach a state *literally* (the same world, not a renamed one). Same fingerprints as
``fingerprint``, only fewer computed.
"""

from __future__ import annotations

from tools.pd_check.state import canonical, symmetries


class Hasher:
    def __init__(self, symmetry: bool, stale_events: bool) -> None:
        self.symmetry, self.stale_events = symmetry, stale_events
        self.memo: dict[int, int] = {}  # plain canonical hash -> fingerprint (symmetry only)

    def __call__(self, world) -> int:
        if not self.symmetry:
            return hash(canonical(world, stale_events=self.stale_events))
        renamings = symmetries(world)
        identity = renamings[0] == (tuple(range(len(world.cluster.prefills))), tuple(range(world.bounds.requests)))
        if not identity or len(renamings) == 1:  # one canonical form per candidate: nothing for a memo to save
            return min(hash(canonical(world, r, q, self.stale_events)) for r, q in renamings)
        plain = hash(canonical(world, stale_events=self.stale_events))
        fp = self.memo.get(plain)
        if fp is None:
            fp = min([plain] + [hash(canonical(world, r, q, self.stale_events)) for r, q in renamings[1:]])
            self.memo[plain] = fp
        return fp
