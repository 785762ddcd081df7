"""Ctrl-C and SIGTERM during ``layersplit prefill --cp 2``: one line on stderr, exit 130 / 143, and
no rank process left behind (checked by pid, so other processes on the machine do not matter)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc for the process tree")


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(entry))
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


def _default_signals() -> None:
    """The child starts with default dispositions, whatever this test inherited (a shell that ignores
    SIGINT, as background jobs and some CI runners do, would otherwise hand the ignore down)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


READY = "rank(s) joined the group, computing"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
@pytest.mark.slow
def test_interrupt_ends_rank_processes(sig, code, word):
    cmd = [sys.executable, "-m", "layersplit", "prefill", "--cp", "2", "--mode", "layersplit",
           "--context-len", "65536", "--json"]
    # a new session: the signal goes to the process group, as a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_signals)
    try:
        seen = []
        for line in proc.stderr:  # the explicit readiness signal: every rank joined and is computing
            seen.append(line.rstrip("\n"))
            if READY in line:
                break
        ranks = _children(proc.pid)
        assert proc.poll() is None and len(ranks) == 2, f"the prefill did not start its 2 rank processes: {seen}"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        assert err.splitlines() == [f"layersplit prefill: {word}"], err  # one line, no traceback from any process
        end = time.monotonic() + 10
        while _alive(ranks) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _alive(ranks), f"left behind: {_alive(ranks)}"
    finally:
        if proc.poll() is None:  # a failed assertion never leaves the prefill (and its ranks) running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
