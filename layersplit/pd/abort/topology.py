"""LayerSplit prefill topology: prefill CP rank ``r`` writes only the layers it owns, for every page of
every request, so decode holds a request's pages until **every** rank acknowledged.

The ownership is plain data (``layers_by_rank[r]`` = the layers rank r owns); ``pd`` never imports
``layersplit`` — the CLI passes ``layersplit.plan.ownership.plan_ownership(...)``'s answer in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class PrefillTopology:
    layers_by_rank: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        owned = tuple(tuple(int(layer) for layer in layers) for layers in self.layers_by_rank)
        object.__setattr__(self, "layers_by_rank", owned)  # accept lists (the CLI's plain data)
        if not owned or any(not layers for layers in owned):
            raise ValueError(f"layers_by_rank: expected >= 1 rank, each owning >= 1 layer, got {owned}")
        flat = sorted(layer for layers in owned for layer in layers)
        if flat != list(range(len(flat))):
            raise ValueError(f"layers_by_rank: expected layers 0..{len(flat) - 1} each owned by exactly one "
                             f"rank, got {owned}")

    @classmethod
    def of(cls, layers_by_rank: Sequence[Sequence[int]]) -> "PrefillTopology":
        return cls(tuple(tuple(layers) for layers in layers_by_rank))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(len(self.layers_by_rank)))

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers in self.layers_by_rank)

    def last_layer_fraction(self, rank: int) -> float:
        """How far through the forward pass rank ``rank``'s last owned layer is computed."""
        return (max(self.layers_by_rank[rank]) + 1) / self.num_layers
