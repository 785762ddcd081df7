"""Coding-agent workload and per-mode tier capacities for the sweep.

Each session has a reusable prefix of ``(1 - new_fraction) * L`` tokens (repository files, system
prompt, earlier turns) and every turn appends ``new_fraction * L`` new tokens. Requests arrive as a
seeded random sequence of sessions, so how many sessions stay resident decides the hit tiers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from layersplit.capacity import PAGE_SIZE, scratch_pages_for
from layersplit.config import ModelConfig
from layersplit.ownership import plan_ownership
from layersplit.serving import Capacity, Req


def make_requests(length: int, new_fraction: float, sessions: int, requests: int, seed: int) -> list[Req]:
    new = max(1, round(length * new_fraction))
    rng = random.Random(seed)
    return [Req(rng.randrange(sessions), length - new, new) for _ in range(requests)]


@dataclass(frozen=True)
class ModeBytes:
    """Per-rank cache bytes per token of one mode, and the layers each rank keeps."""

    mode: str
    bytes_per_token: int  # worst rank
    held_layers: tuple[tuple[int, ...], ...]  # per rank
    scratch_bytes: int


def mode_bytes(model: ModelConfig, cp: int, kv_dtype: str, mode: str, max_batch_context: int,
               max_batch_requests: int) -> ModeBytes:
    per_layer = [model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers)]
    if mode == "redundant":
        every = tuple(range(model.num_layers))
        return ModeBytes(mode, sum(per_layer), (every,) * cp, 0)
    own = plan_ownership(model.num_layers, cp)
    held = tuple(own.owned_layers(r) for r in range(cp))
    scratch = 2 * scratch_pages_for(max_batch_context, max_batch_requests) * PAGE_SIZE * max(per_layer) if cp > 1 else 0
    return ModeBytes(mode, max(sum(per_layer[layer] for layer in h) for h in held), held, scratch)


def capacity(mb: ModeBytes, device_bytes: float, host_bytes: float) -> Capacity:
    """Tokens per rank in L1 (device budget minus scratch) and L2 (host tier)."""
    l1 = int((device_bytes - mb.scratch_bytes) // mb.bytes_per_token)
    if l1 <= 0:
        raise ValueError(f"device budget: expected more than the scratch ({mb.scratch_bytes} B), got {device_bytes:.0f} B")
    return Capacity(l1, int(host_bytes // mb.bytes_per_token))
