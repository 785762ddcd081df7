"""When decode re-sends an unacknowledged ``Abort``: capped exponential backoff with jitter, bounded.

Send ``n`` (1-based) is followed by a wait of ``min(max_s, first_s * multiplier**(n-1))`` scaled by a
uniform factor in ``[1 - jitter, 1]`` (jitter spreads the re-sends of an abort storm). After
``max_sends`` sends and one more wait the pages are quarantined and the re-sends stop, so a dead
peer cannot keep the event loop alive.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AbortBackoff:
    first_s: float = 0.05
    multiplier: float = 2.0
    max_s: float = 1.0
    jitter: float = 0.5
    max_sends: int | None = 30  # None: UNSAFE, re-send forever (the old behaviour; never ends with a dead peer)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"delays: expected 0 < first_s <= max_s, got {self.first_s}, {self.max_s}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier: expected >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter: expected a fraction in [0, 1), got {self.jitter}")
        if self.max_sends is not None and self.max_sends < 1:
            raise ValueError(f"max_sends: expected an integer >= 1 or None, got {self.max_sends}")

    def delay(self, sends: int, rng: random.Random) -> float:
        """The wait after the ``sends``-th send."""
        base = min(self.max_s, self.first_s * self.multiplier ** min(sends - 1, 64))  # 64: no float overflow
        return base * (1 - self.jitter * rng.random())

    def exhausted(self, sends: int) -> bool:
        return self.max_sends is not None and sends >= self.max_sends
