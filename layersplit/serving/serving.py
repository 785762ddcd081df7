"""Serving loop shared by the sweep's engines: prefix-cache tiers, admission, batching, eviction.

Per rank and mode the loop knows its device (L1) and host (L2) capacity in tokens. Requests arrive
in a seeded order; each belongs to a coding-agent session whose cached prefix is the reusable 90%.
For every request the loop decides where the prefix is:

* ``L1`` — resident on the device: nothing to move;
* ``L2`` — in the host tier: reloaded layer by layer (HiCache); each rank reloads the layers it
  keeps (redundant: all L; layersplit: its owned layers);
* ``miss`` — gone: the prefix is recomputed with the new tokens.

A batch takes requests in arrival order while its new tokens (recomputed prefixes included) fit
``max_batch_tokens``, its context fits ``max_batch_context`` (the LayerSplit scratch size), it has
at most ``max_batch_requests`` requests, and L1 can hold every request of the batch (prefix + new tokens), evicting
least-recently-used sessions L1 -> L2 -> gone; sessions in the running batch are never evicted. New
tokens are not kept after the batch (tool output is not reused). Engines only *time* the batches;
everything counted here is engine-independent.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capacity:
    l1_tokens: int  # device tokens per rank available to cached prefixes and running requests
    l2_tokens: int  # host-tier tokens per rank


@dataclass(frozen=True)
class Req:
    session: int
    prefix: int  # reusable cached tokens
    new: int  # tokens appended this turn


@dataclass
class Served:
    req: Req
    tier: str  # 'L1' | 'L2' | 'miss'

    @property
    def prefill_tokens(self) -> int:
        """Tokens the batch computes for this request (a miss recomputes its prefix)."""
        return self.req.new + (self.req.prefix if self.tier == "miss" else 0)


@dataclass
class Batch:
    served: list[Served] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.served)

    @property
    def context(self) -> int:
        return sum(s.req.prefix + s.req.new for s in self.served)

    def tokens(self, tier: str) -> int:
        return sum(s.req.prefix for s in self.served if s.tier == tier)


class ServingLoop:
    def __init__(self, cap: Capacity, max_batch_tokens: int, max_batch_context: int | None = None,
                 max_batch_requests: int | None = None) -> None:
        if cap.l1_tokens <= 0:
            raise ValueError(f"l1_tokens: expected > 0, got {cap.l1_tokens}")
        self.cap, self.max_batch_tokens = cap, max_batch_tokens
        self.max_batch_context = max_batch_context or 1 << 62
        self.max_batch_requests = max_batch_requests or 1 << 62
        self.l1: OrderedDict[int, int] = OrderedDict()  # session -> prefix tokens (LRU first)
        self.l2: OrderedDict[int, int] = OrderedDict()
        self.evictions: list[tuple[str, int]] = []  # ('L1->L2' | 'L2->gone' | 'L1->gone', session)
        self.peak_l1 = 0

    def _l1_used(self, running: int) -> int:
        return sum(self.l1.values()) + running

    def _evict_l1(self, need: int, running: int, locked: set[int]) -> bool:
        """Free L1 until ``need`` more tokens fit; LRU first, never a locked session."""
        for session in [s for s in self.l1 if s not in locked]:
            if self._l1_used(running) + need <= self.cap.l1_tokens:
                break
            tokens = self.l1.pop(session)
            self._to_l2(session, tokens)
        return self._l1_used(running) + need <= self.cap.l1_tokens

    def _to_l2(self, session: int, tokens: int) -> None:
        if tokens > self.cap.l2_tokens:
            self.evictions.append(("L1->gone", session))
            return
        while sum(self.l2.values()) + tokens > self.cap.l2_tokens:
            gone, _ = self.l2.popitem(last=False)
            self.evictions.append(("L2->gone", gone))
        self.l2[session] = tokens
        self.evictions.append(("L1->L2", session))

    def _admit(self, req: Req, batch: Batch, running: int, locked: set[int]) -> int | None:
        """Place ``req`` in ``batch``; returns the L1 tokens it now occupies, or None if it must wait."""
        tier = "L1" if req.session in self.l1 else "L2" if req.session in self.l2 else "miss"
        need = req.new + (0 if tier == "L1" else req.prefix)
        served = Served(req, tier)
        if batch.served and (batch.new_tokens + served.prefill_tokens > self.max_batch_tokens
                             or batch.context + req.prefix + req.new > self.max_batch_context
                             or len(batch.served) >= self.max_batch_requests):
            return None
        held = self.l2.pop(req.session) if tier == "L2" else None  # moving up: not an L2 eviction victim
        if not self._evict_l1(need, running, locked | {req.session}):
            if held is not None:
                self.l2[req.session] = held
            return None
        self.l1[req.session] = req.prefix
        self.l1.move_to_end(req.session)
        batch.served.append(served)
        locked.add(req.session)
        return req.new

    def run(self, requests: list[Req]) -> list[Batch]:
        """Serve ``requests`` in order; returns the batches."""
        prefix: dict[int, int] = {}
        for r in requests:  # a session's cached prefix is one fixed span of tokens
            if prefix.setdefault(r.session, r.prefix) != r.prefix:
                raise ValueError(f"session {r.session}: expected one prefix length per session, "
                                 f"got {prefix[r.session]} and {r.prefix}")
        batches, pending = [], list(requests)
        while pending:
            batch, running, locked = Batch(), 0, set()
            while pending:
                used = self._admit(pending[0], batch, running, locked)
                if used is None:
                    break
                running += used
                self.peak_l1 = max(self.peak_l1, self._l1_used(running))
                pending.pop(0)
            if not batch.served:
                raise ValueError(f"request of {pending[0].prefix + pending[0].new} tokens: expected it to fit L1 "
                                 f"({self.cap.l1_tokens} tokens per rank), got no room even with an empty cache")
            batches.append(batch)
        return batches
