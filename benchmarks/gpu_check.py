"""The one prepared GPU check: ``python benchmarks/gpu_check.py --out DIR [--dry-run] [--budget-s 480]``.

Thin entry point with the flags of ``layersplit gpu-check`` (:mod:`layersplit.cli.gpu_check_cmd`); the sections
live in :mod:`layersplit.gpu_check.run`. A bad flag is one line naming this script, exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from layersplit.cli import app, gpu_check_cmd, options  # noqa: E402

PROG = "python benchmarks/gpu_check.py"


def build_parser() -> options.Parser:
    parser = options.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    gpu_check_cmd.add_arguments(parser, options.int_at_least)
    parser.set_defaults(func=gpu_check_cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    return app.run(build_parser(), argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
