"""The explorer's state hasher: :func:`~pd.abort.check.state.fingerprint` with a memo.

With the symmetry reduction a fingerprint is the least hash over every renaming of ranks and request ids
(4 canonical forms at 2 ranks x 2 requests). Most explored transitions reach a state already seen, and
most of those reach it *literally* (the same world, not a renamed one), so the plain canonical hash
(the identity renaming) is computed first and, if it was seen before, its fingerprint is reused: one
canonical form instead of 4 for a revisit. Same fingerprints as ``fingerprint``, only fewer computed.
"""

from __future__ import annotations

from pd.abort.check.state import canonical, symmetries


class Hasher:
    def __init__(self, symmetry: bool, stale_events: bool) -> None:
        self.symmetry, self.stale_events = symmetry, stale_events
        self.memo: dict[int, int] = {}  # plain canonical hash -> fingerprint (symmetry only)

    def __call__(self, world) -> int:
        plain = hash(canonical(world, stale_events=self.stale_events))
        if not self.symmetry:
            return plain
        fp = self.memo.get(plain)
        if fp is None:
            renamings = symmetries(world)[1:]  # the first is the identity: ``plain``
            fp = min([plain] + [hash(canonical(world, r, q, self.stale_events)) for r, q in renamings])
            self.memo[plain] = fp
        return fp
