"""The public entry points behind ``import layersplit``: each takes plain arguments (config names,
numbers), checks them before any work, and returns plain data.

- :func:`plan_capacity` — KV capacity per CP rank of every layout (what ``layersplit plan --json`` prints);
- :func:`prefill` — one CP prefill on real rank processes, checked against the single-process reference
  (:func:`layersplit.engine.prefill.prefill`);
- :func:`sweep` — the 40k-120k sweep at 90% prefix reuse, optionally writing its files as it goes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from layersplit.engine.prefill import PrefillReport, prefill
from layersplit.plan.capacity import PlanRequest, capacity_plan
from layersplit.plan.config import load_hardware, load_model


def plan_capacity(model: str = "glm-5", hardware: str = "h200", *, cp: int = 8, **options) -> dict:
    """Capacity of every layout for ``model`` on ``cp`` x ``hardware``; ``options`` are the fields of
    :class:`layersplit.plan.capacity.PlanRequest` (``kv_dtype``, ``max_batch_tokens``, ``context_len``,
    ``mem_fraction``, ``weight_dtype``, ``weight_shards``, ``ownership``, ``weight_placement``, ...)."""
    unknown = sorted(set(options) - set(PlanRequest.__dataclass_fields__) - {"cp"})
    if unknown:
        raise TypeError(f"plan_capacity: unexpected option(s) {unknown}; expected fields of PlanRequest")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp: expected an integer >= 1, got {cp!r}")
    return capacity_plan(load_model(model), load_hardware(hardware), PlanRequest(cp=cp, **options))


RESULT_FILES = ("points.jsonl", "table.md", "throughput.png", "gain_map.md", "gain_map.png")


def check_out(out: str | Path, force: bool = False) -> Path:
    """``out`` is usable as a sweep's results folder: not a file, and holding no earlier sweep's results
    unless ``force`` (a sweep never overwrites results without being told to)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"expected a folder, got the file {str(folder)!r}")
    held = [name for name in RESULT_FILES if (folder / name).exists()] if folder.is_dir() else []
    if held and not force:
        raise ValueError(f"{folder} already holds a sweep's results ({', '.join(held)}); pass --force "
                         "(force=True) to replace them, or choose another folder")
    return folder


def sweep(config: str | Path = "cpu", *, engine: str | None = None, out: str | Path | None = None,
          progress=None, force: bool = False) -> list[dict]:
    """Run the sweep ``config`` (a name under ``configs/sweeps`` or a YAML path; ``engine`` overrides
    its ``real``/``model`` engine) and return its points. With ``out``, ``points.jsonl`` grows as each
    length finishes and ``table.md`` + ``throughput.png`` are written at the end; a folder that holds
    earlier results is refused unless ``force``. ``progress(n)``: told as points finish."""
    import json

    from layersplit.serving.sweep import run_sweep, write_outputs
    from layersplit.serving.sweep_config import ENGINES, load_sweep

    if progress is not None and not callable(progress):
        raise ValueError(f"progress: expected a callable or None, got {progress!r}")
    if not isinstance(force, bool):
        raise ValueError(f"force: expected True or False, got {force!r}")
    if out is not None:
        try:
            check_out(out, force)
        except ValueError as exc:
            raise ValueError(f"out: {exc}") from None
    cfg = load_sweep(config)
    if engine is not None:
        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
        cfg = replace(cfg, engine=engine)
    on_length = None
    if out is not None:
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        stream = folder / "points.jsonl"
        stream.write_text("")

        def on_length(points: list[dict]) -> None:
            with stream.open("a") as f:
                f.write("".join(json.dumps(p) + "\n" for p in points))

    points = run_sweep(cfg, progress=progress, on_length=on_length)
    if out is not None:
        write_outputs(points, cfg, Path(out))
    return points


__all__ = ["PrefillReport", "plan_capacity", "prefill", "sweep"]
