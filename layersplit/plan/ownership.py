"""Which CP rank owns (stores the KV cache of) each layer.

``contiguous`` matches upstream SGLang's layer-split pool: rank r owns one block of consecutive
layers, the first ``L % N`` ranks one layer more. ``round-robin`` gives layer l to rank ``l % N``,
which spreads the owners of neighbouring layers (useful when prefetching one layer ahead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from layersplit.plan.choices import STRATEGIES  # re-exported


@dataclass(frozen=True)
class OwnershipPlan:
    num_layers: int
    cp_size: int
    owner: tuple[int, ...]  # owner[layer] = rank

    def owned_layers(self, rank: int) -> tuple[int, ...]:
        return tuple(layer for layer, r in enumerate(self.owner) if r == rank)

    @property
    def max_owned(self) -> int:
        """``ceil(L / N)``: layers on the most loaded rank."""
        return math.ceil(self.num_layers / self.cp_size)


def plan_ownership(num_layers: int, cp_size: int, strategy: str = "contiguous", world_size: int | None = None) -> OwnershipPlan:
    """Assign each of ``num_layers`` layers to one of ``cp_size`` ranks."""
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected an integer >= 1, got {cp_size!r}")
    if cp_size > num_layers:
        raise ValueError(f"cp_size: expected <= num_layers ({num_layers}) so every rank owns a layer, got {cp_size}")
    strategy = strategy.replace("-", "_")  # the CLI spells it round-robin
    if world_size is not None and world_size != cp_size:
        raise ValueError(f"world_size: expected the CP group size {cp_size}, got {world_size}")
    if strategy == "contiguous":
        base, extra = divmod(num_layers, cp_size)
        owner = [r for r in range(cp_size) for _ in range(base + (r < extra))]
    elif strategy == "round_robin":
        owner = [layer % cp_size for layer in range(num_layers)]
    else:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    return OwnershipPlan(num_layers, cp_size, tuple(owner))
