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
    """(bounds, trace, the violation recorded) from a file ``save_counterexample`` wrote; a file that is not
    one (not UTF-8, not JSON, a key missing, bad bounds, no step) is a ``ValueError`` naming it."""
    from lsconfig.config_io import read_json

    doc = read_json(Path(path))  # UTF-8 and JSON errors name the file (and the line)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a counterexample file (a JSON object), got {type(doc).__name__}")
    for key in ("bounds", "trace", "violation"):
        if key not in doc:
            raise ValueError(f"{path}: expected a counterexample file with {key!r}, got keys {sorted(doc)}")
    if not isinstance(doc["trace"], list) or not doc["trace"]:
        raise ValueError(f"{path}: expected a counterexample with at least one step, got trace {doc['trace']!r}")
    if not isinstance(doc["bounds"], dict):
        raise ValueError(f"{path}: expected 'bounds' to be an object, got {doc['bounds']!r}")
    try:
        bounds = CheckBounds.from_dict(doc["bounds"])
    except TypeError as exc:  # an unknown or missing bound: the dataclass's own message
        raise ValueError(f"{path}: field 'bounds': expected the bounds a search saved, got {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: field 'bounds': {exc}") from None
    return bounds, list(doc["trace"]), list(doc["violation"])
