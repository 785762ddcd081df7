"""``layersplit stress hicache|pd|sglang-hicache|sglang-pool``: the race stress harnesses from the
command line (long mode; the test suite runs short versions)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from layersplit.cli import options, resources

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
    h.add_argument("--model", type=options.name_or_path, default="tiny",
                   help="model config for the cache dims (default tiny)")
    h.add_argument("--runtime", choices=("auto", "emulated", "cuda"), default="auto",
                   help="streams: CUDA where present (auto, default), the emulated runtime, or CUDA (fails without)")
    h.add_argument("--json", action="store_true", help="print the report as one JSON object")
    h.set_defaults(func=run_hicache, machine_env=True)  # runs the kernels here
    d = which.add_parser("pd", help="prefill/decode abort storms (discrete-event simulation): safe release vs the "
                                     "legacy immediate release, LayerSplit prefill ranks, lossy control plane "
                                     "(on real processes: python -m tools.pd_real storm, from a checkout)")
    add_pd_arguments(d, int_at_least)
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


def add_pd_arguments(d: argparse.ArgumentParser, int_at_least) -> None:
    """The storm's flags, shared by ``stress pd`` and the real-process storm (``tools/pd_real``)."""
    d.add_argument("--requests", type=int_at_least(1), default=10000, help="requests to run (default 10000)")
    d.add_argument("--seed", type=options.seed, default=0, help="seed of arrivals and faults (default 0)")
    d.add_argument("--prefill-cp", type=int_at_least(1), default=2,
                   help="prefill CP ranks; each writes only the layers it owns (LayerSplit contiguous plan)")
    d.add_argument("--layers", type=int_at_least(1), default=None,
                   help="decoder layers to split (default 61; real processes: one per rank, each a registered region)")
    d.add_argument("--drop", type=options.number_in(0, 1, high_open=True), default=0.05,
                   help="probability a control message is lost, in [0, 1) (default 0.05)")
    d.add_argument("--duplicate", type=options.number_in(0, 1, high_open=True), default=None,
                   help="probability a control message is re-sent later, in [0, 1) (default 0.05; sim only)")
    d.add_argument("--max-delay-s", type=options.number_in(0, 3600), default=0.02,
                   help="control message delay upper bound in virtual seconds (default 0.02)")
    d.add_argument("--mean-arrival-s", type=options.number_in(0, 3600, low_open=True), default=0.015,
                   help="mean seconds between request arrivals, exponential (default 0.015)")
    d.add_argument("--cancel", type=options.number_in(0, 1, high_open=True), default=0.03,
                   help="probability a client cancels (some twice), in [0, 1) (default 0.03)")
    d.add_argument("--restart-mean-s", type=options.number_in(0, 1e9), default=None,
                   help="mean virtual seconds between crashes of each prefill rank (default 60; 0: no restarts; "
                        "sim only)")
    d.add_argument("--kill-rank", type=_pd_kill, action="append", default=[], metavar="RANK@SECONDS",
                   help="crash a prefill rank for good at this virtual time (a dead peer: fenced after "
                        "--fence-after-s); repeatable; real processes: SIGKILL at this wall second, restarted as a new "
                        "incarnation --restart-after-s later (never: for good, as in sim)")
    d.add_argument("--partition", type=options.number_in(0, 1e6, low_open=True), default=None, metavar="SECONDS",
                   help="cut --outage-rank's control link at --outage-at for this long (its lease stays valid)")
    d.add_argument("--prefill-down", type=options.number_in(0, 1e6, low_open=True), default=None, metavar="SECONDS",
                   help="crash --outage-rank at --outage-at and restart it this much later (a model reload)")
    d.add_argument("--lease-loss", type=options.number_in(0, 1e6, low_open=True), default=None, metavar="SECONDS",
                   help="a false suspicion: --outage-rank's lease expires at --outage-at while it is alive and it "
                        "heartbeats again this much later (fenced meanwhile if longer than --fence-after-s; "
                        "real processes: SIGSTOP, then SIGCONT this much later)")
    d.add_argument("--outage-rank", type=int_at_least(0), default=None,
                   help="the rank of --partition / --prefill-down / --lease-loss (default 0; only with one of them)")
    d.add_argument("--outage-at", type=options.number_in(0, 1e6), default=None,
                   help="virtual time of --partition / --prefill-down / --lease-loss (default 10; only with one of "
                        "them)")
    d.add_argument("--restart-decode", type=options.number_in(0, 1e6), action="append", default=[],
                   metavar="SECONDS", help="crash and restart the decode worker at this virtual time; repeatable")
    d.add_argument("--fence-after-s", type=options.number_in(0, 1e6), default=30.0,
                   help="fence a prefill rank whose lease expired and that stayed down this long (0: never)")
    d.add_argument("--fence-unreachable-s", type=options.number_in(0, 1e6, low_open=True), default=None,
                   metavar="SECONDS",
                   help="fence a prefill rank that holds its lease but left an abort unacknowledged and sent "
                        "nothing this long (a cut control link): each abort is held at most about this long, the "
                        "rank restarts as a new incarnation (default: off, hold the pages until the link heals)")
    d.add_argument("--misaddress", type=options.number_in(0, 1, high_open=True), default=0.0,
                   help="probability a prefill reply is also delivered naming another peer or a non-owner")
    d.add_argument("--decode-pages", type=int_at_least(8), default=512, metavar="N",
                   help="pages in decode's KV pool (default 512; a request takes 1 to 8)")
    d.add_argument("--guard-off", action="append", default=[], metavar="GUARD",
                   help="UNSAFE: switch a hardening guard off (layersplit.pd.abort.guards; repeatable): expect the failure it "
                        "closes. real processes: fence-refuses-writes only (decode's fence keeps the rank's regions "
                        "registered)")
    d.add_argument("--legacy-immediate-release", action="store_true",
                   help="UNSAFE: free an aborted request's pages at once (the old race)")


def _pd_kill(text: str) -> tuple[int, float]:
    rank, _, at = text.partition("@")
    try:
        parsed = int(rank), float(at)
    except ValueError:
        parsed = (-1, -1.0)
    if parsed[0] < 0 or not 0 <= parsed[1] <= 1e6:  # float() also takes nan and inf
        raise argparse.ArgumentTypeError(f"expected RANK@SECONDS, a rank >= 0 and seconds in [0, 1e6] (e.g. "
                                         f"3@10.5), got {text!r}")
    return parsed


_OUTAGES = (("--partition", "partition"), ("--prefill-down", "prefill_down"), ("--lease-loss", "lease_loss"))
# the storm config's field names (layersplit.pd.abort.stress_config) as the flags that set them
PD_FLAG_OF = {"kill": "kill-rank", "outage": "prefill-down", "guard": "guard-off", "num_pages": "decode-pages"}


def _outage_place(args: argparse.Namespace) -> tuple[int, float]:
    """--outage-rank / --outage-at, which place an outage: refused without one (they would do nothing)."""
    given = [flag for flag, value in (("--outage-rank", args.outage_rank), ("--outage-at", args.outage_at))
             if value is not None]
    if given and not any(getattr(args, name) for _, name in _OUTAGES):
        raise ValueError(f"{given[0]}: expected it only with {', '.join(f for f, _ in _OUTAGES)} (the outage it "
                         "places), got it without one")
    rank = 0 if args.outage_rank is None else args.outage_rank
    if rank >= args.prefill_cp:
        raise ValueError(f"--outage-rank: expected a rank in [0, {args.prefill_cp - 1}], got {rank}")
    bad = next((r for r, _ in args.kill_rank if r >= args.prefill_cp), None)
    if bad is not None:
        raise ValueError(f"--kill-rank: expected a rank in [0, {args.prefill_cp - 1}] (--prefill-cp "
                         f"{args.prefill_cp}), got {bad}")
    return rank, 10.0 if args.outage_at is None else args.outage_at


def pd_config(args: argparse.Namespace, default_layers: int = 61):
    from layersplit.pd.abort.stress import PDStressConfig
    from layersplit.pd.abort.channel import ChannelFaults
    from layersplit.pd.abort.decode_side import DecodeConfig
    from layersplit.pd.abort.guards import check_names, decode_config_off
    from layersplit.pd.abort.topology import PrefillTopology

    from layersplit.plan.ownership import plan_ownership

    check_names(args.guard_off)  # one clear error before any work
    rank, at = _outage_place(args)
    layers = args.layers or default_layers
    if args.prefill_cp > layers:
        raise ValueError(f"--prefill-cp: expected <= num_layers ({layers}) of --layers so every rank owns a layer, "
                         f"got {args.prefill_cp}")
    plan = plan_ownership(layers, args.prefill_cp, "contiguous")  # pd takes the ownership as plain data
    outage = lambda seconds: ((rank, at, seconds),) if seconds else ()  # noqa: E731
    decode = decode_config_off(DecodeConfig(num_pages=args.decode_pages, fence_after_s=args.fence_after_s or None,
                                            fence_unreachable_s=args.fence_unreachable_s), args.guard_off)
    return PDStressConfig(
        requests=args.requests, seed=args.seed, legacy_immediate_release=args.legacy_immediate_release,
        topology=PrefillTopology.of([plan.owned_layers(r) for r in range(args.prefill_cp)]),
        channel=ChannelFaults(max_delay_s=args.max_delay_s, drop=args.drop,
                              duplicate=0.05 if args.duplicate is None else args.duplicate),
        cancel=args.cancel, restart_mean_s=60.0 if args.restart_mean_s is None else args.restart_mean_s or None,
        kill=tuple(args.kill_rank), mean_arrival_s=args.mean_arrival_s,
        partition=outage(args.partition), outage=outage(args.prefill_down), lease_loss=outage(args.lease_loss),
        restart_decode=tuple(args.restart_decode), misaddress=args.misaddress, decode=decode)


def pd_verdict(args: argparse.Namespace, broken: list[str], overwrites: int) -> int:
    """The exit code of a pd storm (simulated or on real processes): 1 where the safe protocol failed; an UNSAFE run
    (legacy release, a guard off) is expected to fail: 0 where it did, 3 (a warning) where it did not."""
    if args.legacy_immediate_release:
        if not overwrites:
            print("warning: the legacy release reproduced no overwrite; run more --requests", file=sys.stderr)
            return 3
        return 0
    if args.guard_off:  # UNSAFE: the run is expected to show what the guard closes
        if not broken:
            print(f"warning: no failure with {', '.join(args.guard_off)} off; run more --requests or its scenario",
                  file=sys.stderr)
            return 3
        print("UNSAFE run failed as expected: " + ", ".join(broken), file=sys.stderr)
        return 0
    if broken:  # the safe protocol let a write land on a reused page, leaked, or still holds pages: a bug
        print("FAILED: " + ", ".join(broken), file=sys.stderr)
        return 1
    return 0


def run_pd(args: argparse.Namespace) -> int:
    from layersplit.pd.abort.stress import failures, run_pd_stress
    from layersplit.pd.abort.guards import guards_off

    try:
        cfg = pd_config(args)
    except ValueError as exc:  # the storm config names its fields; the user typed the flags
        raise ValueError(options.as_flag(str(exc), PD_FLAG_OF)) from None
    with guards_off(args.guard_off):
        resources.check_storm_fits(cfg, run_pd_stress)  # a long storm is measured first, refused if it cannot fit
        report = run_pd_stress(cfg)
    report["note"] = "discrete-event simulation of a PD cluster (virtual time), faults seeded"
    report["guards_off"] = list(args.guard_off)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:<28} {value}")
    return pd_verdict(args, failures(report), report["overwrites"])


def run_hicache(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lsconfig import envs
    from hicache.stress import StressConfig, run_stress
    from layersplit.engine.cp_pool import cache_spec
    from layersplit.plan.config import load_model

    model = load_model(args.model)
    cfg = StressConfig(layer_loads=args.loads, seed=args.seed, runtime=args.runtime, sanitize=envs.sanitize(),
                       unsafe_skip=frozenset(UNSAFE.get(args.unsafe_skip_wait, ())),
                       index_heads=model.index_n_heads, attn_heads=model.num_heads, topk=model.index_topk)
    eta = resources.eta_printer("stress hicache", args.loads, "layer loads")
    with tqdm(total=args.loads, unit="layer", disable=args.json, leave=False) as bar:
        report = run_stress(cache_spec(model), cfg, progress=lambda n: (bar.update(n), eta(n)))
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
