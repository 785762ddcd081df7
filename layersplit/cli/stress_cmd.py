"""``layersplit stress hicache|pd|sglang-hicache|sglang-pool``: the race stress harnesses from the
command line (long mode; the test suite runs short versions)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from layersplit.cli import options

UNSAFE = {"indexer": {"indexer"}, "kv": {"kv"}, "both": {"indexer", "kv"}, "fence": {"fence"}}


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("stress", help="race stress tests")
    which = p.add_subparsers(dest="target", required=True)
    h = which.add_parser("hicache", help="layer-wise HiCache load vs the DSA forward (read-before-ready)")
    h.add_argument("--iterations", type=int_at_least(1), default=2000, dest="loads", metavar="N",
                   help="layer loads to run (default 2000; the long mode: 100000)")
    h.add_argument("--loads", type=int_at_least(1), dest="loads", help=argparse.SUPPRESS)  # old name
    h.add_argument("--seed", type=options.seed, default=0, help="seed of loads, stalls and data (default 0)")
    h.add_argument("--unsafe-skip-wait", choices=sorted(UNSAFE), default=None,
                   help="UNSAFE: drop the indexer wait, the KV wait, both, or the page-reuse fence, to show "
                        "that the harness detects the resulting corruption")
    h.add_argument("--model", default="tiny", help="model config for the cache dims (default tiny)")
    h.add_argument("--runtime", choices=("auto", "emulated", "cuda"), default="auto",
                   help="streams: CUDA where present (auto, default), the emulated runtime, or CUDA (fails without)")
    h.add_argument("--json", action="store_true", help="print the report as one JSON object")
    h.set_defaults(func=run_hicache)
    d = which.add_parser("pd", help="prefill/decode abort storms (discrete-event simulation): safe release vs "
                                     "the legacy immediate release, LayerSplit prefill ranks, lossy control plane")
    d.add_argument("--requests", type=int_at_least(1), default=10000, help="requests to run (default 10000)")
    d.add_argument("--seed", type=options.seed, default=0, help="seed of arrivals and faults (default 0)")
    d.add_argument("--prefill-cp", type=int_at_least(1), default=2,
                   help="prefill CP ranks; each writes only the layers it owns (LayerSplit contiguous plan)")
    d.add_argument("--layers", type=int_at_least(1), default=61, help="decoder layers to split (default 61)")
    d.add_argument("--drop", type=options.number_in(0, 1, high_open=True), default=0.05,
                   help="probability a control message is lost, in [0, 1) (default 0.05)")
    d.add_argument("--duplicate", type=options.number_in(0, 1, high_open=True), default=0.05,
                   help="probability a control message is re-sent later, in [0, 1) (default 0.05)")
    d.add_argument("--max-delay-s", type=options.number_in(0, 3600), default=0.02,
                   help="control message delay upper bound in virtual seconds (default 0.02)")
    d.add_argument("--cancel", type=options.number_in(0, 1), default=0.03,
                   help="probability a client cancels (some twice), in [0, 1] (default 0.03)")
    d.add_argument("--restart-mean-s", type=options.number_in(0, 1e9), default=60.0,
                   help="mean virtual seconds between crashes of each prefill rank (0: no restarts)")
    d.add_argument("--kill-rank", type=_pd_kill, action="append", default=[], metavar="RANK@SECONDS",
                   help="crash a prefill rank for good at this virtual time (a dead peer); repeatable")
    d.add_argument("--legacy-immediate-release", action="store_true",
                   help="UNSAFE: free an aborted request's pages at once (the old race)")
    d.add_argument("--json", action="store_true", help="print the report as one JSON object")
    d.set_defaults(func=run_pd)
    sh = which.add_parser("sglang-hicache", help="the plug-in's indexer-first HiCache load inside SGLang's own "
                                                  "load path (needs sglang installed)")
    sh.add_argument("--iterations", type=int_at_least(1), default=2000, help="batches of 4 layer loads (default 2000)")
    sh.add_argument("--seed", type=options.seed, default=0, help="seed of loads and stalls (default 0)")
    sh.add_argument("--upstream", action="store_true", help="SGLang's own counter and engine, for comparison")
    sh.add_argument("--unsafe-skip-wait", nargs="?", choices=("indexer",), const="indexer", default=None,
                    help="UNSAFE: indexer: the indexer reads its keys without waiting (shows the detector firing)")
    sh.set_defaults(func=run_sglang_hicache)
    sp = which.add_parser("sglang-pool", help="the plug-in pool's staged broadcasts, two gloo rank processes "
                                              "(needs sglang installed)")
    sp.add_argument("--iterations", type=int_at_least(1), default=200, help="batches of 5 layers (default 200)")
    sp.add_argument("--seed", type=options.seed, default=0, help="seed of batches and stalls (default 0)")
    sp.add_argument("--unsafe-skip-wait", choices=("slot", "load"), default=None,
                    help="UNSAFE: use a staging slot without waiting for its broadcast (slot), or broadcast a "
                         "layer without waiting for its HiCache load (load); shows the detector firing")
    sp.set_defaults(func=run_sglang_pool)


def _pd_kill(text: str) -> tuple[int, float]:
    rank, _, at = text.partition("@")
    try:
        return int(rank), float(at)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK@SECONDS (e.g. 3@10.5), got {text!r}") from None


def run_pd(args: argparse.Namespace) -> int:
    from pd.abort_stress import PDStressConfig, failures, run_pd_stress
    from pd.channel import ChannelFaults
    from pd.topology import PrefillTopology

    from layersplit.engine.ownership import plan_ownership

    plan = plan_ownership(args.layers, args.prefill_cp, "contiguous")  # pd takes the ownership as plain data
    cfg = PDStressConfig(requests=args.requests, seed=args.seed, legacy_immediate_release=args.legacy_immediate_release,
                         topology=PrefillTopology.of([plan.owned_layers(r) for r in range(args.prefill_cp)]),
                         channel=ChannelFaults(max_delay_s=args.max_delay_s, drop=args.drop, duplicate=args.duplicate),
                         cancel=args.cancel, restart_mean_s=args.restart_mean_s or None, kill=tuple(args.kill_rank))
    report = run_pd_stress(cfg)
    report["note"] = "discrete-event simulation of a PD cluster (virtual time), faults seeded"
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<28} {value}")
    if args.legacy_immediate_release:
        if not report["overwrites"]:
            print("warning: the legacy release reproduced no overwrite; run more --requests")
            return 3
        return 0
    broken = failures(report)
    if broken:  # the safe protocol let a write land on a reused page, leaked, or still holds pages: a bug
        import sys

        print("FAILED: " + ", ".join(broken), file=sys.stderr)
        return 1
    return 0


def run_hicache(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lsconfig import envs
    from hicache.stress import StressConfig, run_stress
    from layersplit.plan.config import cache_spec, load_model

    model = load_model(args.model)
    cfg = StressConfig(layer_loads=args.loads, seed=args.seed, runtime=args.runtime, sanitize=envs.sanitize(),
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
    if not cfg.unsafe_skip and report.detected:
        return 1  # the safe pipeline corrupted outputs (or missed a stream edge): a real bug
    if cfg.unsafe_skip and not report.detected:
        print("warning: no corruption detected with a safeguard removed; run more --iterations")
        return 3
    return 0


def _sglang_stress():
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise SystemExit("stress sglang-*: expected sglang to be installed (pip install 'layersplit[sglang]'), "
                         "got none")
    from layersplit.sglang_plugin import stress

    return stress


def _verdict(unsafe: bool, stale: int, what: str) -> int:
    if not unsafe and stale:
        return 1  # the safe path read data that had not arrived: a real bug
    if unsafe and not stale:
        print(f"warning: no stale {what} read detected with the wait removed; run more --iterations")
        return 3
    return 0


def run_sglang_hicache(args: argparse.Namespace) -> int:
    stress = _sglang_stress()
    from lsconfig import envs

    result = stress.run(args.iterations, seed=args.seed, upstream=args.upstream, sanitize=envs.sanitize(),
                        unsafe_skip=("index_wait",) if args.unsafe_skip_wait else ())
    print(json.dumps(asdict(result)))
    return _verdict(bool(args.unsafe_skip_wait), result.stale_index_reads + result.stale_kv_reads
                    + (result.sanitizer_hazards or 0), "indexer-key")


def run_sglang_pool(args: argparse.Namespace) -> int:
    stress = _sglang_stress()
    unsafe = (f"{args.unsafe_skip_wait}_wait",) if args.unsafe_skip_wait else ()
    from lsconfig import envs

    result = stress.run_pool(args.iterations, seed=args.seed, unsafe_skip=unsafe, sanitize=envs.sanitize())
    print(json.dumps(asdict(result)))
    return _verdict(bool(unsafe), result.stale_reads + (result.sanitizer_hazards or 0), "layer")
