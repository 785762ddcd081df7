"""``layersplit prefill``: run the CP prefill engine on real rank processes and check it against the
single-process reference."""

from __future__ import annotations

import argparse
import json

from layersplit.cli import options
from layersplit.engine.batch_plan import SPLITS
from layersplit.engine.cp_pool import MODES
from layersplit.engine.ownership import STRATEGIES


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("prefill", help="CP prefill of cached-prefix requests (redundant vs layersplit)")
    p.add_argument("--model", default="tiny", help="model config (CPU: tiny)")
    p.add_argument("--cp", type=int_at_least(1), required=True, help="CP ranks (processes)")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--context", type=int_at_least(2), default=8192, help="context tokens per request")
    p.add_argument("--hit", type=options.number_in(0, 1, high_open=True), default=0.9, help="cached share of each request's context, in [0, 1)")
    p.add_argument("--requests", type=int_at_least(1), default=1)
    p.add_argument("--ownership", choices=STRATEGIES, default="contiguous")
    p.add_argument("--split", choices=SPLITS, default="zigzag", help="how new tokens are split over ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="write a Chrome trace-event JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_prefill)


def run_prefill(args: argparse.Namespace) -> int:
    import torch

    from dsa_kernels.layout import PAGE_SIZE
    from layersplit.plan.config import load_model
    from layersplit.engine.engine import EngineConfig
    from layersplit.engine.launcher import Scenario, cp_backend, run_cp, run_reference
    from layersplit.engine.requests import synthetic_requests
    from layersplit.engine.trace import write_trace

    model = load_model(args.model)
    requests = synthetic_requests(args.requests, args.context, args.hit, model.vocab_size, args.seed)
    tokens = args.requests * args.context
    cfg = EngineConfig(mode=args.mode, cp=args.cp, ownership=args.ownership, split=args.split,
                       pool_pages=args.requests * (-(-args.context // PAGE_SIZE)), max_batch_tokens=tokens,
                       max_requests=args.requests)
    scenario = Scenario("cli", requests, cfg)
    result = run_cp(model, [scenario], args.cp)[0]
    reference = run_reference(model, scenario)
    new_tokens = sum(len(r.new_tokens) for r in requests)
    report = {
        "model": model.name, "cp": args.cp, "mode": args.mode, "ownership": args.ownership, "split": args.split,
        "requests": args.requests, "context": args.context, "hit": args.hit, "new_tokens": new_tokens,
        "prefill_seconds": result.seconds, "tokens_per_s": new_tokens / result.seconds,
        "kv_bytes_per_rank": [r.kv_bytes for r in result.ranks],
        "bcast_bytes_per_layer": result.ranks[0].bcast_bytes if args.cp > 1 else {},
        "max_abs_deviation_vs_reference": float((result.hidden - reference.hidden).abs().max()),
        "measured_on": f"cuda ({cp_backend()})" if torch.cuda.is_available() else "cpu (gloo, emulated streams)",
    }
    if result.ranks[0].hazards is not None:  # LAYERSPLIT_SANITIZE=1: every rank and the reference
        hazards = sorted({h for r in [*result.ranks, *reference.ranks] for h in r.hazards})
        report["sanitizer_hazards"] = len(hazards)
        report["sanitizer_hazard_list"] = hazards
    if args.trace:
        write_trace(args.trace, [e for r in result.ranks for e in r.trace])
        report["trace"] = args.trace
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<32} {value}")
    return 1 if report.get("sanitizer_hazards") else 0  # a missing stream edge is a bug
