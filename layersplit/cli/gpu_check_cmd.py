"""``layersplit gpu-check``: the one prepared GPU check (see :mod:`layersplit.gpu_check.run`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser, int_at_least) -> None:
    """The check's flags, shared by the subcommand and ``benchmarks/gpu_check.py``."""
    p.add_argument("--out", required=True, help="output folder for gpu_check.json and gpu_check.md (created)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU (Triton interpreter, emulated streams), automatic without CUDA; "
                        "next to a GPU set TRITON_INTERPRET=1 at launch to include Triton")
    p.add_argument("--budget-s", type=int_at_least(1), default=450,  # gpu_check.BUDGET_S (not imported: torch)
                   help="seconds for the whole check; sections that no longer fit are skipped (default 450)")


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("gpu-check", help="prove and time the CUDA paths (kernels, HiCache, CP engine) in one run")
    add_arguments(p, int_at_least)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from layersplit.gpu_check.run import exit_code, print_end, run_check

    report = run_check(args.out, dry_run=args.dry_run, budget_s=args.budget_s)
    print_end(report, Path(args.out))
    return exit_code(report)
