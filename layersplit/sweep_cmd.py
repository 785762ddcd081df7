"""``layersplit sweep``: the 40k-120k throughput sweep (the README's main job)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("sweep", help="40k-120k prefill throughput at 90%% cache hit: layersplit vs redundant CP")
    p.add_argument("--engine", choices=("real", "model"), default=None,
                   help="real: measured on this machine (default config 'cpu'); model: the GLM-5 / 8xH200 cost model")
    p.add_argument("--config", default=None, help="sweep config name (configs/sweeps) or YAML path")
    p.add_argument("--out", default="out/sweep", help="folder for points.jsonl, table.md, throughput.png")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tqdm import tqdm

    from layersplit.sweep import run_sweep, table, write_outputs
    from layersplit.sweep_config import load_sweep

    name = args.config or ("glm5-h200" if args.engine == "model" else "cpu")
    cfg = load_sweep(name)
    if args.engine and args.engine != cfg.engine:
        cfg = replace(cfg, engine=args.engine)
    start = time.perf_counter()
    with tqdm(total=2 * len(cfg.lengths), unit="point", leave=False) as bar:
        points = run_sweep(cfg, progress=bar.update)
    paths = write_outputs(points, cfg, Path(args.out))
    print(table(points, cfg))
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {time.perf_counter() - start:.1f} s")
    return 0
