"""``layersplit plan``: KV capacity per CP rank for every layout (parsing and printing; the
arithmetic is :func:`layersplit.plan.capacity.capacity_plan`)."""

from __future__ import annotations

import argparse
import json

from layersplit.cli import options
from layersplit.plan.choices import STRATEGIES
from layersplit.plan.capacity import PLACEMENTS, WEIGHT_BYTES, PlanRequest, capacity_plan
from layersplit.plan.config import load_hardware, load_model

_DEFAULTS = PlanRequest(cp=1)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


_KV_DTYPES = {"bf16": "bf16", "fp8": "fp8", "auto": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8"}


def _kv_dtype(text: str) -> str:
    """This project's KV dtype names, and SGLang's ``--kv-cache-dtype`` names for the same layouts."""
    if text not in _KV_DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {tuple(_KV_DTYPES)}, got {text!r}")
    return _KV_DTYPES[text]


def add_parser(sub: argparse._SubParsersAction, _int_at_least) -> None:
    p = sub.add_parser("plan", help="KV capacity per CP rank: redundant CP vs LayerSplit")
    p.add_argument("--model", "--model-path", dest="model", required=True, type=options.name_or_path,
                   help="model config name (configs/models) or YAML path (--model-path: SGLang's name)")
    p.add_argument("--cp", required=True, type=_int_at_least(1), help="CP group size N")
    p.add_argument("--hardware", required=True, type=options.name_or_path, help="hardware config name (configs/hardware) or YAML path")
    p.add_argument("--kv-dtype", "--kv-cache-dtype", dest="kv_dtype", type=_kv_dtype, default=_DEFAULTS.kv_dtype,
                   help="KV cache dtype: bf16 (default) or fp8 (656 B per token and layer for GLM-5); SGLang's "
                        "--kv-cache-dtype names are taken too (auto, bfloat16: bf16; fp8_e4m3: fp8)")
    p.add_argument("--max-batch-tokens", type=_int_at_least(1), default=_DEFAULTS.max_batch_tokens,
                   help="context tokens one prefill batch reads (sizes each LayerSplit scratch slot)")
    p.add_argument("--context-len", type=_int_at_least(1), default=_DEFAULTS.context_len,
                   help="context length for the per-layer broadcast bytes")
    p.add_argument("--mem-fraction", "--mem-fraction-static", dest="mem_fraction", type=_fraction,
                   default=_DEFAULTS.mem_fraction,
                   help="share of HBM for weights + KV (SGLang's mem_fraction_static)")
    p.add_argument("--weight-dtype", choices=tuple(WEIGHT_BYTES), default=_DEFAULTS.weight_dtype,
                   help="bytes per weight: fp8 = 1, bf16 = 2, none = ignore weights")
    p.add_argument("--weight-shards", type=_int_at_least(1), default=None,
                   help="GPUs the split weights are spread over (default: the CP size, i.e. EP = N)")
    p.add_argument("--weight-placement", choices=PLACEMENTS, default=_DEFAULTS.weight_placement,
                   help="ep (default): SGLang's prefill CP, everything but the routed experts replicated on every "
                        "rank, routed experts split over EP; even: all weights split evenly (optimistic)")
    p.add_argument("--max-requests", type=_int_at_least(1), default=_DEFAULTS.max_requests,
                   help="requests per prefill batch (each may end in a partial scratch page)")
    p.add_argument("--ownership", choices=STRATEGIES, default=_DEFAULTS.ownership,
                   help="which rank owns which layers (default contiguous, as upstream SGLang)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave the MTP layer's weights out of the budget (default: counted, as loaded for "
                        "speculative decoding)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_plan)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def _not_available(r: dict, mode: str) -> str:
    return f" -- NOT AVAILABLE on {r['hardware']} (SM {r['sm_major']}; a design bar here)" if mode in r["unavailable"] else ""


def _format_plan(r: dict) -> str:
    rows = [
        ("model / hardware / CP", f"{r['model']} / {r['hardware']} / {r['cp']} ranks ({r['ownership']} ownership)"),
        ("cache bytes per token per layer", f"KV {r['kv_bytes_per_token_layer']} B ({r['kv_dtype']}) + indexer "
                                            f"{r['index_bytes_per_token_layer']} B on {r['indexer_layers']}/{r['num_layers']} layers"),
        ("HBM as the device reports it", f"{_gib(r['hbm_reported_bytes'])} (datasheet {r['hbm_datasheet_bytes'] / 1e9:.0f} GB)"),
        ("reserved: activations, graphs, NCCL", f"{_gib(r['hbm_reserved_bytes'])} (1 - mem fraction {r['mem_fraction']})"),
        ("weights replicated on every rank", f"{_gib(r['weight_bytes_replicated'])} ({r['weight_dtype']}, embedding "
                                             f"and LM head bf16; placement {r['weight_placement']}; MTP layer "
                                             f"{'counted' if r['weight_mtp_counted'] else 'not counted'})"),
        ("weights split over EP", f"{_gib(r['weight_bytes_expert_parallel'])} ({r['param_count'] / 1e9:,.1f}B params "
                                  f"in all; {r['weight_shards']} shards)"),
        ("KV budget per rank", f"{_gib(r['kv_budget_bytes_per_rank'])} (reported HBM x {r['mem_fraction']} - weights)"),
        ("bytes per token, redundant CP", f"{r['bytes_per_token_redundant']:,} B (all {r['num_layers']} layers)"),
        ("bytes per token, LayerSplit", f"{r['bytes_per_token_layersplit']:,} B ({r['max_owned_layers']} owned layers)"),
        ("LayerSplit scratch (2 slots)", f"{_gib(r['scratch_bytes'])} for {r['max_batch_tokens']:,} batch tokens"),
        ("tokens per rank, redundant CP", f"{r['tokens_per_rank_redundant']:,}"),
        ("tokens per rank, LayerSplit", f"{r['tokens_per_rank_layersplit']:,}"),
        ("tokens per rank, upstream split", f"{r['tokens_per_rank_upstream_layersplit']:,} (one pool-sized scratch layer)"),
        ("tokens per rank, SGLang plug-in", f"{r['tokens_per_rank_sglang_plugin']:,} (owned layers + "
                                            f"{_gib(r['sglang_plugin_staging_bytes'])} batch-sized staging, "
                                            f"batch landing; pool landing: "
                                            f"{r['tokens_per_rank_sglang_plugin_pool_landing']:,})"),
        ("tokens per rank, KV sharding", f"{r['tokens_per_rank_kv_sharding']:,} (SGLang's page-level sharding as "
                                         f"designed: 1/{r['cp']} of every layer, {_gib(r['scratch_bytes_kv_sharding'])} "
                                         f"batch-sized scratch)"),
        ("tokens per rank, KV sharding shipped", f"{r['tokens_per_rank_kv_sharding_shipped']:,} (0.5.23: "
                                                 f"{r['kv_sharding_shipped_kv_dtype']} KV required, "
                                                 f"{_gib(r['scratch_bytes_kv_sharding_shipped'])} scratch for 8 contexts "
                                                 f"of {r['context_len']:,})"
                                                 f"{_not_available(r, 'kv-sharding-shipped')}"),
        ("tokens per rank, query-moving", f"{r['tokens_per_rank_query_moving']:,} (a design, arXiv 2606.01502: owned "
                                          f"layers + {_gib(r['scratch_bytes_query_moving'])} for the owner's "
                                          f"receive slots)"),
        ("best available peer (capacity)", f"{r['best_available_peer']}, {r['tokens_per_rank_best_available_peer']:,} "
                                           f"tokens: LayerSplit holds {r['capacity_ratio_vs_best_available_peer']:.3f}x "
                                           f"(SGLang 0.5.23 layouts that run on {r['hardware']} at {r['kv_dtype']})"),
        ("capacity ratio", f"{r['capacity_ratio']:.3f}x  (ideal {r['capacity_ratio_ideal']:.3f}x, "
                           f"upstream {r['capacity_ratio_upstream']:.3f}x, "
                           f"SGLang plug-in {r['sglang_plugin_capacity_ratio']:.3f}x, "
                           f"KV sharding {r['capacity_ratios']['kv-sharding']:.3f}x, shipped "
                           f"{r['capacity_ratios']['kv-sharding-shipped']:.3f}x"
                           f"{' not available on ' + r['hardware'] if 'kv-sharding-shipped' in r['unavailable'] else ''}, "
                           f"query-moving {r['capacity_ratios']['query-moving']:.3f}x)"),
        ("SGLang plug-in by KV dtype", "; ".join(
            f"{d} {p['tokens_per_rank']:,} tokens = {p['ratio_vs_redundant_bf16']:.3f}x redundant bf16, "
            f"{p['ratio_vs_redundant_fp8']:.3f}x redundant fp8" for d, p in r['sglang_plugin_by_kv_dtype'].items())),
        (f"broadcast per layer @ {r['context_len']:,} ctx", f"{r['broadcast_bytes_per_layer'] / 1e6:,.1f} MB rows "
                                                            f"(upstream pool-sized: {r['broadcast_bytes_per_layer_upstream'] / 1e9:,.2f} GB)"),
        ("broadcast time per layer (model)", f"{r['broadcast_seconds_per_layer_model'] * 1e3:.3f} ms at "
                                             f"{r['nvlink_efficiency']:.3f} of NVLink bandwidth (as the cost model)"),
        (f"query-moving per layer @ {r['max_batch_tokens']:,} new", "{:,.1f} MB queries into the owner, {:,.1f} MB "
                                                                    "outputs back".format(
                                                                        *(b / 1e6 for b in r['query_moving_bytes_per_layer']))),
    ]
    rows += [(f"NOT AVAILABLE on {r['hardware']}: {mode}", why.split(': ', 1)[1])
             for mode, why in r["unavailable"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _run_plan(args: argparse.Namespace) -> int:
    try:
        model, hw = load_model(args.model), load_hardware(args.hardware)
    except ValueError as exc:
        raise ValueError(options.as_flag(str(exc))) from None
    if args.weight_shards is not None and args.weight_shards > model.n_routed_experts:
        raise ValueError(f"--weight-shards: expected <= {model.n_routed_experts} (the routed experts of {model.name} "
                         f"in each layer: expert parallelism splits whole experts), got {args.weight_shards}")
    req = PlanRequest(cp=args.cp, kv_dtype=args.kv_dtype, max_batch_tokens=args.max_batch_tokens,
                      max_requests=args.max_requests,
                      context_len=args.context_len, mem_fraction=args.mem_fraction, weight_dtype=args.weight_dtype,
                      weight_shards=args.weight_shards, ownership=args.ownership,
                      weight_placement=args.weight_placement, mtp=not args.no_mtp)
    try:
        result = capacity_plan(model, hw, req)
    except ValueError as exc:  # the library names its field; the user typed the flag
        raise ValueError(options.as_flag(str(exc))) from None
    print(json.dumps(result) if args.json else _format_plan(result))
    return 0
