"""``layersplit`` command line. Subcommands: ``plan`` (KV capacity per CP rank), ``prefill`` (CP engine),
``sweep`` (the 40k-120k throughput sweep), ``stress hicache|pd|sglang-hicache|sglang-pool``,
``monitor replay|eval``,
``gpu-check`` (the prepared GPU check)."""

from __future__ import annotations

import argparse
import json
import sys

from lsconfig.config_io import ConfigError
from layersplit.cli import gpu_check_cmd, monitor_cmd, options, plan_cmd, prefill_cmd, stress_cmd, sweep_cmd


_int_at_least = options.int_at_least


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layersplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd.add_parser(sub, _int_at_least)
    stress_cmd.add_parser(sub, _int_at_least)
    prefill_cmd.add_parser(sub, _int_at_least)
    sweep_cmd.add_parser(sub, _int_at_least)
    monitor_cmd.add_parser(sub, _int_at_least)
    gpu_check_cmd.add_parser(sub, _int_at_least)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors (exit 2), --help and --version (exit 0)
        return int(exc.code or 0)
    try:
        return args.func(args)
    except (ConfigError, ValueError) as exc:
        print(f"layersplit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
