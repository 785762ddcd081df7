"""The one prepared GPU check: ``python benchmarks/gpu_check.py --out DIR [--dry-run] [--budget-s 480]``.

Thin entry point; the sections live in :mod:`layersplit.gpu_check.run` (also ``layersplit gpu-check``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from layersplit.cli.app import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["gpu-check", *sys.argv[1:]]))
