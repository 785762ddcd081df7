"""Wall and CPU time of the modelled sweep + a gain map, as ``layersplit sweep --engine model --map
sessions=16,32,64,128`` runs them (sweep, sensitivity and calibration tables, map), and how many
batch costs the cost model computed vs served from its memo.

    .venv/bin/python benchmarks/sweep_speed.py [--map 16,32,64,128] [--out out/sweep-speed]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--map", default="16,32,64,128", help="session counts of the gain map")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    args = p.parse_args()
    from layersplit.api import sweep
    from layersplit.serving import cost_model
    from layersplit.serving.gain_map import run_map
    from layersplit.serving.sweep_config import load_sweep

    out = args.out or Path(tempfile.mkdtemp(prefix="sweep-speed-"))
    wall, cpu = time.perf_counter(), time.process_time()
    sweep("glm5-h200", engine="model", out=out)
    run_map(load_sweep("glm5-h200"), "sessions", [float(v) for v in args.map.split(",")], out)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    costed = sum(len(m) for m in cost_model._MEMOS.values())
    print(f"modelled sweep + sensitivity + calibration + map sessions={args.map}: {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU (this process); {costed:,} distinct batch costs computed; outputs in {out}")


if __name__ == "__main__":
    main()
