"""The abort storm on real parts: decode and each prefill rank as OS processes on loopback, Mooncake
(TCP) for the KV, ZMQ for control through a fault proxy, and real faults — SIGKILL of a prefill rank
mid-transfer (restarted as a new incarnation), SIGKILL of decode (restarted as a new life), control
messages dropped and delayed, a rank's link partitioned until it heals, a rank frozen (SIGSTOP, then
SIGCONT: its heartbeats starve, so its lease expires while it lives — a false suspicion). Bounded: every
fault is in the config, and the run ends at ``timeout_s``.

``run_real_storm(cfg, real)`` takes the simulation's :class:`~layersplit.pd.abort.stress_config.PDStressConfig`
(workload, topology, decode and prefill configuration; ``kill`` = SIGKILL + restart ``restart_after_s``
later (``None``: for good), ``outage`` = SIGKILL + restart after its seconds, ``partition`` = the proxy
cuts the rank's link, ``lease_loss`` = SIGSTOP the rank, SIGCONT it that many seconds later,
``restart_decode`` = SIGKILL decode + a new life) and returns the report. Fault times count from the
moment decode's first life is ready (serving), so a process's start-up time never moves a fault.
Results are written under ``run_dir`` as they go (each process's stats, ``outcomes.jsonl``,
``faults.jsonl``). Ctrl-C or SIGTERM ends every process (each also dies with the supervisor: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tools.pd_real.process import RealRun

MUST_BE_ZERO = ("overwrites", "stale_reads", "checksum_mismatches", "bad_frees", "source_stale_reads",
                "leaked_pages", "prefill_leaked_pages", "requests_still_held")
READY_S = 60.0


@dataclass(frozen=True)
class StormFaults:
    drop: float = 0.0  # the proxy's per-message loss
    min_delay_s: float = 0.0
    max_delay_s: float = 0.0
    restart_after_s: float | None = 1.0  # a SIGKILLed prefill rank (``kill``) comes back this long after;
    # None: never (a permanent kill: decode fences the dead rank once its lease is gone and releases its pages)
    timeout_s: float = 600.0  # the whole run

    def __post_init__(self) -> None:
        if self.restart_after_s is not None and not self.restart_after_s >= 0:
            raise ValueError(f"restart_after_s: expected seconds >= 0 or None (never), got {self.restart_after_s!r}")


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _child_setup(parent: int) -> None:
    """SIGINT ignored (the supervisor ends its children), SIGKILL when the supervisor dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)


class Supervisor:
    def __init__(self, run: RealRun, faults: StormFaults, run_dir: Path) -> None:
        from tools.pd_real.proxy import FaultProxy, ProxyFaults

        self.run, self.faults, self.dir = run, faults, run_dir
        ranks = run.stress.topology.ranks
        self.decode_addr = _port()
        self.prefill_addr = {r: _port() for r in ranks}
        self.proxy_decode, self.proxy_prefill = _port(), {r: _port() for r in ranks}
        routes = {self.proxy_decode: self.decode_addr, **{self.proxy_prefill[r]: self.prefill_addr[r] for r in ranks}}
        self.proxy = FaultProxy(routes, ProxyFaults(faults.drop, faults.min_delay_s, faults.max_delay_s),
                                seed=run.stress.seed)
        self.procs: dict[str, subprocess.Popen] = {}  # process name -> the live process of that role
        self.incarnation = {r: 0 for r in ranks}
        self.decodes = 0  # decode processes started before the current one: it is named decode-l<decodes>
        # (its life is the registry's own — the same number while only this supervisor starts decode)
        self.log = (run_dir / "faults.jsonl").open("a")
        self.t0 = 0.0
        (run_dir / "config.pkl").write_bytes(pickle.dumps(run))  # read back by our children only (Process)

    # processes ---------------------------------------------------------------------------------------
    def _spawn(self, role: str, name: str, me: dict, wait_ready: bool = True) -> None:
        (self.dir / f"{name}.json").write_text(json.dumps(me))
        root = str(Path(__file__).resolve().parents[2])  # the checkout: tools/ is not installed
        env = os.environ | {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
                            "GLOG_minloglevel": "3"}
        with open(self.dir / f"{name}.log", "ab") as log:
            self.procs[me["endpoint"]] = subprocess.Popen(
                [sys.executable, "-m", "tools.pd_real.node", role, str(self.dir), name], stdout=log,
                stderr=subprocess.STDOUT, env=env, preexec_fn=functools.partial(_child_setup, os.getpid()))
        if wait_ready:
            self._wait_ready(name, me["endpoint"])

    def _wait_ready(self, name: str, endpoint: str) -> None:
        deadline = time.monotonic() + READY_S
        while not (self.dir / f"ready-{name}").exists():
            proc = self.procs[endpoint]
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} did not become ready (exit code {proc.returncode}):\n{tail}")
            time.sleep(0.02)

    def start_prefill(self, rank: int, wait_ready: bool = True) -> None:
        inc = self.incarnation[rank]
        addresses = {"decode": self.proxy_decode, "bootstrap": self.decode_addr,
                     f"prefill{rank}": self.prefill_addr[rank], f"bootstrap{rank}": self.prefill_addr[rank]}
        self._spawn("prefill", f"prefill{rank}-i{inc}", {"rank": rank, "incarnation": inc, "endpoint": f"prefill{rank}",
                                                          "addresses": addresses, "local": self.prefill_addr[rank]},
                    wait_ready)

    def start_decode(self) -> None:
        ranks = self.run.stress.topology.ranks
        addresses = {"decode": self.decode_addr, "bootstrap": self.decode_addr,
                     **{f"prefill{r}": self.proxy_prefill[r] for r in ranks},
                     **{f"bootstrap{r}": self.prefill_addr[r] for r in ranks}}
        self._spawn("decode", f"decode-l{self.decodes}", {"endpoint": "decode", "addresses": addresses,
                                                           "local": self.decode_addr})

    def kill(self, endpoint: str) -> None:
        proc = self.procs[endpoint]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()  # reaped: the process is certainly dead before any successor starts

    def _event(self, what: str, **kw) -> None:
        self.log.write(json.dumps({"at_s": round(time.monotonic() - self.t0, 4), "event": what, **kw}) + "\n")
        self.log.flush()

    # the run -----------------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[float, str, tuple]]:
        cfg, f = self.run.stress, self.faults
        plan = [(at, "kill_prefill", (rank,)) for rank, at in cfg.kill]
        if f.restart_after_s is not None:
            plan += [(at + f.restart_after_s, "start_prefill", (rank,)) for rank, at in cfg.kill]
        plan += [(at, "kill_prefill", (rank,)) for rank, at, _ in cfg.outage]
        plan += [(at + s, "start_prefill", (rank,)) for rank, at, s in cfg.outage]
        plan += [(at, "partition", (rank, s)) for rank, at, s in cfg.partition]
        plan += [(at, "stop_prefill", (rank,)) for rank, at, _ in cfg.lease_loss]
        plan += [(at + s, "cont_prefill", (rank,)) for rank, at, s in cfg.lease_loss]
        plan += [(at, "restart_decode", ()) for at in cfg.restart_decode]
        return sorted(plan, key=lambda p: p[0])

    def apply(self, action: str, args: tuple) -> None:
        if action == "kill_prefill":
            self.kill(f"prefill{args[0]}")
            self._event("sigkill", process=f"prefill{args[0]}-i{self.incarnation[args[0]]}")
        elif action == "start_prefill":
            self.incarnation[args[0]] += 1
            self.start_prefill(args[0], wait_ready=False)
            self._event("start", process=f"prefill{args[0]}-i{self.incarnation[args[0]]}")
        elif action == "partition":
            self.proxy.partition(f"prefill{args[0]}", args[1])
            self._event("partition", endpoint=f"prefill{args[0]}", seconds=args[1])
        elif action in ("stop_prefill", "cont_prefill"):
            stop = action == "stop_prefill"  # a frozen process cannot exit: SIGCONT reaches the one stopped
            proc = self.procs[f"prefill{args[0]}"]
            if proc.poll() is None:
                proc.send_signal(signal.SIGSTOP if stop else signal.SIGCONT)
                self._event("sigstop" if stop else "sigcont",
                            process=f"prefill{args[0]}-i{self.incarnation[args[0]]}")
        elif action == "restart_decode":
            self.kill("decode")
            self._event("sigkill", process=f"decode-l{self.decodes}")
            self.decodes += 1
            self._event("start", process=f"decode-l{self.decodes}")
            self.start_decode()

    def run_storm(self) -> float:
        """Start everything, apply the faults, wait for decode's last life to finish; returns wall seconds."""
        self.proxy.start()
        for rank in self.run.stress.topology.ranks:
            self.start_prefill(rank)
        self.t0 = time.monotonic()
        self._event("start", process="decode-l0")
        self.start_decode()
        serving = time.monotonic() - self.t0  # the storm's zero: decode-l0 is ready and admitting
        self._event("ready", process="decode-l0")
        plan = [(at + serving, action, args) for at, action, args in self.schedule()]
        while not (self.dir / f"done-decode-l{self.decodes}").exists():
            now = time.monotonic() - self.t0
            if now > self.faults.timeout_s:
                self._event("timeout")
                break
            while plan and plan[0][0] <= now:
                _, action, args = plan.pop(0)
                self.apply(action, args)
            self._check_children()
            time.sleep(0.02)
        return time.monotonic() - self.t0

    def _check_children(self) -> None:
        for endpoint, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            if endpoint.startswith("prefill") and proc.returncode in (3, 4):  # fenced, or a batch timed out:
                rank = int(endpoint[len("prefill"):])                          # it comes back as a new one
                self._event("revoked_exit" if proc.returncode == 3 else "timeout_exit",
                            process=f"{endpoint}-i{self.incarnation[rank]}")
                self.incarnation[rank] += 1
                self.start_prefill(rank, wait_ready=False)
            elif proc.returncode != -signal.SIGKILL and not (endpoint == "decode" and proc.returncode == 0):
                raise RuntimeError(f"{endpoint} exited with code {proc.returncode}; see its log in {self.dir}")

    def stop(self) -> None:
        """SIGTERM every live process (each writes its final stats), SIGKILL what is left after 15 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a frozen one (lease_loss) takes its SIGTERM once it runs
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.proxy.close()
        self.log.close()


def run_real_storm(run: RealRun, faults: StormFaults, run_dir: Path) -> dict:
    """Run the storm in ``run_dir`` (created); returns the report (also written to ``report.json``)."""
    from tools.pd_real.storm_report import report

    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run, faults, run_dir)
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_DFL:  # a caller's handler (the CLI's) is kept; it must raise, as this one does
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        wall = sup.run_storm()
    finally:
        sup.stop()  # every process ends (SIGTERM, then SIGKILL), whatever ended the run
        signal.signal(signal.SIGTERM, previous)
    out = report(run, faults, run_dir, wall, sup.proxy.stats)
    (run_dir / "report.json").write_text(json.dumps(out, indent=1))
    return out


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


def failures(report: dict) -> list[str]:
    return [f"{key}={report[key]}" for key in MUST_BE_ZERO if report[key]]

