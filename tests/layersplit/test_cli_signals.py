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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_interrupt_ends_rank_processes(sig, code, word):
    cmd = [sys.executable, "-m", "layersplit", "prefill", "--cp", "2", "--mode", "layersplit",
           "--context-len", "65536", "--json"]
    # a new session: the signal goes to the process group, as a terminal's Ctrl-C does
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # both rank processes up (plus the tracker)
        ranks = _children(proc.pid)
        if len(ranks) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None and len(ranks) >= 3, "the prefill did not start its rank processes"
    time.sleep(2.0)  # the ranks are importing torch / computing
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if not line.startswith("layersplit prefill: prefill on")]
    assert lines == [f"layersplit prefill: {word}"], err  # one line, no traceback from any process
    end = time.monotonic() + 10
    while _alive(ranks) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _alive(ranks), f"left behind: {_alive(ranks)}"
