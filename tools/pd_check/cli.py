"""``python -m tools.pd_check``: exhaustive model checking of the PD abort protocol at small bounds: every
interleaving of events, message deliveries, faults and cancels, over the protocol code the stress runs
(:mod:`layersplit.pd.abort`); with ``--simulate WALKS``, random walks over the same states instead (bounds too
large to exhaust). Run from a checkout (``tools/`` is not in the wheel).

Exit status: 0 no violation (and the bound explored completely, or stopped by --max-states/--timeout — the
output says which), 1 a violation (the counterexample is printed — a shortest one unless the partial-order
reduction was in force, see ``--shortest``, or a walk's one-minimal trace with ``--simulate``; ``--save`` writes
it for ``--replay``), 3 with an UNSAFE switch (``--legacy-immediate-release`` / ``--guard-off``) when no
counterexample was found within the bounds, or a ``--replay`` that diverged (a step is no longer possible);
2 bad input, or ``--save`` could not be written (the result is printed first), 130 / 143 interrupted / terminated.

A search or a walk prints a progress line (states, depth, elapsed) on stderr every ``PROGRESS_S`` seconds, with
``--json`` too (stdout then holds only the JSON object).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from layersplit.cli import app, options


PROG = "python -m tools.pd_check"
PROGRESS_S = 10.0  # seconds between progress lines on stderr
# CheckBounds' field names as the flags that set them (the others are the flag with dashes)
FLAG_OF = {"timeout_s": "timeout", "legacy": "legacy-immediate-release", "guards_off": "guard-off"}


def main(argv: list[str] | None = None) -> int:
    return app.run(build_parser(), argv, PROG)


def build_parser() -> argparse.ArgumentParser:
    from layersplit.pd.abort.guards import GUARDS
    from tools.pd_check.bounds import FAULT_KINDS

    int_at_least = options.int_at_least
    c = options.Parser(prog=PROG, description="every interleaving of the PD abort protocol (explicit-state, "
                                                       "breadth-first), or random walks over it (--simulate)")
    c.add_argument("--prefill-ranks", type=int_at_least(1), default=2, help="LayerSplit prefill CP ranks (default 2)")
    c.add_argument("--requests", type=int_at_least(1), default=2, help="request ids submitted (default 2)")
    c.add_argument("--faults", type=int_at_least(0), default=2,
                   help="fault budget, shared by every kind --fault-kinds allows: drop / duplicate / reorder / "
                        "misaddress a message, fail a write batch, crash or kill a prefill rank, restart decode, "
                        "cut a rank's link, lose a live rank's lease (default 2)")
    c.add_argument("--pages", type=int_at_least(1), default=1, help="decode pages per request (default 1)")
    c.add_argument("--retries", type=int_at_least(0), default=1,
                   help="router retries of an aborted request: same rid, new room (default 1)")
    c.add_argument("--cancels", type=int_at_least(0), default=1, help="client cancels, at any moment (default 1)")
    c.add_argument("--abort-sends", type=int_at_least(1), default=2, help="abort sends before quarantine (default 2)")
    c.add_argument("--polls", type=int_at_least(0), default=1, help="decode poll re-sends per room (default 1)")
    c.add_argument("--channel-capacity", type=int_at_least(1), default=2,
                   help="messages in flight per endpoint pair explored (default 2)")
    c.add_argument("--max-states", type=int_at_least(1), default=2_000_000, help="stop after this many states")
    c.add_argument("--timeout", type=options.number_in(0, 1e9, low_open=True), default=600.0,
                   help="stop after this many seconds (default 600)")
    c.add_argument("--workers", type=_workers, default=1, metavar="N|auto",
                   help="processes expanding each breadth-first level (default 1; auto: one per CPU); the states "
                        "and verdict are the same for any count")
    c.add_argument("--fence-unreachable", action="store_true",
                   help="decode's fence_unreachable_s policy on: it may fence a rank that holds its lease but that it "
                        "hears nothing from (a cut link), at any moment")
    c.add_argument("--legacy-immediate-release", action="store_true",
                   help="UNSAFE: check the pre-hardening protocol (free at abort): expect a counterexample")
    c.add_argument("--guard-off", action="append", default=[], choices=sorted(GUARDS), metavar="GUARD",
                   help=f"UNSAFE: switch one hardening guard off (repeatable): {', '.join(GUARDS)}")
    c.add_argument("--fault-kinds", default=None, metavar="K1,K2",
                   help="spend the fault budget only on these kinds (default: all): " + ", ".join(FAULT_KINDS))
    c.add_argument("--no-symmetry", action="store_true",
                   help="explore without the symmetry reduction (ranks x request ids): the exhaustive cross-check")
    c.add_argument("--no-stale-events", action="store_true",
                   help="explore without the stale-event reduction (fire and hash events that can change nothing)")
    c.add_argument("--no-por", action="store_true",
                   help="explore without the partial-order reduction (its counterexamples are then shortest)")
    c.add_argument("--shortest", action="store_true",
                   help="if the counterexample found under the partial-order reduction may not be a shortest one, "
                        "re-run without it to that depth and report the shortest (with --simulate: the walk's "
                        "shortened trace's depth; the walk's trace stays if that search stops first)")
    c.add_argument("--simulate", type=int_at_least(1), default=None, metavar="WALKS",
                   help="instead of exploring every interleaving, run this many random walks (each state they reach "
                        "checked; not exhaustive): for bounds too large to explore (--max-states and the "
                        "symmetry and partial-order reductions do not apply to walks)")
    c.add_argument("--seed", type=options.seed, default=None, help="with --simulate: walk i draws from seed:i (default 0)")
    c.add_argument("--max-steps", type=int_at_least(1), default=None,
                   help="with --simulate: a walk stops after this many steps (default 500)")
    c.add_argument("--fault-rate", type=options.number_in(0, 1), default=None,
                   help="with --simulate: the chance per step of a fault or cancel while one is possible (default 0.1)")
    c.add_argument("--no-minimize", action="store_true",
                   help="with --simulate: report a violating walk's trace as it was, not shortened")
    c.add_argument("--save", type=_save_file, default=None, metavar="FILE",
                   help="write the counterexample (if any) as JSON (its folder is checked before the search)")
    c.add_argument("--replay", type=options.readable_file, default=None, metavar="FILE",
                   help="replay a saved counterexample step by step instead of exploring (its bounds are used)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=run_pd)
    return c


def run_pd(args: argparse.Namespace) -> int:
    from tools.pd_check import (CheckBounds, format_trace, load_counterexample, replay, run_check, save_counterexample,
                                shortest)

    if args.replay:
        _replay_alone(args)  # the file's bounds are replayed: a bound flag beside it would be ignored
        return _replay(args, load_counterexample, replay, format_trace)
    plan = _walk_plan(args)  # before any work: a walk flag without --simulate is refused
    try:
        bounds = _bounds(args, CheckBounds)
    except ValueError as exc:  # the bounds name their fields; the user typed the flags
        raise ValueError(options.as_flag(str(exc), FLAG_OF)) from None
    progress = _progress_printer()
    if plan is not None:
        from tools.pd_check.simulate import shortest_walk, simulate

        result = simulate(bounds, plan, workers=args.workers, progress=progress)
        if args.shortest:
            result = shortest_walk(bounds, result, workers=args.workers)
    else:
        result = run_check(bounds, workers=args.workers, progress=progress)
        if args.shortest:
            result = shortest(bounds, result, workers=args.workers, progress=progress)
    _print_result(args, result, plan is not None, format_trace)
    if args.save and result["counterexample"]:
        try:  # after the result is printed: a failed write loses the file, not the search
            save_counterexample(args.save, result)
        except OSError as exc:
            print(f"{PROG}: error: --save: could not write {str(args.save)!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    unsafe = args.legacy_immediate_release or args.guard_off
    if unsafe:
        return 0 if result["violations"] else 3
    return 1 if result["violations"] else 0


def _bounds(args: argparse.Namespace, CheckBounds):
    return CheckBounds(prefill_ranks=args.prefill_ranks, requests=args.requests, faults=args.faults,
                       pages=args.pages, retries=args.retries, cancels=args.cancels, abort_sends=args.abort_sends,
                       polls=args.polls, channel_capacity=args.channel_capacity, max_states=args.max_states,
                       timeout_s=args.timeout, legacy=args.legacy_immediate_release, guards_off=tuple(args.guard_off),
                       fence_unreachable=args.fence_unreachable, symmetry=not args.no_symmetry,
                       stale_events=not args.no_stale_events, por=not args.no_por, **_kinds(args.fault_kinds))


def _print_result(args: argparse.Namespace, result: dict, walked: bool, format_trace) -> None:
    if args.json:
        print(json.dumps(result))
    else:
        keys = _SIMULATION_KEYS if walked else _SEARCH_KEYS
        for key in keys:
            print(f"{key:<28} {_end_classes(result[key]) if key == 'end_classes' else result[key]}")
        if result["counterexample"]:
            maybe = "(one-minimal, maybe not shortest: --shortest)" if walked \
                else "(maybe not shortest: --shortest or --no-por)"
            which = "shortest" if result["shortest"] else maybe
            print(f"{which} counterexample:\n" + format_trace(result["counterexample"]))


def _progress_printer():
    """``progress(states, depth)`` for a search or ``progress(walks, steps)`` for walks: a line on stderr every
    ``PROGRESS_S`` seconds (a search that ends sooner prints none)."""
    start = last = time.perf_counter()

    def say(count: int, depth: int, what: str = "states") -> None:
        nonlocal last
        now = time.perf_counter()
        if now - last >= PROGRESS_S:
            last = now
            deep = "depth" if what == "states" else "steps"
            print(f"{PROG}: {count:,} {what}, {deep} {depth:,}, {now - start:,.0f} s", file=sys.stderr, flush=True)

    return say


def _replay_alone(args: argparse.Namespace) -> None:
    """--replay runs the file's bounds: any bound or search flag given beside it would do nothing."""
    defaults = vars(build_parser().parse_args([]))
    given = [name for name, value in vars(args).items() if name not in ("replay", "json", "func")
             and defaults.get(name) != value]
    if given:
        flag = next(a.option_strings[0] for a in build_parser()._actions if a.dest == given[0])
        raise ValueError(f"{flag}: expected no bound or search flag with --replay (the file's bounds are replayed), "
                         f"got {flag}")


_SEARCH_KEYS = ("states", "depth", "transitions", "terminal_states", "pruned_by_channel_capacity", "por_reduced_states",
                "seconds", "states_per_s", "workers", "reductions", "complete", "stopped", "violations")
_SIMULATION_KEYS = ("walks", "steps", "terminal_walks", "truncated_walks", "stuck_walks", "faults_spent",
                    "pruned_by_channel_capacity", "violating_walk", "raw_trace_length", "end_classes", "seconds",
                    "steps_per_s", "workers", "complete", "stopped", "violations")
_WALK_FLAGS = (("seed", "--seed"), ("max_steps", "--max-steps"), ("fault_rate", "--fault-rate"))


def _end_classes(e: dict) -> str:
    if not e["walks"]:
        return "no walk ended with nothing owed"
    return (f"{e['classes']} classes over {e['walks']} terminal walks ({e['seen_once']} seen once, {e['seen_twice']} "
            f"twice); estimated chance the next walk ends in an unseen one {e['unseen_mass']} (Good-Turing), "
            f"classes walks reach >= ~{e['chao1_classes']} (Chao1); estimates, not exhaustive")


def _walk_plan(args: argparse.Namespace):
    """The --simulate plan, or None; a walk flag given without --simulate is refused (it would do nothing)."""
    given = [flag for name, flag in _WALK_FLAGS if getattr(args, name) is not None] + ["--no-minimize"] * args.no_minimize
    if args.simulate is None:
        if given:
            raise ValueError(f"{given[0]}: expected it only with --simulate WALKS, got it without")
        return None
    from tools.pd_check.simulate import WalkPlan

    chosen = {name: getattr(args, name) for name, _ in _WALK_FLAGS if getattr(args, name) is not None}
    return WalkPlan(walks=args.simulate, minimize=not args.no_minimize, **chosen)


def _save_file(text: str):
    """--save: a file in a folder that exists and is writable (checked before the search: it may take hours)."""
    path = options.writable_file(text)
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file in a writable folder, got {text!r} (no folder "
                                         f"{str(path.parent)!r})")
    return path


def _workers(text: str) -> int | str:
    from tools.pd_check.parallel import resolve_workers

    try:
        return resolve_workers(text if text == "auto" else int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}") from None


def _kinds(text: str | None) -> dict:
    if text is None:
        return {}
    return {"fault_kinds": tuple(k.strip() for k in text.split(",") if k.strip())}  # CheckBounds names a bad one


def _replay(args, load_counterexample, replay, format_trace) -> int:
    bounds, trace, recorded = load_counterexample(args.replay)
    outcome = replay(bounds, trace)
    if args.json:
        print(json.dumps({"bounds": bounds.to_dict(), "recorded": recorded, **outcome}))
    else:
        print(format_trace({"trace": trace[:outcome["steps"]], "violation": outcome["violation"]}))
    if outcome["diverged"]:  # the code changed under the trace: it no longer reproduces (or refutes) anything
        print(f"{PROG}: diverged: step {outcome['steps'] + 1} of {args.replay} is not possible any more: "
              f"{outcome['diverged']}", file=sys.stderr)
        return 3
    return 1 if outcome["violation"] else 0
