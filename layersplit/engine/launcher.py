"""Run the CP prefill engine in N real processes (gloo on CPU, NCCL on CUDA) or in-process.

``run_cp`` starts one process per rank (:mod:`layersplit.engine.rank_worker`), runs every scenario in order on all ranks, and returns the
per-scenario results (hidden states reassembled in global new-token order). ``run_reference`` is
the single-process path (one rank, redundant pool, no communication) the CP runs are checked against.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hicache.sanitizer import csan
from hicache import sanitizer
from hicache.runtime.streams import get_runtime
from layersplit.engine.batch_plan import Request
from layersplit.plan.config import ModelConfig
from layersplit.engine.engine import EngineConfig, FaultInjection, RankEngine, RankResult
from layersplit.engine.model import RowBlocks


@dataclass
class Scenario:
    name: str
    requests: list[Request]
    cfg: EngineConfig
    model: ModelConfig | None = None  # None: the model given to run_cp / run_reference


@dataclass
class CPResult:
    name: str
    hidden: torch.Tensor  # [n_new, hidden], global order
    ranks: list[RankResult]

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _merge(name: str, results: list[RankResult]) -> CPResult:
    n = sum(len(r.local) for r in results)
    hidden = torch.empty(n, results[0].hidden.shape[1])
    for r in results:
        hidden[r.local] = r.hidden
    return CPResult(name, hidden, sorted(results, key=lambda r: r.rank))


def _run_rank(model: ModelConfig, scenarios: list[Scenario], rank: int, row_blocks: int = 1) -> list[RankResult]:
    """Every scenario on this rank; under ``LAYERSPLIT_SANITIZE=1`` each is sanitized (its result
    carries the hazards found), and under CUDA's sanitizer (``TORCH_CUDA_SANITIZER=1``) each records
    every hazard CSAN finds (:mod:`hicache.sanitizer.csan`). ``row_blocks``: the model's row-wise stages in that many blocks."""
    out = []
    for sc in scenarios:
        san, rt = sanitizer.enable_from_env(), None
        with csan.collecting() if csan.active() else contextlib.nullcontext() as found:  # CUDA: CSAN's hazards
            try:
                rt = get_runtime("cuda" if torch.cuda.is_available() else "emulated")
                engine = RankEngine(sc.model or model, sc.cfg, rank, rt)
                if row_blocks > 1:
                    engine.model = RowBlocks(engine.model, row_blocks)
                out.append(engine.prefill(sc.requests).host())
            except Exception as exc:
                if found:  # a run that carried a race on to a kernel that then failed: say what CSAN saw first
                    raise RuntimeError(f"{exc!r} after CUDA's sanitizer recorded {len(found)} hazard(s); "
                                       f"the first:\n{found[0][:3000]}") from exc
                raise
            finally:
                if rt is not None:
                    rt.close()
                if san is not None:
                    sanitizer.disable()
        if san is not None:
            out[-1].hazards = [str(h) for h in san.hazards]
            out[-1].hazard_kinds = san.by_kind()
        elif found is not None:
            out[-1].hazards = list(found)
    return out


def _child_setup(parent: int) -> None:
    """In each rank process before it execs: SIGINT ignored (a terminal's Ctrl-C reaches the whole
    process group; the parent alone handles it and ends the ranks), every other signal at its default
    (whatever the parent inherited), and, on Linux, SIGKILL from the kernel when the parent dies, however
    it dies, so no rank is left computing as an orphan."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the death signal was armed
            os._exit(1)


def _child_env() -> dict[str, str]:
    """The parent's environment, with this package's root first on ``PYTHONPATH``: a rank imports the
    same ``layersplit`` as the parent, however the parent found it."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": root + (os.pathsep + path if path else "")}


def cp_backend(world: int) -> str:
    """The collective backend of ``world`` rank processes: ``LAYERSPLIT_CP_BACKEND``, else NCCL where
    CUDA has a GPU per rank, gloo otherwise (on CPU; and on fewer GPUs than ranks, which share them
    round-robin: NCCL refuses two ranks on one device). An explicit ``nccl`` there is refused."""
    from lsconfig import envs

    choice, gpus = envs.cp_backend(), torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "nccl" and gpus < world:
        raise ValueError(f"LAYERSPLIT_CP_BACKEND: nccl needs a GPU per rank ({world} ranks, {gpus} GPU(s) here); "
                         "unset it (gloo is then chosen) or set gloo")
    if choice != "auto":
        return choice
    return "nccl" if gpus >= world else "gloo"


def _failure(rank: int, proc: subprocess.Popen, log: Path) -> RuntimeError:
    tail = log.read_text(errors="replace")[-2000:].strip() if log.exists() else ""
    return RuntimeError(f"rank {rank} exited with code {proc.returncode} before reporting"
                        + (f":\n{tail}" if tail else ""))


def _collect(procs: list[subprocess.Popen], out: Path, timeout_s: float, on_ready) -> dict[int, list]:
    """Every rank's results; a rank that failed or died, or a run past ``timeout_s``, raises."""
    by_rank: dict[int, list] = {}
    ready: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while len(by_rank) < len(procs):
        for r, proc in enumerate(procs):
            if r in by_rank:
                continue
            if r not in ready and (out / f"rank{r}.ready").exists():
                ready.add(r)
                if len(ready) == len(procs) and on_ready is not None:
                    on_ready()
            result = out / f"rank{r}.pt"
            if result.exists():
                payload = torch.load(result, weights_only=False)
                if "error" in payload:
                    raise RuntimeError(f"rank {r} failed:\n{payload['error']}")
                by_rank[r] = payload["results"]
            elif proc.poll() is not None:  # died without reporting (killed, out of memory)
                raise _failure(r, proc, out / f"rank{r}.log")
        if len(by_rank) < len(procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"CP ranks: no result within {timeout_s:g} s")
            time.sleep(0.05)
    return by_rank


def run_cp(model: ModelConfig, scenarios: list[Scenario], cp: int, timeout_s: float = 600,
           on_ready=None) -> list[CPResult]:
    """Run ``scenarios`` (all with ``cfg.cp == cp``) on ``cp`` rank processes, each a fresh
    ``python -m layersplit.engine.rank_worker`` (never a re-import of the caller's ``__main__``).
    ``on_ready()``: called once every rank has joined the process group."""
    for sc in scenarios:
        if sc.cfg.cp != cp:
            raise ValueError(f"scenario {sc.name}: expected cfg.cp == {cp}, got {sc.cfg.cp}")
    if sanitizer.enabled_by_env() and torch.cuda.is_available():  # one line here, not a traceback per rank
        from hicache.runtime.streams import BLIND_SANITIZER

        raise ValueError(BLIND_SANITIZER)
    cp_backend(cp)  # an impossible backend refused here, in one line, before any rank starts
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="layersplit-cp-") as tmp:
        out = Path(tmp)
        job = out / "job.pt"
        torch.save((model, scenarios), job)
        procs, ok = [], False
        env = _child_env()
        setup = functools.partial(_child_setup, os.getpid()) if os.name == "posix" else None
        try:
            for r in range(cp):
                with open(out / f"rank{r}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "layersplit.engine.rank_worker", str(job), str(r), str(cp), str(port),
                         str(out)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, preexec_fn=setup))
            by_rank = _collect(procs, out, timeout_s, on_ready)
            ok = True
        finally:
            for p in procs:  # after a failure or an interrupt the ranks are ended at once
                if ok:
                    with contextlib.suppress(subprocess.TimeoutExpired):  # still running after 30 s: killed below
                        p.wait(timeout=30)
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=5)
    return [_merge(sc.name, [by_rank[r][i] for r in range(cp)]) for i, sc in enumerate(scenarios)]


def run_reference(model: ModelConfig, scenario: Scenario, row_blocks: int = 1) -> CPResult:
    """The single-process reference: one rank, every layer in its pool, nothing communicated, the
    scenario's ``kv_dtype`` kept (fp8: the same quantized rows as the CP ranks store, like with like).
    ``row_blocks > 1``: its GEMMs over that many row blocks (:class:`RowBlocks`: what a different
    row split alone changes on a device whose GEMMs are not batch-invariant)."""
    cfg = replace(scenario.cfg, cp=1, mode="redundant", faults=FaultInjection())  # nothing to stall or skip
    single = Scenario(scenario.name, scenario.requests, cfg, scenario.model)
    return _merge(scenario.name, _run_rank(model, [single], 0, row_blocks))

