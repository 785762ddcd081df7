"""Run the CP prefill engine in N real processes (gloo on CPU, NCCL on CUDA) or in-process.

``run_cp`` spawns one process per rank, runs every scenario in order on all ranks, and returns the
per-scenario results (hidden states reassembled in global new-token order). ``run_reference`` is
the single-process path (one rank, redundant pool, no communication) the CP runs are checked against.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache import sanitizer
from hicache.streams import get_runtime
from layersplit.engine.batch_plan import Request
from layersplit.plan.config import ModelConfig
from layersplit.engine.engine import EngineConfig, RankEngine, RankResult


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


def _run_rank(model: ModelConfig, scenarios: list[Scenario], rank: int) -> list[RankResult]:
    """Every scenario on this rank; under ``LAYERSPLIT_SANITIZE=1`` each is sanitized (its result
    carries the hazards found)."""
    out = []
    for sc in scenarios:
        san, rt = sanitizer.enable_from_env(), None
        try:
            rt = get_runtime("cuda" if torch.cuda.is_available() else "emulated")
            out.append(RankEngine(sc.model or model, sc.cfg, rank, rt).prefill(sc.requests).host())
        finally:
            if rt is not None:
                rt.close()
            if san is not None:
                sanitizer.disable()
        if san is not None:
            out[-1].hazards = [str(h) for h in san.hazards]
            out[-1].hazard_kinds = san.by_kind()
    return out


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when the parent that spawned it exits, however it
    exits (SIGTERM, SIGKILL, a crash), so no rank is left computing as an orphan."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return


def _worker(rank: int, world: int, port: int, model: ModelConfig, scenarios: list[Scenario], queue,
            parent: int | None = None) -> None:
    _die_with_parent()
    if parent is not None and os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)
    torch.set_num_threads(1)  # N ranks share the machine's cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over loopback
    backend = cp_backend()
    if torch.cuda.is_available():  # ranks share GPUs round-robin (one GPU: gloo, both ranks on it)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # plain bytes: tensors sent through a queue as shared memory die with this process
        buf = io.BytesIO()
        torch.save(_run_rank(model, scenarios, rank), buf)
        queue.put((rank, buf.getvalue(), None))
    except Exception:  # report instead of hanging the parent
        import traceback
        queue.put((rank, None, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def cp_backend() -> str:
    """The collective backend of the rank processes: ``LAYERSPLIT_CP_BACKEND``, else NCCL on CUDA, gloo on CPU."""
    from lsconfig import envs

    choice = envs.cp_backend()
    return choice if choice != "auto" else "nccl" if torch.cuda.is_available() else "gloo"


def run_cp(model: ModelConfig, scenarios: list[Scenario], cp: int, timeout_s: float = 600) -> list[CPResult]:
    """Run ``scenarios`` (all with ``cfg.cp == cp``) on ``cp`` spawned rank processes."""
    for sc in scenarios:
        if sc.cfg.cp != cp:
            raise ValueError(f"scenario {sc.name}: expected cfg.cp == {cp}, got {sc.cfg.cp}")
    if sanitizer.enabled_by_env() and torch.cuda.is_available():  # one line here, not a traceback per rank
        from hicache.streams import BLIND_SANITIZER

        raise ValueError(BLIND_SANITIZER)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, cp, port, model, scenarios, queue, os.getpid()), daemon=True)
             for r in range(cp)]
    # The ranks start with SIGINT ignored (inherited through exec), so Ctrl-C at a terminal, which
    # reaches the whole process group, interrupts only this process; it then ends the ranks below.
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        for p in procs:
            p.start()
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, old)
    by_rank, ok = {}, False
    deadline = time.monotonic() + timeout_s
    try:
        while len(by_rank) < cp:
            try:
                rank, results, error = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in by_rank and not p.is_alive() and p.exitcode != 0]
                if dead:  # a rank that died without reporting (killed, out of memory) fails the run now
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CP ranks: no result within {timeout_s:g} s") from None
                continue
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            by_rank[rank] = torch.load(io.BytesIO(results), weights_only=False)
        ok = True
    finally:
        for p in procs:  # after a failure or an interrupt the ranks are ended at once
            if ok:
                p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [_merge(sc.name, [by_rank[r][i] for r in range(cp)]) for i, sc in enumerate(scenarios)]


def run_reference(model: ModelConfig, scenario: Scenario) -> CPResult:
    """The single-process reference: one rank, every layer in its pool, nothing communicated."""
    cfg = replace(scenario.cfg, cp=1, mode="redundant", hicache_delay_s=0.0, unsafe_skip_coherence=False)
    single = Scenario(scenario.name, scenario.requests, cfg, scenario.model)
    return _merge(scenario.name, _run_rank(model, [single], 0))

