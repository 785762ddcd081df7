"""The public entry points behind ``import layersplit``: each takes plain arguments (config names,
numbers), checks them before any work, and returns plain data.

- :func:`plan_capacity` — KV capacity per CP rank of every layout (what ``layersplit plan --json`` prints);
- :func:`prefill` — one CP prefill on real rank processes, checked against the single-process reference
  (:func:`layersplit.engine.prefill.prefill`): the ``LAYERSPLIT_*`` variables and the memory it needs are
  checked as the CLI checks them, before any process starts; ``timeout_s`` bounds the rank processes
  (default 600 s); its :class:`PrefillReport` gives ``new_tokens_per_s`` (new tokens) and
  ``request_tokens_per_s`` (every context token, cached prefix included), both per run;
- :func:`sweep` — the 40k-120k sweep at 90% prefix reuse, optionally writing its files as it goes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dsa_kernels.layout import PAGE_SIZE
from lsconfig import envs
from layersplit.engine.prefill import PrefillReport, available_memory_bytes, cache_bytes, prefill, weight_bytes
from layersplit.plan.capacity import PlanRequest, capacity_plan
from layersplit.plan.config import check_name_or_path, load_hardware, load_model


def plan_capacity(model: str = "glm-5", hardware: str = "h200", *, cp: int = 8, **options) -> dict:
    """Capacity of every layout for ``model`` on ``cp`` x ``hardware``; ``options`` are the fields of
    :class:`layersplit.plan.capacity.PlanRequest` (``kv_dtype``, ``max_batch_tokens``, ``context_len``,
    ``mem_fraction``, ``weight_dtype``, ``weight_shards``, ``ownership``, ``weight_placement``, ...)."""
    check_name_or_path("model", model, "model")
    check_name_or_path("hardware", hardware, "hardware")
    unknown = sorted(set(options) - set(PlanRequest.__dataclass_fields__) - {"cp"})
    if unknown:
        raise TypeError(f"plan_capacity: unexpected option(s) {unknown}; expected fields of PlanRequest")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp: expected an integer >= 1, got {cp!r}")
    loaded = load_model(model)
    shards = options.get("weight_shards")
    if isinstance(shards, int) and shards > loaded.n_routed_experts:
        raise ValueError(f"weight_shards: expected <= {loaded.n_routed_experts} (the routed experts of {loaded.name} "
                         f"in each layer: expert parallelism splits whole experts), got {shards}")
    return capacity_plan(loaded, load_hardware(hardware), PlanRequest(cp=cp, **options))


def check_fits(cfg, fix: str) -> None:
    """The measured engine's peak memory for sweep ``cfg``, estimated from the config before anything is
    allocated (the same arithmetic as ``layersplit prefill``'s check): each of the ``cp`` rank processes keeps
    the engine's fp32 weights, a pool of every layer for its largest batch and the host tier's copy of it.
    Raises ``ValueError`` ending in ``fix`` (what to run instead) where that exceeds this machine's memory."""
    model = load_model(cfg.model)
    batch_tokens = max(cfg.scaled(cfg.max_batch_context), cfg.scaled(max(cfg.lengths)))  # one request always fits
    pages = -(-batch_tokens // PAGE_SIZE) + cfg.max_batch_requests  # each request may end in a partial page
    weights, caches = weight_bytes(model), 2 * cache_bytes(model, pages, cfg.kv_dtype)
    need, have = cfg.cp * (weights + caches), available_memory_bytes()
    if have is not None and need > have:
        raise ValueError(f"the CP engine keeps {model.name}'s weights in fp32 ({weights / 2**30:,.1f} GiB) in each of "
                         f"{cfg.cp} rank processes, with {cfg.kv_dtype} caches of up to {caches / 2**30:,.1f} GiB "
                         f"for a batch of {batch_tokens:,} tokens: about {need / 2**30:,.1f} GiB in all; this machine "
                         f"has {have / 2**30:,.1f} GiB available; {fix}")


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

    check_name_or_path("sweep", config, "config")
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
    envs.check_all()  # a bad LAYERSPLIT_* variable fails here, not in a rank process after the first write
    if cfg.engine == "real":
        check_fits(cfg, "use engine='model' (modelled) or the config 'cpu' (the tiny model, measured)")
    on_length = None
    if out is not None:
        stream, started = Path(out) / "points.jsonl", []

        def on_length(points: list[dict]) -> None:  # the file appears with the first finished length, never empty
            stream.parent.mkdir(parents=True, exist_ok=True)
            with stream.open("a" if started else "w") as f:
                f.write("".join(json.dumps(p) + "\n" for p in points))
            started.append(True)

    points = run_sweep(cfg, progress=progress, on_length=on_length)
    if out is not None:
        write_outputs(points, cfg, Path(out))
    return points


__all__ = ["PrefillReport", "plan_capacity", "prefill", "sweep"]
