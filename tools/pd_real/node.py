"""The real pair's processes: ``python -m tools.pd_real.node decode|prefill RUN_DIR NAME``.

Each process runs the protocol's own node — :class:`~layersplit.pd.abort.decode_side.DecodeNode` (with the router
and the bootstrap registry) or one :class:`~layersplit.pd.abort.prefill_side.PrefillNode` — unchanged, on a
:class:`~tools.pd_real.wall_loop.WallLoop`, with :class:`~tools.pd_real.zmq_channel.ZmqChannel` as its
control channel and Mooncake as its transfer engine. The supervisor (:mod:`tools.pd_real.storm`)
writes ``RUN_DIR/config.pkl`` (a :class:`~tools.pd_real.process.RealRun`) and one ``RUN_DIR/NAME.json``
per process (its addresses, and a prefill process's incarnation; decode's life is the registry's:
``decode-life-decode``, see :mod:`tools.pd_real.registry_link`); each process writes, as it goes:

* ``ready-NAME`` once it serves; decode also ``layout-LIFE.json`` (its session and regions) first;
* ``NAME.stats.json`` every ``snapshot_s`` and at exit (atomic rename: a SIGKILL leaves the last one);
* decode: ``outcomes.jsonl``, one line per request id that reached its final outcome.

SIGTERM (or SIGINT) stops the loop; the final stats are written and the process exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("decode", "prefill"):
        raise SystemExit(f"usage: python -m tools.pd_real.node decode|prefill RUN_DIR NAME, got {argv}")
    role, run_dir, name = argv[0], Path(argv[1]), argv[2]
    if role == "decode":
        from tools.pd_real.decode_proc import DecodeProcess as Role
    else:
        from tools.pd_real.prefill_proc import PrefillProcess as Role
    return Role(run_dir, name).main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
