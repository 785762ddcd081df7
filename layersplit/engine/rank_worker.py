"""One CP rank process: ``python -m layersplit.engine.rank_worker JOB RANK WORLD PORT OUT``.

Started by :func:`layersplit.engine.launcher.run_cp` as a fresh interpreter running this module, so a
rank never imports the caller's ``__main__`` (multiprocessing's ``spawn`` re-imports it: a user's script
without an ``if __name__ == "__main__":`` guard would run again in every rank, and code piped to
``python -`` has no file to re-import). It reads the job (model and scenarios, ``torch.save``-d by the
parent), joins the process group, runs every scenario and writes ``OUT/rank{R}.pt`` — its results, or
the traceback of its failure — atomically (written aside, then renamed), after ``OUT/rank{R}.ready``
once the group is up. The parent arms ``PR_SET_PDEATHSIG`` before exec, so a rank dies with it.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path


def _write(path: Path, payload: dict) -> None:
    import torch

    tmp = path.with_suffix(".part")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    job, rank, world, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    import torch
    import torch.distributed as dist

    from layersplit.engine.launcher import _run_rank, cp_backend

    torch.set_num_threads(1)  # N ranks share the machine's cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over loopback
    result = out / f"rank{rank}.pt"
    try:
        model, scenarios = torch.load(job, weights_only=False)
        if torch.cuda.is_available():  # ranks share GPUs round-robin (one GPU: gloo, both ranks on it)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(cp_backend(world), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        (out / f"rank{rank}.ready").touch()
        try:
            _write(result, {"results": _run_rank(model, scenarios, rank)})
        finally:
            dist.destroy_process_group()
    except Exception:  # reported to the parent instead of printed: it says what failed, once
        _write(result, {"error": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
