"""Counterexamples as text (numbered steps, then what broke) and as JSON files a replay reads."""

from __future__ import annotations

import json
from pathlib import Path

from tools.pd_check.bounds import CheckBounds


def format_trace(counterexample: dict) -> str:
    """``counterexample`` (a result's) as readable lines: one numbered step each, then the violation."""
    lines = [f"{i:>3}. {step}" for i, step in enumerate(counterexample["trace"], 1)]
    lines += [f"  => VIOLATION {v}" for v in counterexample["violation"]]
    return "\n".join(lines)


def save_counterexample(path: str | Path, result: dict) -> None:
    """Write ``result``'s counterexample with its bounds (what ``load_counterexample`` / a replay reads)."""
    if not result.get("counterexample"):
        raise ValueError("result: expected a result with a counterexample, got one without")
    doc = {"bounds": result["bounds"], **result["counterexample"]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_counterexample(path: str | Path) -> tuple[CheckBounds, list[str], list[str]]:
    """(bounds, trace, the violation recorded) from a file ``save_counterexample`` wrote."""
    doc = json.loads(Path(path).read_text())
    for key in ("bounds", "trace", "violation"):
        if key not in doc:
            raise ValueError(f"{path}: expected a counterexample file with {key!r}, got keys {sorted(doc)}")
    return CheckBounds.from_dict(doc["bounds"]), list(doc["trace"]), list(doc["violation"])
