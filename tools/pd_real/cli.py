"""``python -m tools.pd_real storm [flags]`` and ``python -m tools.pd_real probes [NAME ...]``: the PD abort
protocol on real processes (run from a checkout; needs the ``dev`` extra's Mooncake and ZMQ wheels).

``storm``: the seeded fault storm of ``layersplit stress pd`` with the decode worker and every prefill rank as OS
processes on loopback, Mooncake TCP for the KV, ZMQ through a fault proxy, wall-clock seconds, SIGKILL /
SIGSTOP for the crash and outage faults (same flags, same report, same exit statuses: 0 safe, 1 a failure of
the safe protocol, 3 an UNSAFE run that showed nothing, 2 bad input, 130 / 143 interrupted / terminated).

``probes``: measure the assumptions the protocol makes about late writes and message order (a, a-timeout, b,
b-running, b-fence, c, c-reregister, d, d-kill, d-proxy; all by default), one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from layersplit.cli import app, options, stress_cmd
from tools.pd_real import probes, proxy_order, zmq_order

PROG = "python -m tools.pd_real"

PROBES = {
    "a": lambda: probes.after_complete(),
    "a-timeout": lambda: probes.after_timeout(),
    "b": lambda: probes.after_kill(),
    "b-running": lambda: probes.after_kill(stall_decode=False, kill_after_s=0.0, count=2048),
    "b-fence": lambda: probes.after_kill(fence=True),
    "c": lambda: probes.after_deregister(),
    "c-reregister": lambda: probes.after_deregister(reregister=True),
    "d": lambda: {p: zmq_order.order(p) for p in zmq_order.PATTERNS},
    "d-kill": lambda: {p: zmq_order.order(p, count=3000, kill_first_after=500) for p in zmq_order.PATTERNS},
    "d-proxy": lambda: {f"seed {s}": proxy_order.order_through_proxy(seed=s) for s in (0, 1, 2)},
}


def main(argv: list[str] | None = None) -> int:
    return app.run(build_parser(), argv, PROG)


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(prog=PROG, description=__doc__.split("\n\n")[0])  # usage errors: one line
    sub = parser.add_subparsers(dest="command", required=True)
    storm = sub.add_parser("storm", help="the abort storm on real processes (Mooncake TCP, ZMQ, signals)")
    stress_cmd.add_pd_arguments(storm, options.int_at_least)
    storm.add_argument("--restart-after-s", type=_seconds_or_never, default=1.0, metavar="SECONDS|never",
                       help="a --kill-rank rank comes back this many seconds after its SIGKILL (default 1; "
                            "never: killed for good, fenced once its lease is gone)")
    storm.add_argument("--page-bytes", type=options.int_at_least(17), default=16384,
                       help="bytes per KV page per layer (default 16384)")
    storm.add_argument("--out", default=None, metavar="DIR",
                       help="the run's folder (every process's stats, outcomes, logs; default a new temp dir)")
    storm.add_argument("--timeout-s", type=options.number_in(1, 1e6), default=900.0,
                       help="end the run after this many wall seconds (default 900)")
    storm.add_argument("--json", action="store_true", help="print the report as one JSON object")
    storm.set_defaults(func=run_storm)
    probe = sub.add_parser("probes", help="measure the protocol's assumptions, one JSON line each")
    probe.add_argument("names", nargs="*", metavar="NAME", help=f"probes to run (default all): {', '.join(PROBES)}")
    probe.set_defaults(func=run_probes)
    return parser


def run_probes(args: argparse.Namespace) -> int:
    names = args.names or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise ValueError(f"NAME: expected any of {list(PROBES)}, got {unknown}")
    for name in names:
        print(json.dumps({"probe": name, **PROBES[name]()}), flush=True)
    return 0


def run_storm(args: argparse.Namespace) -> int:
    """The storm on real processes (:mod:`tools.pd_real.storm`); exit codes as for the simulation."""
    _real_only_faults(args)
    cfg = stress_cmd.pd_config(args, default_layers=args.prefill_cp)  # one registered region per rank
    from tools.pd_real.engine import import_engine

    try:
        import_engine()
    except ImportError as exc:  # a missing dependency is refused like any bad input: one line, exit 2
        raise ValueError(str(exc)) from None
    from tools.pd_real.process import RealRun
    from tools.pd_real.storm import StormFaults, failures, run_real_storm

    run_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="pd-real-storm-"))
    faults = StormFaults(drop=args.drop, max_delay_s=args.max_delay_s, restart_after_s=args.restart_after_s,
                         timeout_s=args.timeout_s)
    report = run_real_storm(RealRun(cfg, page_bytes=args.page_bytes, guards_off=tuple(args.guard_off)), faults,
                            run_dir)
    report["note"] = "real processes on loopback (wall-clock seconds): Mooncake TCP for the KV, ZMQ via a fault proxy"
    print(json.dumps(report) if args.json else "\n".join(f"{k:<28} {v}" for k, v in report.items()))
    return stress_cmd.pd_verdict(args, failures(report), report["overwrites"])


def _real_only_faults(args: argparse.Namespace) -> None:
    """Refuse the simulation-only faults (one clear error before any process starts)."""
    from tools.pd_real.process import REAL_GUARDS

    for flag, value in (("--duplicate", args.duplicate), ("--restart-mean-s", args.restart_mean_s),
                        ("--misaddress", args.misaddress or None)):
        if value is not None:
            raise ValueError(f"{flag}: expected it only with layersplit stress pd (the real pair has no such fault), "
                             f"got {value!r}")
    for name in args.guard_off:
        if name not in REAL_GUARDS:
            raise ValueError(f"--guard-off: expected {' or '.join(REAL_GUARDS)} on real processes (the other "
                             f"guards are simulation-only), got {name!r}")
    args.duplicate, args.restart_mean_s = 0.0, 0.0


def _seconds_or_never(text: str) -> float | None:
    if text == "never":
        return None
    try:
        return options.number_in(0, 1e6)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected seconds in [0, 1e+06] or never, got {text!r}") from None
