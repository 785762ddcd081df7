"""Prefill requests from plain arguments: ``n`` requests of ``context`` tokens whose first
``hit`` share is already cached (the prefix), the rest new tokens drawn from a seeded generator."""

from __future__ import annotations

import torch

from layersplit.engine.batch_plan import Request


def synthetic_requests(n: int, context: int, hit: float, vocab: int, seed: int = 0,
                       from_host: bool = False) -> list[Request]:
    """``n`` requests of ``context`` tokens, ``int(context * hit)`` of them a cached prefix; the new
    tokens are ids in ``[0, vocab)`` from ``torch.Generator().manual_seed(seed)`` (same seed, same
    requests on every rank and in the reference). ``from_host``: the prefixes sit in the host tier
    and are reloaded layer by layer during the prefill."""
    for name, value, low in (("n", n, 1), ("context", context, 1), ("vocab", vocab, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    if not (isinstance(hit, (int, float)) and 0 <= hit < 1):
        raise ValueError(f"hit: expected a number in [0, 1), got {hit!r}")
    g = torch.Generator().manual_seed(seed)
    prefix = int(context * hit)
    return [Request(prefix, tuple(torch.randint(0, vocab, (context - prefix,), generator=g).tolist()), from_host)
            for _ in range(n)]
