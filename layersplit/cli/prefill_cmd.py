"""``layersplit prefill``: run the CP prefill engine on real rank processes and check it against the
single-process reference (the work is :func:`layersplit.engine.prefill.prefill`).

Exit status: 0 done; 1 a stream-ordering hazard was found (``LAYERSPLIT_SANITIZE=1``) or the ranks gave
no result within ``--timeout-s`` (one line naming the flag); 2 bad input, refused before any process starts."""

from __future__ import annotations

import argparse
import json
import sys

from layersplit.cli import options
from layersplit.plan.choices import ENGINE_KV_DTYPES, MODES, SCHEDULES, SPLITS, STRATEGIES, TIMEOUT_MAX_S



def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("prefill", help="CP prefill of cached-prefix requests (redundant vs layersplit)",
                       description="Prefill synthetic requests on --cp rank processes (gloo on CPU, NCCL on CUDA) "
                                   "and check the hidden states against the single-process reference.")
    p.add_argument("--model", default="tiny", help="model config name (configs/models) or YAML path; the engine "
                                                   "keeps fp32 weights per process, so on a CPU: tiny (default)")
    p.add_argument("--cp", type=int_at_least(1), required=True, help="CP ranks (one process each)")
    p.add_argument("--mode", choices=MODES, required=True,
                   help="redundant: every layer on every rank (SGLang CP); layersplit: owned layers + broadcasts")
    p.add_argument("--context-len", type=int_at_least(2), default=8192, dest="context_len",
                   help="context tokens per request (default 8192)")
    p.add_argument("--context", type=int_at_least(2), dest="context_len", help=argparse.SUPPRESS)  # old name
    p.add_argument("--hit", type=options.number_in(0, 1, high_open=True), default=0.9,
                   help="cached share of each request's context, in [0, 1) (default 0.9)")
    p.add_argument("--requests", type=int_at_least(1), default=1, help="requests in the batch (default 1)")
    p.add_argument("--ownership", choices=STRATEGIES, default="contiguous",
                   help="which rank owns which layers (default contiguous, as upstream SGLang)")
    p.add_argument("--split", choices=SPLITS, default="zigzag", help="how new tokens are split over ranks (default zigzag)")
    p.add_argument("--seed", type=options.seed, default=0, help="seed of the synthetic requests (default 0)")
    p.add_argument("--schedule", choices=SCHEDULES, default="overlapped",
                   help="overlapped (default): the KV broadcast on its own stream and communicator, under the "
                        "indexer; legacy: one FIFO comm stream (the KV broadcast delays the indexer's all-gather)")
    p.add_argument("--kv-dtype", choices=ENGINE_KV_DTYPES, default="bf16", dest="kv_dtype",
                   help="MLA cache rows in every pool, host tier and broadcast: bf16 (default) or fp8 (e4m3 latent "
                        "+ fp32 tile scales + bf16 rope); the reference runs the same dtype")
    p.add_argument("--host-tier", action="store_true", dest="host_tier",
                   help="the cached prefixes sit in each rank's host tier and reload layer by layer (HiCache)")
    p.add_argument("--bcast-kv-delay-ms", type=options.number_in(0, 10_000), default=0.0, dest="bcast_kv_delay_ms",
                   help="stall every KV broadcast this long first, to see what the schedule hides (default 0)")
    p.add_argument("--timeout-s", type=options.number_in(0, TIMEOUT_MAX_S, low_open=True), default=600.0,
                   dest="timeout_s", metavar="SECONDS",
                   help="how long the rank processes may take before they are ended (default 600; Triton's "
                        "interpreter with fp8 on a loaded machine can take longer)")
    p.add_argument("--trace", type=options.writable_file, default=None,
                   help="write a Chrome trace-event JSON here (checked before the run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_prefill)


def _per_layer_text(total: dict, kv: dict, verb: str) -> str:
    """Mean bytes a layer's collectives moved (``verb``: how), and their KV part."""
    if not total:
        return "none"
    mean = sum(total.values()) / len(total)
    return (f"{mean:,.0f} B ({mean / 2**20:,.3f} MiB) {verb} on average over {len(total)} layers, of which KV "
            f"{sum(kv.values()) / len(kv):,.0f} B, the rest indexer keys")


def _text(r: dict) -> str:
    """The report as aligned rows; every count says whose it is: the run's (all ranks), rank 0's, or each rank's."""
    kv = r["kv_bytes_per_rank"]
    rows = [
        ("model / CP / mode", f"{r['model']} / {r['cp']} ranks / {r['mode']} ({r['ownership']} ownership, "
                              f"{r['split']} split)"),
        ("requests x context", f"{r['requests']} x {r['context_len']:,} tokens, {r['hit']:.0%} cached, "
                               f"{r['new_tokens']:,} new tokens (per run)"),
        ("prefill time (measured)", f"{r['prefill_seconds'] * 1e3:,.1f} ms on {r['measured_on']} (per run: the "
                                    "slowest rank)"),
        ("throughput (measured)", f"{r['new_tokens_per_s']:,.0f} new tokens/s, {r['request_tokens_per_s']:,.0f} "
                                  "request tokens/s (per run)"),
        ("KV cache dtype", f"{r['kv_dtype']} (the reference's too)"),
        ("KV per rank: owned + scratch", ", ".join(f"r{i}: {k['owned'] / 2**20:,.2f} + {k['scratch'] / 2**20:,.2f} MiB"
                                                    for i, k in enumerate(kv))),
        ("broadcast per layer (rank 0)", _per_layer_text(r["bcast_bytes_per_layer"], r["bcast_kv_bytes_per_layer"],
                                                         "sent or received")),
        ("all-gather per layer (rank 0)", _per_layer_text(r["allgather_bytes_per_layer"],
                                                          r["allgather_kv_bytes_per_layer"], "received")),
        ("max |deviation| vs reference", f"{r['max_abs_deviation_vs_reference']:.3g} (per run: all new tokens)"),
        ("kernels / schedule", f"{r['kernel_backend']} / {r['schedule']}"
                               + (" / prefixes reloaded from the host tier" if r["host_tier"] else "")),
        ("indexer waits for KV bcast", f"{r['indexer_waits_for_kv_bcast']} non-owned indexer layers (per run: all "
                                       "ranks; happens-before order)"),
        ("broadcast waits per rank", ", ".join(f"r{i}: {w:,.2f} ms" for i, w in enumerate(r["bcast_wait_ms_per_rank"]))),
    ]
    if r.get("max_abs_deviation_vs_torch_engine") is not None:
        rows.append(("max |deviation| vs torch engine", f"{r['max_abs_deviation_vs_torch_engine']:.3g} (per run)"))
    if "sanitizer_hazards" in r:
        rows.append(("sanitizer hazards", f"{r['sanitizer_hazards']} (per run: all ranks and the reference)"))
    if r.get("trace"):
        rows.append(("trace", r["trace"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_prefill(args: argparse.Namespace) -> int:
    from layersplit.engine.prefill import prefill
    from layersplit.engine.trace import write_trace
    from layersplit.plan.config import load_model

    try:
        model = load_model(args.model)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None
    try:
        result = prefill(model, cp=args.cp, mode=args.mode, context_len=args.context_len, hit=args.hit,
                         requests=args.requests, seed=args.seed, ownership=args.ownership, split=args.split,
                         trace=bool(args.trace), progress=options.stage_printer("prefill"),
                         schedule=args.schedule, bcast_kv_delay_ms=args.bcast_kv_delay_ms, host_tier=args.host_tier,
                         kv_dtype=args.kv_dtype, timeout_s=args.timeout_s)
    except ValueError as exc:  # the library names its argument; the user typed the flag
        raise ValueError(options.as_flag(str(exc))) from None
    except TimeoutError as exc:  # not bad input: the run started and did not finish in time (exit 1, one line)
        print(f"layersplit prefill: error: {options.as_flag(str(exc))}", file=sys.stderr)
        return 1
    report = result.as_dict()
    if args.trace:
        report["trace"] = str(args.trace)
    print(json.dumps(report) if args.json else _text(report))  # the result first: a failed write loses only the file
    if args.trace:
        try:
            write_trace(args.trace, result.trace_events)
        except OSError as exc:
            raise ValueError(f"--trace: could not write {str(args.trace)!r}: {exc.strerror or exc}") from None
    return 1 if report.get("sanitizer_hazards") else 0  # a missing stream edge is a bug
