"""The per-step speculative-decoding monitor inside SGLang's scheduler, against the real sglang package on CPU.

Requests are real ``Req`` objects; every verify step goes through SGLang's own
``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` (which calls the hooked
``Req.update_spec_correct_drafts_histogram``) and ``Req.update_finish_state`` (see ``spec_drive``).
Synthetic requests come from layersplit/pd/spec/synth.py (a tiny seeded draft/target pair with injected faults).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from types import ModuleType, SimpleNamespace

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401 -- the plug-in tests must run in CI
else:
    pytest.importorskip("sglang")

from layersplit import sglang_plugin  # noqa: E402
from layersplit.sglang_plugin import compat, register, unregister  # noqa: E402
from layersplit.sglang_plugin.spec import step as spec_step  # noqa: E402
from layersplit.sglang_plugin.spec.completion import TARGET as COMPLETION_TARGET  # noqa: E402
from layersplit.sglang_plugin.spec.completion import MetaInfoMonitor  # noqa: E402
from layersplit.sglang_plugin.spec.drive import (  # noqa: E402
    VerifyDriver, completion_time_meta, make_req, run_request, spec_published, stream_chunk)
from layersplit.pd.spec.monitor_config import load_monitor_config  # noqa: E402
from layersplit.pd.spec.replay import load_records, replay, summarize  # noqa: E402
from layersplit.pd.spec.evaluate import make_traces  # noqa: E402
from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION, SpecMonitor  # noqa: E402

CFG = load_monitor_config()
DRAFT = 4
STEP_TARGET = "sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram"


@pytest.fixture(scope="module")
def traces():
    return make_traces(4, seed=0)  # 4 healthy (one quoting itself), 4 garbled, 4 looping; 512 tokens each


@pytest.fixture
def hooked(monkeypatch):
    """The monitor alone, registered through the plug-in's entry point as a server would (no pool hooks)."""
    monkeypatch.delenv("LAYERSPLIT_SGLANG_PLUGIN", raising=False)
    monkeypatch.delenv("LAYERSPLIT_SGLANG_SPEC_TRACE", raising=False)
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", "1")
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server"])
    with spec_published(DRAFT):
        assert register()
        compat.resolve("hook_registry").apply_hooks()
        try:
            yield sglang_plugin.spec_monitor()
        finally:
            unregister()


def reference_abort(accepted: list[int]):
    """(step number, Verdict) where layersplit/pd/spec/monitor.py first calls the step sequence anomalous, or (None, None)."""
    monitor = SpecMonitor(CFG)
    for i, n in enumerate(accepted, 1):
        verdict = monitor.observe("r", DRAFT, n)
        if verdict.anomalous:
            return i, verdict
    return None, None


def run(trace_or_steps, rid: str = "r"):
    accepted = list(getattr(trace_or_steps, "accepted", trace_or_steps))
    tokens = getattr(trace_or_steps, "tokens", None)
    req = make_req(rid, max_new_tokens=1 + sum(accepted) + len(accepted))  # + prefill's first token
    steps = run_request(VerifyDriver(DRAFT), req, accepted, tokens)
    return req, steps


def abort_of(req) -> dict | None:
    reason = req.finished_reason.to_json() if req.finished_reason else None
    return reason if reason and "layersplit_spec_verdict" in reason else None


@pytest.mark.parametrize("how", ["env", "flag"])
def test_registers_alone_and_unregisters(monkeypatch, how):
    import argparse

    req_cls = __import__("sglang.srt.managers.schedule_batch", fromlist=["Req"]).Req
    original = req_cls.__dict__["update_spec_correct_drafts_histogram"]
    registry = compat.resolve("hook_registry")
    monkeypatch.delenv("LAYERSPLIT_SGLANG_PLUGIN", raising=False)
    monkeypatch.delenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", raising=False)
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server"])
    assert register() is False and STEP_TARGET not in registry._hooks  # off by default
    unregister()
    if how == "env":
        monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", "1")
    else:
        monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--layersplit-spec-monitor"])
    try:
        assert register() is True
        registry.apply_hooks()
        assert os.environ["LAYERSPLIT_SGLANG_SPEC_MONITOR"] == "1"  # workers inherit the flag's choice
        assert list(registry._hooks) == [STEP_TARGET]  # the monitor alone: no pool or HiCache hooks
        assert req_cls.__dict__["update_spec_correct_drafts_histogram"] is not original
        assert isinstance(sglang_plugin.spec_monitor(), spec_step.SpecStepMonitor)
        parser = argparse.ArgumentParser()
        sys.modules["sglang.srt.server_args"].ServerArgs.add_cli_args(parser)
        assert parser.parse_args(["--model-path", "m", "--layersplit-spec-monitor"]).layersplit_spec_monitor
    finally:
        unregister()
    assert req_cls.__dict__["update_spec_correct_drafts_histogram"] is original
    assert STEP_TARGET not in registry._hooks


def test_completion_time_fallback_without_per_step_method(monkeypatch):
    """The version seam: a release without the per-step method gets the completion-time adapter."""
    monkeypatch.setattr(compat, "SPEC_STEP_METHODS", ("sglang.srt.managers.schedule_batch:Req.no_such_method",))
    monkeypatch.delenv("LAYERSPLIT_SGLANG_PLUGIN", raising=False)
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", "1")
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server"])
    assert compat.spec_step_target() is None
    try:
        assert register()
        assert list(compat.resolve("hook_registry")._hooks) == [COMPLETION_TARGET]
        assert isinstance(sglang_plugin.spec_monitor(), MetaInfoMonitor)
    finally:
        unregister()


def test_garbled_from_the_start_aborts_at_token_129(hooked):
    req, steps = run([0] * 300)
    reason = abort_of(req)
    assert steps == 129 and req.spec_verify_ct == 129  # nothing settled after the abort
    assert reason["status_code"] == 503 and reason["type"] == "abort"
    assert reason["layersplit_spec_verdict"]["verdict"] == GARBLED
    assert reason["layersplit_spec_verdict"]["numbers"]["generated"] == 129
    assert len(req.output_ids) == 1 + 129  # prefill's token + the verify steps' tokens, no more
    assert hooked.counters.aborts == {GARBLED: 1} and hooked.counters.steps == 129


def test_loop_from_the_start_aborts_at_step_32(hooked):
    req, steps = run([DRAFT - 1] * 300)
    assert steps == 32 and abort_of(req)["layersplit_spec_verdict"]["verdict"] == REPETITION
    assert len(req.output_ids) == 1 + 32 * DRAFT


def test_stream_stops_at_the_aborting_step(hooked):
    """The output streamer's chunk for the aborting step carries the abort; the request is then finished,
    so SGLang drops it from the batch and sends nothing more."""
    req = make_req("s", max_new_tokens=1000)
    req.stream = True
    driver, chunks = VerifyDriver(DRAFT), []
    while not req.finished():
        driver.step([req], [0], [[7]])
        chunks.append(stream_chunk(req))
    assert len(chunks) == 129 and all(c["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["finish_reason"]["layersplit_spec_verdict"]["verdict"] == GARBLED
    assert (last["completion_tokens"], last["spec_verify_ct"], last["output_ids"]) == (130, 129, [7])


def drafts(rng: random.Random, p: float, n: int) -> list[int]:
    """``n`` verify steps whose drafts each pass with probability ``p``."""
    return [sum(rng.random() < p for _ in range(DRAFT - 1)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kind,onset", [(GARBLED, 0), (GARBLED, 200), (REPETITION, 0), (REPETITION, 200)],
                         ids=["garbled-from-start", "garbled-at-200", "loop-from-start", "loop-at-200"])
def test_fault_aborted_within_one_window(hooked, kind, onset, seed):
    """A fault that is there from the start is aborted within one window of verify steps after token 128
    (garbled) or after the first 32 steps (loop); one that starts at token 200 within one window of its
    onset. Never at completion: each request would run 1000 tokens."""
    rng, w = random.Random(seed), CFG.window_steps
    healthy = drafts(rng, 0.6, 1000)
    onset_step = next(i for i in range(1000) if sum(healthy[:i]) + i >= onset)
    faulty = drafts(rng, 0.05, 1000) if kind == GARBLED else [DRAFT - 1] * 1000
    accepted = healthy[:onset_step] + faulty
    req, steps = run(accepted[:next(i for i in range(1, 1000) if sum(accepted[:i]) + i >= 1000)])
    reason = abort_of(req)
    assert reason and reason["layersplit_spec_verdict"]["verdict"] == kind
    if onset == 0:
        past_128 = next(i for i in range(1, 1000) if sum(accepted[:i]) + i > CFG.garbled.after_generated_tokens)
        limit = past_128 + w if kind == GARBLED else max(w, CFG.repetition.min_verify_steps)
        assert (past_128 if kind == GARBLED else 1) <= steps <= limit
    else:
        assert onset_step < steps <= onset_step + w
    assert len(req.output_ids) < 1000


@pytest.mark.parametrize("regime", [GARBLED, REPETITION])
def test_synthetic_fault_aborted_before_completion(hooked, traces, regime):
    """Synthetic faulty requests (layersplit/pd/spec/synth.py) are aborted after their fault starts and long before they
    would complete; run again without the hook, the completion-time adapter judges the same request only
    after all of its tokens."""
    seen = 0
    for trace in (t for t in traces if t.label == regime):
        req, steps = run(trace, trace.rid)
        reason = abort_of(req)
        if reason is None:
            continue  # a fault too mild to cross the thresholds (recall < 1, see `layersplit monitor eval`)
        seen += 1
        generated = reason["layersplit_spec_verdict"]["numbers"]["generated"]
        assert reason["layersplit_spec_verdict"]["verdict"] == regime
        assert trace.onset_generated < generated < len(trace.tokens) and steps < len(trace.accepted)
        assert generated > CFG.garbled.after_generated_tokens or regime == REPETITION
    assert seen >= 2
    unregister()  # the same request with the completion-time adapter only
    trace = next(t for t in traces if t.label == regime)
    req, steps = run(trace, trace.rid)
    assert steps == len(trace.accepted) and req.finished_reason.to_json()["type"] == "length"
    meta = completion_time_meta(req, MetaInfoMonitor(CFG))
    assert meta["layersplit_spec_verdict"]["numbers"]["generated"] == len(trace.tokens) + 1


def test_healthy_requests_never_aborted(hooked, traces):
    healthy = [t for t in traces if t.label == HEALTHY]
    assert any(t.variant == "quote" for t in healthy)  # includes a request that repeats its own text once
    for trace in healthy:
        req, steps = run(trace, trace.rid)
        assert steps == len(trace.accepted) and req.finished_reason.to_json()["type"] == "length", trace.rid
    assert hooked.counters.aborts == {} and hooked.counters.requests == len(healthy)


def test_decision_per_step_equals_pd_monitor(hooked, traces):
    """Same counters, same decision: the hook aborts at the step where layersplit/pd/spec/monitor.py first flags the
    request, with the same verdict, and its state tracks SGLang's own counters step by step."""
    rng = random.Random(0)
    sequences = [list(t.accepted) for t in traces]
    for _ in range(20):
        p = rng.choice([0.1, 0.12, 0.14, 0.5, 0.95, 0.99])
        sequences.append([sum(rng.random() < p for _ in range(DRAFT - 1)) for _ in range(250)])
    flagged = 0
    for k, accepted in enumerate(sequences):
        step, verdict = reference_abort(accepted)
        req, driver = make_req(f"q{k}", max_new_tokens=10_000), VerifyDriver(DRAFT)
        for n in accepted:
            if req.finished():
                break
            driver.step([req], [n])
            state = getattr(req, spec_step.STATE_ATTR)
            if state.__class__ is spec_step.StepState:
                assert (state.verify_steps, state.accepted) == (req.spec_verify_ct, req.spec_num_correct_drafts)
        reason = abort_of(req)
        assert (reason is None) == (verdict is None), k
        if verdict is not None:
            flagged += 1
            assert req.spec_verify_ct == step and reason["layersplit_spec_verdict"] == verdict.to_dict(), k
    assert flagged >= 10


def test_one_batch_aborts_only_its_anomalous_requests(hooked):
    reqs = [make_req(rid, max_new_tokens=1000) for rid in ("garbled", "healthy", "loop")]
    rates = {"garbled": [0], "healthy": [1, 2, 3, 0, 2], "loop": [DRAFT - 1]}
    driver = VerifyDriver(DRAFT)
    for step in range(200):
        live = [r for r in reqs if not r.finished()]
        driver.step(live, [rates[r.rid][step % len(rates[r.rid])] for r in live])
    kinds = {r.rid: (abort_of(r) or {}).get("layersplit_spec_verdict", {}).get("verdict") for r in reqs}
    assert kinds == {"garbled": GARBLED, "healthy": None, "loop": REPETITION}
    assert [r.spec_verify_ct for r in reqs] == [129, 200, 32]


def test_an_abort_sglang_already_decided_stands(hooked):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req, driver = make_req("x", max_new_tokens=1000), VerifyDriver(DRAFT)
    for _ in range(128):
        driver.step([req], [0])
    req.to_finish = FINISH_ABORT("grammar failed", 500)  # set earlier in the same step by SGLang
    driver.step([req], [0])  # the step that fires
    assert req.finished_reason.to_json()["message"] == "grammar failed"
    assert hooked.counters.aborts == {GARBLED: 1}  # still judged and counted


def test_out_of_range_count_stops_judging_without_raising(hooked, caplog):
    req = make_req("y", max_new_tokens=1000)
    with caplog.at_level(logging.WARNING, logger=spec_step.__name__):
        req.update_spec_correct_drafts_histogram(DRAFT)  # 4 accepted drafts cannot come from 3 proposed
        req.update_spec_correct_drafts_histogram(DRAFT)
    assert req.spec_correct_drafts_histogram[DRAFT] == 2  # SGLang's own method still ran
    assert hooked.counters.untracked == 1 and req.to_finish is None
    assert sum("not judged" in r.message for r in caplog.records) == 1


def test_one_log_line_per_abort_and_leader_only(hooked, caplog):
    with caplog.at_level(logging.WARNING, logger=spec_step.__name__):
        run([0] * 200, "a")
        run([DRAFT - 1] * 200, "b")
    lines = [r.message for r in caplog.records if r.name == spec_step.__name__]
    assert len(lines) == 2 and "rid=a at verify step 129 (129 tokens): garbled" in lines[0]
    follower = spec_step.SpecStepMonitor(CFG, draft_tokens=DRAFT, leader=False)  # another TP rank
    req = make_req("c", max_new_tokens=1000)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=spec_step.__name__):
        for _ in range(129):
            follower.after_step(None, req, 0)
    assert req.to_finish is not None and not caplog.records and follower.counters.aborts == {}


def test_prometheus_counters_by_verdict(monkeypatch):
    """With prometheus_client importable (as in an SGLang server), aborts are counted there by verdict."""
    made = {}

    class FakeCounter:
        def __init__(self, name, doc, labelnames=()):
            self.name, self.values, made[name] = name, {}, self

        def labels(self, verdict):
            return SimpleNamespace(inc=lambda: self.values.update({verdict: self.values.get(verdict, 0) + 1}))

        def inc(self):
            self.values[None] = self.values.get(None, 0) + 1

    fake = ModuleType("prometheus_client")
    fake.Counter = FakeCounter
    monkeypatch.setitem(sys.modules, "prometheus_client", fake)
    monkeypatch.setattr(spec_step, "_PROM", {})
    monitor = spec_step.SpecStepMonitor(CFG, draft_tokens=DRAFT, leader=True)
    with spec_published(DRAFT):
        for rid, steps in (("g", [0] * 130), ("l", [DRAFT - 1] * 40), ("h", [2] * 40)):
            req = make_req(rid, max_new_tokens=1000)
            for n in steps:
                if req.to_finish is None:
                    monitor.after_step(None, req, n)
    assert made["layersplit_spec_step_aborts"].values == {GARBLED: 1, REPETITION: 1}
    assert made["layersplit_spec_step_requests"].values == {None: 3}
    assert 'layersplit_spec_step_aborts_total{verdict="garbled"} 1' in monitor.counters.to_prometheus()


def test_exported_steps_replay_to_the_live_decisions(monkeypatch, tmp_path, traces):
    """The hook's per-step JSONL export, read by the replay tool: with the same thresholds the replay flags
    the same requests at the same token; with other thresholds an operator sees what would change."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_TRACE", str(path))
    monkeypatch.delenv("LAYERSPLIT_SGLANG_PLUGIN", raising=False)
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", "1")
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server"])
    live = {}
    with spec_published(DRAFT):
        try:
            assert register()
            compat.resolve("hook_registry").apply_hooks()
            for trace in traces:
                req, _ = run(trace, trace.rid)
                reason = abort_of(req)
                live[trace.rid] = reason and reason["layersplit_spec_verdict"]
            sglang_plugin.spec_monitor().close()
        finally:
            unregister()
    results = {r.record.rid: r for r in replay(load_records(path), CFG)}
    assert set(results) == set(live)
    for rid, verdict in live.items():
        r = results[rid]
        assert r.record.live_verdict == (verdict and verdict["verdict"])
        assert r.verdict.kind == (verdict["verdict"] if verdict else HEALTHY)
        assert r.detected_at == (verdict and verdict["numbers"]["generated"])
    summary = summarize(list(results.values()))
    assert summary["live_aborted"] == summary["agree_with_live"] == sum(v is not None for v in live.values()) >= 4


def test_abort_reaches_the_client_as_retryable_503():
    """SGLang's tokenizer manager turns the finish reason into HTTP 503 (non-streaming) or a final
    streamed chunk carrying it, its own handling of retry-later aborts."""
    fastapi = pytest.importorskip("fastapi")
    from layersplit.sglang_plugin.spec.abort import SpecMonitorAbort

    manager = sys.modules["sglang.srt.managers.tokenizer_manager"].TokenizerManager
    verdict = reference_abort([0] * 129)[1]
    out = {"meta_info": {"finish_reason": SpecMonitorAbort(verdict).to_json()}}
    state = SimpleNamespace(obj=SimpleNamespace(rid="r"))
    stub = SimpleNamespace(rid_to_state={"r": state}, _release_lora_once=lambda s: None)
    assert asyncio.run(manager._handle_abort_finish_reason(stub, out, state, True)) is out
    with pytest.raises(fastapi.HTTPException) as err:
        asyncio.run(manager._handle_abort_finish_reason(stub, out, state, False))
    assert err.value.status_code == 503 and "garbled" in err.value.detail


def test_unusable_draft_token_count_turns_the_monitor_off(caplog):
    """A server whose speculative config has no usable draft-token count keeps serving; the monitor says
    so once and judges nothing."""
    monitor = spec_step.SpecStepMonitor(CFG, leader=True)
    req = make_req("z", max_new_tokens=1000)
    with spec_published(None), caplog.at_level(logging.ERROR, logger=spec_step.__name__):
        for _ in range(200):
            monitor.after_step(None, req, 0)
    assert monitor.off and req.to_finish is None and monitor.counters.steps == 0
    assert sum("speculative_num_draft_tokens" in r.message for r in caplog.records) == 1
