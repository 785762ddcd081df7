"""``layersplit`` command line. Subcommands: ``plan`` (KV capacity per CP rank), ``prefill`` (CP engine),
``sweep`` (the 40k-120k throughput sweep), ``stress hicache|pd|sglang-hicache|sglang-pool``,
``monitor replay|eval``, ``gpu-check`` (the prepared GPU check), ``sglang-plan``. The PD abort protocol's
model checker and real-transport storms are maintainers' tools, run from a checkout: ``python -m
tools.pd_check`` and ``python -m tools.pd_real``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from lsconfig import envs
from lsconfig.config_io import ConfigError
from layersplit import __version__
from layersplit.cli import (gpu_check_cmd, monitor_cmd, options, plan_cmd, prefill_cmd, resources, sglang_plan_cmd,
                            stress_cmd, sweep_cmd)


_int_at_least = options.int_at_least


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(prog="layersplit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_cmd.add_parser(sub, _int_at_least)
    stress_cmd.add_parser(sub, _int_at_least)
    prefill_cmd.add_parser(sub, _int_at_least)
    sweep_cmd.add_parser(sub, _int_at_least)
    monitor_cmd.add_parser(sub, _int_at_least)
    gpu_check_cmd.add_parser(sub, _int_at_least)
    sglang_plan_cmd.add_parser(sub, _int_at_least)
    sub.choices["prefill"].set_defaults(machine_env=True)  # runs kernels and CP ranks here: check_machine_env first
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so ``finally`` blocks run (rank processes are ended,
    files being written are closed) before the exit."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def _command_name(args: argparse.Namespace) -> str:
    words = [getattr(args, "command", None), getattr(args, "target", None), getattr(args, "action", None)]
    return " ".join(w for w in words if w)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status: 0 ok, 1 the check it ran failed, 2 bad input
    (one line naming the flag or config field), 3 incomplete (``gpu-check``: nothing failed, but a
    part it exists to check did not run), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)."""
    return run(build_parser(), argv, "layersplit")


def run(parser: argparse.ArgumentParser, argv: list[str] | None, prog: str) -> int:
    """Parse ``argv`` and run the chosen command (``args.func``) with the exit statuses of :func:`main`;
    a bad value is one line ``PROG COMMAND: error: ...`` on stderr. The maintainers' tools in ``tools/``
    run their own parsers through it, so they exit as the product does."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse's usage errors (exit 2), --help and --version (exit 0)
        return int(exc.code or 0)
    name = " ".join(w for w in (prog, _command_name(args)) if w)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        envs.check_all()  # every LAYERSPLIT_* variable, here in the parent, before anything is spawned
        if getattr(args, "machine_env", False):
            resources.check_machine_env()
        return args.func(args)
    except (ConfigError, ValueError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143
    except BrokenPipeError:  # the reader went away (``| head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a file the command reads or writes (a full disk, a vanished folder): one line
        if exc.filename is None:
            raise
        print(f"{name}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
