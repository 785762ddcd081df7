"""SYNTHETIC evaluation: the generator's regimes behave as labelled, scoring is right, runs are deterministic."""

from __future__ import annotations

import argparse
import json

import pytest

from layersplit.cli import monitor_cmd
from layersplit.cli.app import _int_at_least
from layersplit.pd.spec.monitor_config import load_monitor_config
from layersplit.pd.spec.replay import ReplayRecord, replay_record
from layersplit.pd.spec.evaluate import detect_monitor, detect_text, make_traces, run_eval, score
from layersplit.pd.spec.synth import RARE, SynthTrace
from layersplit.pd.spec.text_baseline import TextBaseline


@pytest.fixture(scope="module")
def traces():
    return make_traces(3, seed=0)


def test_traces_are_deterministic(traces):
    assert make_traces(3, seed=0) == traces
    assert make_traces(3, seed=1) != traces


def test_regimes_move_the_metrics_as_labelled(traces):
    def length(label):
        steps = [a for t in traces if t.label == label for a in t.accepted_after_onset()]
        return (sum(steps) + len(steps)) / len(steps)

    assert length("garbled") < 1.6 < 2.0 < length("healthy") < 3.0 < length("repetition")
    garbled_text = "".join(t.text[t.onset_generated:] for t in traces if t.label == "garbled")
    assert sum(garbled_text.count(ch) for ch in RARE) > 0.02 * len(garbled_text)
    assert all(t.onset_generated is None for t in traces if t.label == "healthy")
    assert all(len(t.tokens) >= 512 for t in traces)


def test_monitor_detection_matches_replay(traces):
    cfg = load_monitor_config()
    for trace in traces:
        record = ReplayRecord(trace.rid, "trace", steps=tuple((trace.draft_tokens, a) for a in trace.accepted))
        result = replay_record(record, cfg)
        assert detect_monitor(trace, cfg) == (result.verdict.kind, result.detected_at)


def trace(label: str, onset: int | None) -> SynthTrace:
    return SynthTrace(f"{label}-{onset}", label, 4, (0,), (0,), onset)


def test_score_by_hand():
    traces = [trace("healthy", None), trace("healthy", None), trace("garbled", 100), trace("garbled", 100),
              trace("repetition", 50), trace("repetition", 50)]
    detections = [("healthy", None), ("repetition", 300),  # one false alarm on a healthy trace
                  ("garbled", 160), ("garbled", 90),  # hit after 60 tokens; flag before the onset
                  ("repetition", 90), ("garbled", 400)]  # hit after 40 tokens; wrong kind
    s = score(traces, detections)
    assert (s["flagged"], s["true_positives"], s["false_positives"]) == (5, 2, 3)
    assert (s["precision"], s["recall"], s["fpr_healthy"]) == (0.4, 0.5, 0.5)
    assert (s["recall_garbled"], s["recall_repetition"]) == (0.5, 0.5)
    assert (s["ttd_median"], s["ttd_median_garbled"], s["ttd_median_repetition"]) == (50, 60, 40)
    assert s["flagged_before_onset"] == 1 and s["flagged_healthy"] == 1


def test_score_with_nothing_flagged():
    s = score([trace("healthy", None)], [("healthy", None)])
    assert s["precision"] is None and s["recall"] is None and s["fpr_healthy"] == 0.0 and s["ttd_median"] is None


@pytest.mark.parametrize("text,kind", [
    ("def f(x):\n    return x + 1\n" * 3, "healthy"),
    ("plain words here " * 4 + "\u2603\u2603", "garbled"),  # 2 of 70 chars: above 2%
    ("plain words here " * 8 + "\u2603", "healthy"),  # 1 of 137 chars
    ("ab" * 8, "repetition"),
    ("ab" * 7, "healthy"),
], ids=["code", "rare-chars", "one-rare-char", "8-repeats", "7-repeats"])
def test_text_baseline(text, kind):
    assert TextBaseline().judge(text) == kind


def test_detect_text_reports_the_check_point():
    t = SynthTrace("r", "repetition", 4, (3,), tuple([16, 24] * 40), 0)  # " the." repeated
    kind, at = detect_text(t, TextBaseline(), every_tokens=8)
    assert kind == "repetition" and at == 16


def test_run_eval_report(traces):
    report = run_eval(load_monitor_config(), requests_per_regime=2, seed=3)
    assert report["synthetic"] is True and report["note"].startswith("SYNTHETIC")
    detectors = [r["detector"] for r in report["rows"]]
    assert detectors[:2] == ["monitor", "text baseline"] and detectors.count("monitor sweep") >= 22
    for row in report["rows"]:
        for key in ("precision", "recall", "fpr_healthy"):
            assert row[key] is None or 0.0 <= row[key] <= 1.0
    assert report == run_eval(load_monitor_config(), requests_per_regime=2, seed=3)
    json.dumps(report)


def test_cli_eval_json(capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    monitor_cmd.add_parser(sub, _int_at_least)
    args = parser.parse_args(["monitor", "eval", "--json", "--requests", "2", "--seed", "5"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests_per_regime"] == 2 and report["seed"] == 5 and report["synthetic"]
    assert report["rows"][0]["setting"] == "configs/monitor.yaml"


def test_cli_rejects_zero_requests():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    monitor_cmd.add_parser(sub, _int_at_least)
    with pytest.raises(SystemExit):
        parser.parse_args(["monitor", "eval", "--requests", "0"])
