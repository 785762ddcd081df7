"""Coding-agent workload and per-mode tier capacities for the sweep (bytes per mode: ``capacity.mode_bytes``).

Each session has a reusable prefix of ``(1 - new_fraction) * L`` tokens (repository files, system
prompt, earlier turns) and every turn appends ``new_fraction * L`` new tokens. Requests arrive as a
seeded random sequence of sessions, so how many sessions stay resident decides the hit tiers.
"""

from __future__ import annotations

import random

from layersplit.plan.capacity import ModeBytes
from layersplit.serving.serving import Capacity, Req


def make_requests(length: int, new_fraction: float, sessions: int, requests: int, seed: int) -> list[Req]:
    new = max(1, round(length * new_fraction))
    rng = random.Random(seed)
    return [Req(rng.randrange(sessions), length - new, new) for _ in range(requests)]


def capacity(mb: ModeBytes, device_bytes: float, host_bytes: float) -> Capacity:
    """Tokens per rank in L1 (device budget minus scratch) and L2 (the host tier: this rank's host
    budget holds its held layers; with a shared host, the ranks' budgets pool into one copy)."""
    l1 = int((device_bytes - mb.scratch_bytes) // mb.bytes_per_token)
    if l1 <= 0:
        raise ValueError(f"device budget: expected more than the scratch ({mb.scratch_bytes} B), got {device_bytes:.0f} B")
    host_per_token = mb.host_bytes_per_token or mb.bytes_per_token
    return Capacity(l1, int(host_bytes * mb.host_pooled_ranks // host_per_token))
