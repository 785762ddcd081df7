"""Ctrl-C and SIGTERM during ``python -m tools.pd_real storm``: exit 130 / 143 with one line
on stderr, every process of the pair ended (checked by the pids they wrote), their last stats on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.paths import ROOT

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("sig,code,word", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
@pytest.mark.slow
def test_interrupt_ends_every_process_of_the_pair(tmp_path, sig, code, word):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tools.pd_real", "storm", "--requests", "100000", "--out", str(run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=ROOT, preexec_fn=_default_signals)
    try:
        deadline = time.monotonic() + 60
        while not (run / "ready-decode-l0").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # requests in flight
        pids = {int(p.read_text()) for p in run.glob("ready-*")}
        assert len(pids) == 3 and all(_alive(pid) for pid in pids), (pids, proc.poll())
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole group
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        assert err.splitlines() == [f"python -m tools.pd_real storm: {word}"], err
        assert not {pid for pid in pids if _alive(pid)}
        assert (run / "decode-l0.stats.json").exists() and len(list(run.glob("prefill*.stats.json"))) == 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
