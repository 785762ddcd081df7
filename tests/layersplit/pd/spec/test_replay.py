"""Replay of recorded requests (tests/layersplit/pd/spec/data/sample.jsonl) and the ``monitor`` CLI subcommands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from layersplit.cli import monitor_cmd
from layersplit.cli.app import _int_at_least
from layersplit.pd.spec.monitor_config import load_monitor_config
from layersplit.pd.spec.replay import format_results, load_records, parse_record, replay, summarize
from layersplit.pd.spec.monitor import GARBLED, HEALTHY, REPETITION

SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    monitor_cmd.add_parser(sub, _int_at_least)
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def results():
    return {r.record.rid: r for r in replay(load_records(SAMPLE), load_monitor_config())}


def test_sample_mixes_both_formats_and_all_labels(results):
    sources = {r.record.source for r in results.values()}
    labels = [r.record.label for r in results.values()]
    assert sources == {"meta_info", "trace"}
    assert labels.count(HEALTHY) >= 3 and GARBLED in labels and REPETITION in labels


@pytest.mark.parametrize("rid,kind", [
    ("meta-healthy-1", HEALTHY), ("meta-healthy-2", HEALTHY), ("meta-edge-len", HEALTHY),
    ("meta-edge-rate", HEALTHY), ("meta-short", HEALTHY), ("meta-garbled", GARBLED), ("meta-loop", REPETITION),
    ("meta-flat", HEALTHY), ("trace-healthy-0", HEALTHY), ("trace-garbled-0", GARBLED),
    ("trace-repetition-0", REPETITION), ("trace-repetition-1", REPETITION),
])
def test_sample_verdicts(results, rid, kind):
    assert results[rid].verdict.kind == kind, results[rid].verdict.reason


def test_trace_detection_point(results):
    r = results["trace-garbled-0"]
    assert r.detected_at == r.verdict.numbers["generated"] > 128
    assert r.verdict.reason.startswith("window of 32 steps accept length")
    assert results["meta-healthy-1"].detected_at is None


def test_summary_counts(results):
    summary = summarize(list(results.values()))
    assert summary["records"] == len(results) == sum(summary["verdicts"].values())
    assert summary["labelled"] == len(results)
    assert summary["agree_with_label"] == sum(r.record.label == r.verdict.kind for r in results.values())
    text = format_results(list(results.values()), summary)
    assert "reasons:" in text and "meta-loop: cumulative accept rate" in text


def test_record_forms():
    top_level = parse_record("x:1", {"id": "q", "completion_tokens": 10, "spec_verify_ct": 5})
    assert (top_level.rid, top_level.source) == ("q", "meta_info")
    per_step = parse_record("x:2", {"draft_tokens": [4, 2], "accepted": [3, 1]})
    assert (per_step.rid, per_step.steps) == ("x:2", ((4, 3), (2, 1)))


@pytest.mark.parametrize("line,pattern", [
    ("[1, 2]", r"bad.jsonl:2: expected a JSON object, got list"),
    ("{not json", r"bad.jsonl:2: expected a JSON object, got invalid JSON"),
    ('{"rid": "a"}', r"bad.jsonl:2: expected a 'meta_info' object .* got keys \['rid'\]"),
    ('{"meta_info": {"completion_tokens": 3}}', r"bad.jsonl:2: field 'meta_info.spec_verify_ct': expected an int, got nothing"),
    ('{"accepted": [1, "x"], "draft_tokens": 4}', r"bad.jsonl:2: field 'accepted': expected a list of ints"),
    ('{"accepted": [1, 2], "draft_tokens": [4]}', r"bad.jsonl:2: field 'draft_tokens': expected an int or a list of 2 ints"),
    ('{"accepted": [1], "draft_tokens": 4, "label": "odd"}', r"bad.jsonl:2: field 'label': expected one of"),
], ids=["not-object", "bad-json", "no-fields", "meta-missing", "accepted-type", "draft-length", "label"])
def test_load_errors_name_file_and_line(tmp_path, line, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("# comment\n" + line + "\n")
    with pytest.raises(ValueError, match=pattern):
        load_records(path)


def test_impossible_step_names_the_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"rid": "z", "accepted": [5], "draft_tokens": 4}\n')
    with pytest.raises(ValueError, match=r"record 'z': accepted: expected an int in \[0, 3\], got 5"):
        replay(load_records(path), load_monitor_config())


def test_cli_replay_text(capsys):
    assert cli("monitor", "replay", str(SAMPLE)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["rid", "source", "label", "verdict", "gen", "steps", "acc_len", "acc_rate", "at"]
    assert "summary" in out and "labelled records:" in out


def test_cli_replay_json(capsys):
    assert cli("monitor", "replay", str(SAMPLE), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["records"] == len(report["results"])
    assert {r["verdict"] for r in report["results"]} == {HEALTHY, GARBLED, REPETITION}
