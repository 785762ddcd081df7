"""``layersplit gpu-check``: the one prepared GPU check (see :mod:`layersplit.gpu_check.run`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layersplit.cli import options


def add_arguments(p: argparse.ArgumentParser, int_at_least) -> None:
    """The check's flags, shared by the subcommand and ``benchmarks/gpu_check.py``."""
    p.add_argument("--out", required=True, type=options.writable_dir,
                   help="output folder for gpu_check.json and gpu_check.md (created; checked before the run)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU (Triton interpreter, emulated streams), automatic without CUDA; "
                        "next to a GPU set TRITON_INTERPRET=1 at launch to include Triton")
    p.add_argument("--budget-s", type=int_at_least(1), default=480,  # gpu_check.BUDGET_S (not imported: torch)
                   help="seconds for the whole check; sections that no longer fit are skipped (default 480)")
    p.add_argument("--sections", type=_sections, default=None, metavar="A,B",
                   help=f"run only these sections (environment always runs), e.g. a rerun of what failed: "
                        f"{', '.join(SECTION_NAMES)}")


SECTION_NAMES = ("environment", "kernels", "vendor", "hicache_stress", "hicache_overlap", "cp_engine",
                 "stream_sanitizer")  # gpu_check.run.SECTIONS (not imported here: torch); a test keeps them equal


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [n for n in names if n not in SECTION_NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(SECTION_NAMES)}; got {text!r}")
    return names


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("gpu-check", help="prove and time the CUDA paths (kernels, HiCache, CP engine) in one run")
    add_arguments(p, int_at_least)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 passed, 1 failed, 3 incomplete (``layersplit.gpu_check.report``)."""
    from layersplit.gpu_check.run import exit_code, print_end, run_check

    report = run_check(args.out, dry_run=args.dry_run, budget_s=args.budget_s, sections=args.sections)
    print_end(report, Path(args.out))
    return exit_code(report)
