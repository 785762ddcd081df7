"""The text heuristic the monitor replaces: a charset check for garbled output and a regex for repetition.

* garbled: more than ``rare_fraction_above`` of the characters so far are outside printable ASCII
  (plus newline and tab), once at least ``min_chars`` characters exist;
* repetition: some 1..``max_unit``-character unit repeats ``min_repeats`` times back to back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION


@dataclass(frozen=True)
class TextBaseline:
    rare_fraction_above: float = 0.02
    min_chars: int = 64
    max_unit: int = 16
    min_repeats: int = 8

    @cached_property
    def _repeat(self) -> re.Pattern:
        return re.compile(r"(.{1,%d}?)\1{%d,}" % (self.max_unit, self.min_repeats - 1), re.DOTALL)

    def judge(self, text: str) -> str:
        """``healthy``, ``garbled`` or ``repetition`` for the text generated so far."""
        if len(text) >= self.min_chars:
            rare = sum(1 for ch in text if not (" " <= ch <= "~" or ch in "\n\t"))
            if rare > self.rare_fraction_above * len(text):
                return GARBLED
        if self._repeat.search(text):
            return REPETITION
        return HEALTHY
