"""Child processes of the GPU check, each started in a process group of its own and ended as a group.

The sanitized child (:mod:`.sanitize`) starts two rank processes of its own; when the watchdog ends
the check (``os._exit``), the child and its ranks must not keep running on the GPU. So every child is
started here: in a new session (its own process group, which its rank processes join), with
``PR_SET_PDEATHSIG`` so the kernel kills it if the check dies however it dies, and registered so the
watchdog can ``killpg`` each group before it exits (:func:`end_all`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_GROUPS: dict[int, subprocess.Popen] = {}  # process-group id -> its leader


def _die_with_parent(parent: int) -> None:
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the check died before the death signal was armed
            os._exit(1)


def run(cmd: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a registered process group of its own; the group is ended on a timeout."""
    parent = os.getpid()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: _die_with_parent(parent))
    _GROUPS[proc.pid] = proc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout_s, out, err) from None
    finally:
        _GROUPS.pop(proc.pid, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _end(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def end_all() -> int:
    """SIGKILL every registered child's process group (its rank processes with it); how many."""
    groups = list(_GROUPS)
    for pgid in groups:
        _end(pgid)
    return len(groups)
