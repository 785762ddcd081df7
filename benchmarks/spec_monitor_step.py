"""Per-step speculative-decoding monitor in SGLang's scheduler: what it costs per request-step, and how much
earlier it stops a faulty request than the completion-time adapter.

1. Detection (SYNTHETIC requests from layersplit/pd/spec/synth.py, a tiny seeded draft/target pair with injected faults):
   for one garbled and one looping request, the verify step and token count at which the per-step hook
   aborted it (real ``Req``, SGLang's own ``_resolve_spec_v2_tokens`` and ``update_finish_state``), vs the
   completion-time adapter, which judges the same request once it has generated all of its tokens.
2. Overhead (measured here, CPU, Python): ``--requests`` real ``Req`` objects (default 10,000) x ``--steps``
   verify steps each call ``Req.update_spec_correct_drafts_histogram`` as the scheduler does once per request
   per step; the time per call with the hook registered through the plug-in minus the time without it is the
   hook's cost per request-step (process CPU time, median of ``--repeats`` after one warm-up). Healthy
   traffic (no abort), then the same with the per-step JSONL export on, then a mix with 5% garbled and 5%
   looping requests (their calls stop at the abort; per-call times include the loop's skipped iterations, so
   the mix overstates the cost).
   For scale, the same healthy workload through SGLang's own step settlement (``VerifyDriver``: real
   ``_resolve_spec_v2_tokens`` + ``update_finish_state`` in batches of 256), without and with the hook.
   The per-abort warning is silenced while timing.

    python benchmarks/spec_monitor_step.py [--requests 10000] [--steps 64] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layersplit.sglang_plugin import compat, register, spec_monitor, unregister  # noqa: E402
from layersplit.sglang_plugin.spec import step as spec_step  # noqa: E402
from layersplit.sglang_plugin.spec.completion import MetaInfoMonitor  # noqa: E402
from layersplit.sglang_plugin.spec.drive import (  # noqa: E402
    VerifyDriver, completion_time_meta, make_req, run_request, spec_published)
from layersplit.pd.spec.monitor_config import load_monitor_config  # noqa: E402
from layersplit.pd.spec.evaluate import make_traces  # noqa: E402

DRAFT = 4


class Hooked:
    """The monitor registered through the plug-in's entry point (``LAYERSPLIT_SGLANG_SPEC_MONITOR=1``)."""

    def __init__(self, trace_path: str | None = None) -> None:
        self.env = {"LAYERSPLIT_SGLANG_SPEC_MONITOR": "1", "LAYERSPLIT_SGLANG_SPEC_TRACE": trace_path or ""}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        assert register(), "the spec monitor did not register"
        compat.resolve("hook_registry").apply_hooks()
        return spec_monitor()

    def __exit__(self, *exc) -> None:
        spec_monitor().close()
        unregister()
        for k, v in self.saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def detection(cfg, seed: int) -> list[dict]:
    """One garbled and one looping SYNTHETIC request: hook abort point vs completion-time verdict."""
    rows = []
    traces = make_traces(4, seed)
    for regime in ("garbled", "repetition"):
        for trace in (t for t in traces if t.label == regime):
            with Hooked():
                req = make_req(trace.rid, 1 + len(trace.tokens))
                steps = run_request(VerifyDriver(DRAFT), req, list(trace.accepted), list(trace.tokens))
                reason = req.finished_reason.to_json()
            if "layersplit_spec_verdict" not in reason:
                continue  # too mild to be flagged; take the next one
            full = make_req(trace.rid, 1 + len(trace.tokens))  # without the hook: runs to completion
            full_steps = run_request(VerifyDriver(DRAFT), full, list(trace.accepted), list(trace.tokens))
            meta = completion_time_meta(full, MetaInfoMonitor(cfg))
            live = reason["layersplit_spec_verdict"]
            rows.append({"rid": trace.rid, "label": regime, "onset_token": trace.onset_generated,
                         "hook_step": steps, "hook_tokens": live["numbers"]["generated"],
                         "hook_verdict": live["verdict"],
                         "hook_reason": live["reason"], "completion_step": full_steps,
                         "completion_tokens": meta["completion_tokens"],
                         "completion_verdict": meta["layersplit_spec_verdict"]["verdict"],
                         "completion_finish": meta.get("finish_reason", full.finished_reason.to_json())["type"]})
            break
    return rows


def workload(requests: int, steps: int, mix: bool, seed: int) -> list[list[int]]:
    """Accepted drafts per step (rows) per request (columns): healthy p=0.6, or 5% garbled / 5% looping."""
    rng = random.Random(seed)
    kinds = [("garbled" if u < 0.05 else "loop" if u < 0.10 else "healthy") if mix else "healthy"
             for u in (rng.random() for _ in range(requests))]
    p = {"healthy": 0.6, "garbled": 0.03, "loop": 1.0}
    return [[sum(rng.random() < p[k] for _ in range(DRAFT - 1)) for k in kinds] for _ in range(steps)]


def one_pass(rows: list[list[int]]) -> tuple[float, int, int]:
    """Seconds, method calls and aborted requests for every request through every step (an aborted
    request is not called again, as SGLang drops finished requests from the batch)."""
    reqs = [make_req(f"r{i}", 1_000_000) for i in range(len(rows[0]))]
    start = time.process_time()  # CPU time of this process: less sensitive to other load on a shared host
    for row in rows:
        for req, accepted in zip(reqs, row):
            if req.to_finish is None:
                req.update_spec_correct_drafts_histogram(accepted)
    elapsed = time.process_time() - start
    calls = sum(sum(r.spec_correct_drafts_histogram) for r in reqs)  # SGLang's method counts its own calls
    return elapsed, calls, sum(r.to_finish is not None for r in reqs)


def driver_pass(rows: list[list[int]], batch: int = 256) -> tuple[float, int, int]:
    """The same workload through SGLang's own step settlement (``spec_drive.VerifyDriver``: the real
    ``_resolve_spec_v2_tokens`` + ``update_finish_state``, in batches of ``batch`` requests): what one
    request-step costs the scheduler's result processing before streaming and metrics."""
    reqs = [make_req(f"r{i}", 1_000_000) for i in range(len(rows[0]))]
    driver = VerifyDriver(DRAFT)
    start = time.process_time()  # CPU time of this process: less sensitive to other load on a shared host
    for row in rows:
        for lo in range(0, len(reqs), batch):
            driver.step(reqs[lo:lo + batch], row[lo:lo + batch])
    elapsed = time.process_time() - start
    return elapsed, sum(r.spec_verify_ct for r in reqs), sum(r.to_finish is not None or r.finished() for r in reqs)


def timed(rows, repeats: int, hooked: bool, trace_path: str | None = None, run=one_pass) -> dict:
    samples = []
    for i in range(repeats + 1):  # first pass: warm-up
        if hooked:
            with Hooked(trace_path):
                elapsed, calls, aborted = run(rows)
        else:
            elapsed, calls, aborted = run(rows)
        if i:
            samples.append(elapsed)
    return {"seconds_median": statistics.median(samples), "request_steps": calls, "aborted_requests": aborted}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.steps < 1 or args.repeats < 1:
        ap.error(f"--requests/--steps/--repeats: expected ints >= 1, got {args.requests}/{args.steps}/{args.repeats}")
    cfg = load_monitor_config()
    logging.getLogger(spec_step.__name__).setLevel(logging.ERROR)  # one warning per abort: not timed here
    report = {"draft_tokens": DRAFT, "requests": args.requests, "steps": args.steps, "repeats": args.repeats}
    with spec_published(DRAFT):
        report["detection_synthetic"] = detection(cfg, args.seed)
        healthy = workload(args.requests, args.steps, mix=False, seed=args.seed)
        mixed = workload(args.requests, max(args.steps, 160), mix=True, seed=args.seed)
        with tempfile.TemporaryDirectory() as tmp:
            runs = {"upstream (no hook)": timed(healthy, args.repeats, False),
                    "hook": timed(healthy, args.repeats, True),
                    "hook + JSONL export": timed(healthy, args.repeats, True, str(Path(tmp) / "steps.jsonl")),
                    "upstream, mix": timed(mixed, args.repeats, False),
                    "hook, mix": timed(mixed, args.repeats, True),
                    "SGLang settle (no hook)": timed(healthy, args.repeats, False, run=driver_pass),
                    "SGLang settle + hook": timed(healthy, args.repeats, True, run=driver_pass)}
    for run in runs.values():
        run["us_per_call"] = 1e6 * run["seconds_median"] / run["request_steps"]
    base = {"mix": runs["upstream, mix"]["us_per_call"], "settle": runs["SGLang settle (no hook)"]["us_per_call"],
            "": runs["upstream (no hook)"]["us_per_call"]}
    for name, run in runs.items():
        run["overhead_us_per_request_step"] = run["us_per_call"] - base[
            "mix" if "mix" in name else "settle" if "settle" in name else ""]
    report["overhead_measured"] = runs
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def format_report(report: dict) -> str:
    lines = ["Detection, SYNTHETIC requests (layersplit/pd/spec/synth.py; not production data): per-step hook vs "
             "completion-time adapter",
             f"{'request':<14}{'onset tok':>10}{'hook step':>10}{'hook tok':>9}  {'verdict':<11}"
             f"{'compl. step':>12}{'compl. tok':>11}  {'verdict':<11}"]
    for r in report["detection_synthetic"]:
        lines.append(f"{r['rid']:<14}{r['onset_token']:>10}{r['hook_step']:>10}{r['hook_tokens']:>9}  "
                     f"{r['hook_verdict']:<11}{r['completion_step']:>12}{r['completion_tokens']:>11}  "
                     f"{r['completion_verdict']:<11}")
    lines += [f"  hook reason ({r['rid']}): {r['hook_reason']}" for r in report["detection_synthetic"]]
    lines += ["(hook tok: tokens from verify steps at the abort; compl. tok: SGLang completion_tokens, prefill's "
              "first token included)", "",
              f"Overhead, measured (process CPU time) on this machine: {report['requests']} real Req x "
              f"{report['steps']} verify steps "
              f"(mix: >= 160 steps), draft_tokens {report['draft_tokens']}, median of {report['repeats']}",
              f"{'run':<24}{'request-steps':>14}{'aborted':>9}{'us/call':>10}{'overhead us/request-step':>26}"]
    for name, r in report["overhead_measured"].items():
        lines.append(f"{name:<24}{r['request_steps']:>14}{r['aborted_requests']:>9}{r['us_per_call']:>10.3f}"
                     f"{r['overhead_us_per_request_step']:>26.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
