"""``layersplit sweep``: the 40k-120k throughput sweep (the README's main job)."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

from layersplit.cli import options, resources


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("sweep", help="40k-120k prefill throughput at 90%% cache hit: layersplit vs redundant CP")
    p.add_argument("--engine", choices=("real", "model"), default=None,
                   help="real: measured on this machine (default config 'cpu'); model: the GLM-5 / 8xH200 cost model")
    p.add_argument("--config", type=options.name_or_path, default=None,
                   help="sweep config name (configs/sweeps) or YAML path")
    p.add_argument("--out", type=options.writable_dir, default=None,
                   help="folder for points.jsonl, table.md, throughput.png (default out/sweep/<config>-<engine>, one "
                        "per config and engine; checked before the run)")
    p.add_argument("--force", action="store_true",
                   help="replace the results already in --out (without it a sweep never overwrites earlier results)")
    p.add_argument("--map", default=None,
                   help="also a gain map over length x this axis: 'sessions=8,16,32,64,128' or "
                        "'host_gb=64,256,1024' (model engine); writes gain_map.png and gain_map.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from layersplit.api import check_fits, check_out, sweep
    from layersplit.serving.sweep import point_count
    from layersplit.serving.sweep_config import load_sweep

    name = ("glm5-h200" if args.engine == "model" else "cpu") if args.config is None else args.config
    try:
        cfg = load_sweep(name)  # every field checked (and the CP size against the model) before any work
    except ValueError as exc:
        raise ValueError(f"--config: {exc}") from None
    axis = _parse_map(args.map) if args.map else None
    if args.engine:
        cfg = replace(cfg, engine=args.engine)
    if cfg.engine == "real":  # resources before work: the rank processes' memory, the kernels' environment
        resources.check_machine_env()
        fix = "use --engine model (modelled)"
        if cfg.name != "cpu":
            fix += " or --config cpu (the tiny model, measured)"
        try:
            check_fits(cfg, fix)  # host memory; then, where the ranks run on CUDA, each GPU's free memory
            resources.check_sweep_gpu_fits(cfg, f"{fix}, or set CUDA_VISIBLE_DEVICES= to run the ranks on the CPU")
        except ValueError as exc:
            given = f"--engine real with --config {name}" if args.engine else f"--config {name} (engine: real)"
            raise ValueError(f"{given}: {exc}") from None
    out = args.out or Path("out/sweep") / f"{Path(name).stem}-{cfg.engine}"
    try:
        check_out(out, args.force)
    except ValueError as exc:
        raise ValueError(f"--out: {exc}") from None
    start = time.perf_counter()
    with tqdm(total=point_count(cfg), unit="point", leave=False) as bar:
        points = sweep(name, engine=args.engine, out=out, progress=bar.update, force=args.force)  # grows per length
    del points  # written to --out; printed from there
    paths = {"jsonl": out / "points.jsonl", "table": out / "table.md", "plot": out / "throughput.png"}
    print(paths["table"].read_text())  # the table (model engine: + sensitivity and calibration)
    if cfg.engine == "real":  # beside the CPU table: what the same serving loop means for GLM-5 on 8 x H200
        sweep("glm5-h200", engine="model", out=out / "model", force=True)  # part of this run's folder
        paths["model_table"] = out / "model" / "table.md"
        print("Beside it, **modelled** (not measured): GLM-5 on 8 x H200 with every peer, from the cost model "
              "(`layersplit sweep --engine model`).\n")
        print(paths["model_table"].read_text())
    if axis:
        from layersplit.serving.gain_map import run_map

        paths |= run_map(cfg, axis[0], axis[1], out)
        print(paths["map_table"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.1f} s")
    return 0


def _parse_map(text: str) -> tuple[str, list[float]]:
    """``sessions=8,16,32`` or ``host_gb=64,256,1024``."""
    axis, _, values = text.partition("=")
    if axis not in ("sessions", "host_gb") or not values:
        raise ValueError(f"--map: expected 'sessions=N,N,...' or 'host_gb=G,G,...', got {text!r}")
    try:
        parsed = [float(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"--map: expected numbers after '{axis}=', got {values!r}") from None
    bad = [v for v in parsed if not math.isfinite(v) or v <= 0 or (axis == "sessions" and v != int(v))]
    if bad:
        want = "whole numbers >= 1" if axis == "sessions" else "finite numbers > 0"
        raise ValueError(f"--map: expected {axis} values that are {want}, got {values!r}")
    return axis, parsed
