"""The per-step rules (StepJudge, StepState) against the reference monitor, and replay of per-step exports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random

import pytest

from layersplit.cli import monitor_cmd
from layersplit.cli.app import _int_at_least
from layersplit.pd.spec.monitor_config import load_monitor_config
from layersplit.pd.spec.replay import load_records, replay, summarize
from layersplit.pd.spec.evaluate import make_traces, sweep
from layersplit.pd.spec.metrics import RequestSpecState, StepState
from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION, SpecMonitor, StepJudge

BASE = load_monitor_config()
CONFIGS = [("configs/monitor.yaml", BASE)] + sweep(BASE)


def random_steps(rng: random.Random, draft_tokens: int, n: int) -> list[int]:
    """Accepted drafts per step, in phases of different acceptance (healthy, collapsed, saturated)."""
    out = []
    while len(out) < n:
        p = rng.choice([0.0, 0.05, 0.13, 0.3, 0.6, 0.9, 0.97, 1.0])
        out += [sum(rng.random() < p for _ in range(draft_tokens - 1)) for _ in range(rng.randint(5, 80))]
    return out[:n]


def first_anomaly(cfg, draft_tokens: int, steps: list[int]):
    """(step index, Verdict) of the reference monitor's first anomaly, or (None, None)."""
    monitor = SpecMonitor(cfg)
    for i, accepted in enumerate(steps):
        verdict = monitor.observe("r", draft_tokens, accepted)
        if verdict.anomalous:
            return i, verdict
    return None, None


def step_anomaly(cfg, draft_tokens: int, steps: list[int]):
    rules = StepJudge(cfg, draft_tokens)
    state = rules.new_state()
    for i, accepted in enumerate(steps):
        verdict = rules.step(state, accepted)
        if verdict is not None:
            return i, verdict
    return None, None


@pytest.mark.parametrize("name,cfg", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_step_judge_decides_like_the_monitor_every_step(name, cfg):
    rng = random.Random(name)
    fired = 0
    for draft_tokens in (2, 4, 7):
        for _ in range(12):
            steps = random_steps(rng, draft_tokens, 400)
            expected, got = first_anomaly(cfg, draft_tokens, steps), step_anomaly(cfg, draft_tokens, steps)
            assert got[0] == expected[0]
            assert (got[1] and got[1].to_dict()) == (expected[1] and expected[1].to_dict())
            fired += expected[0] is not None
    assert fired > 0  # the comparison saw anomalies, not only healthy runs


def test_step_judge_on_synthetic_traces():
    traces = make_traces(6, seed=3)
    for trace in traces:
        expected = first_anomaly(BASE, trace.draft_tokens, list(trace.accepted))
        got = step_anomaly(BASE, trace.draft_tokens, list(trace.accepted))
        assert got[0] == expected[0] and (got[1] and got[1].kind) == (expected[1] and expected[1].kind), trace.rid
    flagged = [step_anomaly(BASE, t.draft_tokens, list(t.accepted))[1] for t in traces if t.label != HEALTHY]
    assert {v.kind for v in flagged if v is not None} == {GARBLED, REPETITION}


W5 = dataclasses.replace(BASE, window_steps=5)  # a window that holds whole periods of the patterns below


@pytest.mark.parametrize("draft_tokens,steps,cfg,kind", [
    (4, [0] * 128, BASE, HEALTHY),                          # 128 tokens: "after 128" is strict
    (4, [0] * 129, BASE, GARBLED),                          # the 129th token fires at once
    (4, [3] * 31, BASE, HEALTHY),                           # 31 steps < min_verify_steps
    (4, [3] * 32, BASE, REPETITION),
    (4, [2, 0, 0, 0, 0] * 40, W5, HEALTHY),                 # accept length exactly 1.4, cumulative and window
    (4, [2, 0, 0, 0, 0] * 39 + [1, 0, 0, 0, 0], W5, GARBLED),
    (26, [24] * 40, BASE, HEALTHY),                         # accept rate exactly 24/25 = 0.96
    (26, [24] * 39 + [25], BASE, REPETITION),
], ids=["128-tokens", "129-tokens", "31-steps", "32-steps", "length-exactly-1.4", "length-below-1.4",
        "rate-exactly-0.96", "rate-above-0.96"])
def test_boundaries_match_the_monitor(draft_tokens, steps, cfg, kind):
    expected = first_anomaly(cfg, draft_tokens, steps)
    got = step_anomaly(cfg, draft_tokens, steps)
    assert got[0] == expected[0]
    assert (got[1].kind if got[1] else HEALTHY) == (expected[1].kind if expected[1] else HEALTHY) == kind


def test_step_state_snapshot_equals_request_state():
    rng = random.Random(7)
    for window in (1, 5, 32):
        state, reference = StepState(window), RequestSpecState(window)
        for accepted in random_steps(rng, 5, 150):
            state.record(accepted)
            reference.record(5, accepted)
            assert state.snapshot(5) == reference.snapshot()
            assert state.generated == reference.generated


@pytest.mark.parametrize("draft_tokens", [1, 0, True, 2.0])
def test_step_judge_rejects_bad_draft_tokens(draft_tokens):
    with pytest.raises(ValueError, match=r"draft_tokens: expected an int >= 2"):
        StepJudge(BASE, draft_tokens)


def write_steps(path, runs: dict[str, list[int]], draft_tokens: int = 4, verdicts: dict[str, str] | None = None):
    """Interleave the runs' step lines round-robin, as the hook writes a batch's steps."""
    lines, cursors = [], {rid: 0 for rid in runs}
    while any(cursors[rid] < len(steps) for rid, steps in runs.items()):
        for rid, steps in runs.items():
            i = cursors[rid]
            if i < len(steps):
                line = {"rid": rid.split("#")[0], "step": i + 1, "draft_tokens": draft_tokens, "accepted": steps[i]}
                if verdicts and i == len(steps) - 1 and rid in verdicts:
                    line["verdict"] = verdicts[rid]
                lines.append(json.dumps(line))
                cursors[rid] += 1
    path.write_text("\n".join(lines) + "\n")


def test_replay_gathers_interleaved_step_lines(tmp_path):
    path = tmp_path / "steps.jsonl"
    runs = {"g": [0] * 129, "h": [2, 3, 1] * 60, "l": [3] * 32}
    write_steps(path, runs, verdicts={"g": GARBLED, "l": REPETITION})
    records = load_records(path)
    assert [(r.rid, r.source, len(r.steps), r.live_verdict) for r in records] == \
        [("g", "trace", 129, GARBLED), ("h", "trace", 180, None), ("l", "trace", 32, REPETITION)]
    results = {r.record.rid: r for r in replay(records, BASE)}
    assert results["g"].verdict.kind == GARBLED and results["g"].detected_at == 129
    assert results["l"].verdict.kind == REPETITION and results["h"].verdict.kind == HEALTHY
    summary = summarize(list(results.values()))
    assert (summary["live_aborted"], summary["agree_with_live"]) == (2, 2)
    # other thresholds: a garbled rule that waits for 256 tokens does not fire on the 129-token trace
    later = dataclasses.replace(BASE, garbled=dataclasses.replace(BASE.garbled, after_generated_tokens=256))
    assert {r.record.rid: r.verdict.kind for r in replay(records, later)}["g"] == HEALTHY


def test_replay_restarted_rid_is_a_new_run(tmp_path):
    path = tmp_path / "steps.jsonl"
    lines = [{"rid": "a", "step": s, "draft_tokens": 4, "accepted": 1} for s in (1, 2, 3)]
    lines += [{"rid": "a", "step": s, "draft_tokens": 4, "accepted": 0} for s in (1, 2)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [(r.rid, len(r.steps)) for r in load_records(path)] == [("a", 3), ("a#2", 2)]


@pytest.mark.parametrize("line,pattern", [
    ('{"rid": "a", "step": 2, "draft_tokens": 4, "accepted": 1}', r"s.jsonl:2: field 'step': expected 1 .*'a'.*got 2"),
    ('{"rid": "b", "step": 1, "draft_tokens": 4, "accepted": 1}\n{"rid": "b", "step": 3, "draft_tokens": 4, '
     '"accepted": 1}', r"s.jsonl:3: field 'step': expected 2 .*got 3"),
    ('{"step": 1, "draft_tokens": 4, "accepted": 1}', r"s.jsonl:2: field 'rid': expected the request id"),
    ('{"rid": "a", "step": 1, "draft_tokens": 4, "accepted": [1]}', r"s.jsonl:2: field 'accepted': expected an int"),
    ('{"rid": "a", "step": 1, "draft_tokens": 4, "accepted": 1, "verdict": "odd"}',
     r"s.jsonl:2: field 'verdict': expected one of"),
], ids=["starts-at-2", "gap", "no-rid", "accepted-list", "verdict"])
def test_step_line_errors_name_file_and_line(tmp_path, line, pattern):
    path = tmp_path / "s.jsonl"
    path.write_text("# exported by the hook\n" + line + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_records(path)


def test_cli_replays_a_step_export_with_other_thresholds(tmp_path, capsys):
    path, cfg = tmp_path / "steps.jsonl", tmp_path / "later.yaml"
    write_steps(path, {"g": [0] * 129, "l": [3] * 32}, verdicts={"g": GARBLED, "l": REPETITION})
    text = (BASE_PATH := __import__("layersplit.pd.spec.monitor_config", fromlist=["x"]).default_config_path()).read_text()
    cfg.write_text(text.replace("after_generated_tokens: 128", "after_generated_tokens: 256"))
    assert BASE_PATH.is_file()
    parser = argparse.ArgumentParser()
    monitor_cmd.add_parser(parser.add_subparsers(dest="command", required=True), _int_at_least)
    for config, garbled in ((None, GARBLED), (str(cfg), HEALTHY)):
        argv = ["monitor", "replay", str(path), "--json"] + (["--config", config] if config else [])
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        report = json.loads(capsys.readouterr().out)
        by_rid = {r["rid"]: r for r in report["results"]}
        assert by_rid["g"]["verdict"] == garbled and by_rid["g"]["live_verdict"] == GARBLED
        assert by_rid["l"]["verdict"] == REPETITION
    args = parser.parse_args(["monitor", "replay", str(path)])
    args.func(args)
    assert "requests the live hook aborted: 2, replay verdict = live verdict: 2" in capsys.readouterr().out
