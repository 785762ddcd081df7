"""``layersplit stress hicache``: the read-before-ready stress harness from the command line."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

UNSAFE = {"indexer": {"indexer"}, "kv": {"kv"}, "both": {"indexer", "kv"}, "fence": {"fence"}}


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("stress", help="race stress tests")
    which = p.add_subparsers(dest="target", required=True)
    h = which.add_parser("hicache", help="layer-wise HiCache load vs the DSA forward (read-before-ready)")
    h.add_argument("--loads", type=int_at_least(1), default=2000, help="layer loads to run (default 2000)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--unsafe-skip-wait", choices=sorted(UNSAFE), default=None,
                   help="UNSAFE: drop the indexer wait, the KV wait, both, or the page-reuse fence, to show "
                        "that the harness detects the resulting corruption")
    h.add_argument("--model", default="tiny", help="model config for the cache dims (default tiny)")
    h.add_argument("--runtime", choices=("auto", "emulated", "cuda"), default="auto")
    h.add_argument("--json", action="store_true", help="print the report as one JSON object")
    h.set_defaults(func=run_hicache)


def run_hicache(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hicache.stress import StressConfig, run_stress
    from layersplit.config import cache_spec, load_model

    model = load_model(args.model)
    cfg = StressConfig(layer_loads=args.loads, seed=args.seed, runtime=args.runtime,
                       unsafe_skip=frozenset(UNSAFE.get(args.unsafe_skip_wait, ())),
                       index_heads=model.index_n_heads, attn_heads=model.num_heads, topk=model.index_topk)
    with tqdm(total=args.loads, unit="layer", disable=args.json, leave=False) as bar:
        report = run_stress(cache_spec(model), cfg, progress=bar.update)
    if args.json:
        print(json.dumps(asdict(report)))
    else:
        for key, value in asdict(report).items():
            if key != "config":
                print(f"{key:<20} {value}")
    if not cfg.unsafe_skip and report.corrupted_outputs:
        return 1  # the safe pipeline corrupted outputs: a real bug
    if cfg.unsafe_skip and not report.corrupted_outputs:
        print("warning: no corruption detected with a safeguard removed; run more --loads")
        return 3
    return 0
