"""The GPU check's report: its verdict, exit status, JSON (rewritten as each section finishes) and
Markdown. Used by :mod:`layersplit.gpu_check.run`.

Verdict, from the sections and the skip list:

* ``failed``     — a section failed (or raised, or was running when the watchdog fired);
* ``incomplete`` — nothing failed, but something this mode exists to check did not run (a section
  or part skipped for the time budget, a vendor module missing), or no section but ``environment`` (the
  device facts) ran at all: a check that checked nothing has not passed;
* ``passed``     — everything this mode checks ran and passed. A part that cannot run in this mode
  (the GPU-only vendor section in a CPU dry run) is listed as skipped but does not count.

Exit status: 0 passed, 1 failed, 3 incomplete (2 stays the command line's bad-input status).
"""

from __future__ import annotations

import json
from pathlib import Path

JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
CPU_TIMING_NOTE = "CPU wall time, not representative: the H200 peaks beside it are not comparable"
EXIT = {"passed": 0, "failed": 1, "incomplete": 3}


def verdict(report: dict) -> str:
    sections = report["sections"]
    if any(s["status"] == "failed" for s in sections.values()):
        return "failed"
    checked = any(s["status"] == "ok" for name, s in sections.items() if name != "environment")
    return "incomplete" if not checked or any(s.get("counts", True) for s in report["skipped"]) else "passed"


def exit_code(report: dict) -> int:
    """0 passed, 1 failed, 3 incomplete (see :func:`verdict`)."""
    return EXIT[verdict(report)]


def _json_safe(x):
    return str(x) if not isinstance(x, (int, float, str, bool, type(None))) else x


def write_json(out: Path, report: dict) -> None:
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(report | {"verdict": verdict(report)}, indent=1, default=_json_safe))
    tmp.replace(out / JSON_NAME)  # atomic: a watchdog exit never leaves half a file


def _kernel_table(rows: list[dict], on_cuda: bool) -> list[str]:
    head = "| op | backend (kernel) | check | median | achieved | H200 peak |"
    lines = ["", "## Kernels" + ("" if on_cuda else f" ({CPU_TIMING_NOTE})"), "", head, "|---|---|---|---|---|---|"]
    for r in rows:
        backend = r["backend"] + (f" ({r['kernel']})" if r.get("kernel", r["backend"]) != r["backend"] else "")
        if "median_ms" not in r:
            lines.append(f"| {r['label']} | {backend} | FAILED: {r['check'][:80]} | | | |")
            continue
        mark = "ok" if r["passed"] else "FAILED"
        achieved, peak = f"{r['achieved']:.3g} {r['rate_unit']}", f"{r['peak']:.0f} {r['rate_unit']} ({r['peak_key']})"
        if "read_GBps" in r:  # a FLOP case that also counts its bytes read: against HBM
            # loaded, not HBM traffic: a kernel that gathers a row more than once may hit L2 (can exceed the peak)
            achieved += f", {r['read_GBps']:.3g} GB/s loaded (L2 + HBM), counted as {r['bytes_formula']}"
            peak += f", {r['hbm_peak_GBps']:.0f} GB/s (hbm)"
        lines.append(f"| {r['label']} | {backend} | {mark}: {r['check']} | {r['median_ms']:.3f} ms | {achieved} "
                     f"| {peak} |")
    return lines


def render_markdown(report: dict) -> str:
    env = report["sections"].get("environment", {}).get("result", {})
    lines = [f"# GPU check: {report['mode']} — {verdict(report).upper()}", "",
             f"{env.get('device_name', report['device'])} · torch {env.get('torch', '?')} · triton "
             f"{env.get('triton', '?')} · budget {report['budget_s']:.0f} s · elapsed {report['elapsed_s']:.1f} s"
             + (f" · ABORTED: {report['aborted']}" if report.get("aborted") else ""),
             "", "| section | status | seconds | summary |", "|---|---|---|---|"]
    for name, s in report["sections"].items():
        text = s.get("reason") or s.get("error") or s.get("result", {}).get("summary", "")
        lines.append(f"| {name} | {s['status']} | {s.get('seconds', 0):.1f} | {text} |")
    rows = report["sections"].get("kernels", {}).get("result", {}).get("rows", [])
    if rows:
        lines += _kernel_table(rows, report["mode"] == "cuda")
    if report["skipped"]:
        lines += ["", "## Skipped", ""] + [
            f"- {s['what']}: {s['reason']}" + ("" if s.get("counts", True) else " (not checked in this mode)")
            for s in report["skipped"]]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, report: dict) -> None:
    write_json(out, report)
    (out / MD_NAME).write_text(render_markdown(report))
