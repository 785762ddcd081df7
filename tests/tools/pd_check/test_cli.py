"""``python -m tools.pd_check``: the bounds as flags (bad ones refused before any work, naming the flag), the
result as JSON, a counterexample saved and replayed, and the exit codes of the safe and unsafe modes."""

from __future__ import annotations

import json

import pytest

from tools.pd_check.cli import main

SMALL = ["--prefill-ranks", "1", "--requests", "1", "--faults", "0", "--cancels", "0",
         "--retries", "0", "--polls", "0", "--channel-capacity", "1"]


def test_json_result_of_a_complete_check(capsys):
    assert main(SMALL + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["complete"] and result["violations"] == [] and result["states"] > 10 and result["depth"] > 5
    assert result["bounds"]["prefill_ranks"] == 1 and "seconds" in result


def test_legacy_counterexample_is_saved_and_replays(tmp_path, capsys):
    ce = tmp_path / "legacy.json"
    assert main(SMALL + ["--legacy-immediate-release", "--shortest", "--save", str(ce)]) == 0  # unsafe: finding it is success
    out = capsys.readouterr().out
    assert "\nshortest counterexample" in out and "VIOLATION freed_while_writing" in out
    assert main(["--replay", str(ce), "--json"]) == 1
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["violation"] and replayed["diverged"] is None


def test_guard_off_finds_its_counterexample(capsys):
    assert main(SMALL + ["--guard-off", "sources-held-until-drained", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["violations"] == ["source_freed_while_writing"]


def test_unsafe_mode_without_a_counterexample_exits_3(capsys):
    assert main(SMALL + ["--guard-off", "free-by-owner-only", "--json"]) == 3


def test_stopped_early_says_so(capsys):
    assert main(SMALL + ["--max-states", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["complete"] and result["stopped"].startswith("max_states")


@pytest.mark.parametrize("flag,value", [("--requests", "0"), ("--faults", "-1"), ("--prefill-ranks", "0"),
                                        ("--pages", "0"), ("--abort-sends", "0"), ("--channel-capacity", "0"),
                                        ("--max-states", "0"), ("--timeout", "0"), ("--guard-off", "nope"),
                                        ("--workers", "0"), ("--workers", "two"), ("--simulate", "0"),
                                        ("--max-steps", "0"), ("--fault-rate", "1.5"), ("--seed", "-1")])
def test_bad_input_names_the_flag(flag, value, capsys):
    assert main([flag, value]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage, then the one error line
    assert last.startswith(f"python -m tools.pd_check: error: argument {flag}")


def test_save_into_a_missing_folder_is_refused_before_the_check(tmp_path, capsys):
    assert main(SMALL + ["--save", str(tmp_path / "no" / "ce.json")]) == 2
    assert "--save: expected a file in a writable folder" in capsys.readouterr().err


def test_every_reduction_in_force_is_reported_and_each_can_be_switched_off(capsys):
    assert main(SMALL + ["--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["reductions"]) == 3
    assert main(SMALL + ["--no-por", "--no-symmetry", "--no-stale-events", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["reductions"] == [] and plain["shortest"] and plain["por_reduced_states"] == 0
    assert plain["bounds"]["por"] is False and plain["bounds"]["stale_events"] is False


def test_shortest_reruns_without_the_partial_order_reduction(capsys):
    two = ["--prefill-ranks", "2", "--requests", "1", "--faults", "0", "--cancels", "0",
           "--retries", "0", "--polls", "0", "--channel-capacity", "1", "--legacy-immediate-release", "--json"]
    assert main(two) == 0
    reduced = json.loads(capsys.readouterr().out)
    assert main(two + ["--shortest"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["shortest"] and short["bounds"]["por"] is False and short["violations"]
    assert len(short["counterexample"]["trace"]) <= len(reduced["counterexample"]["trace"])


def test_simulate_runs_random_walks_and_says_they_are_not_exhaustive(capsys):
    assert main(SMALL + ["--simulate", "20", "--seed", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "simulation" and result["walks"] == 20 and result["plan"]["seed"] == 4
    assert result["complete"] is False and result["violations"] == [] and "not exhaustive" in result["note"]
    ends = result["end_classes"]
    assert ends["walks"] == result["terminal_walks"] and "not exhaustive" in ends["note"]
    assert main(SMALL + ["--simulate", "20", "--seed", "4"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("end_classes"))
    assert f"{ends['classes']} classes over {ends['walks']} terminal walks" in line and "(Good-Turing)" in line


def test_a_simulated_counterexample_is_one_minimal_saved_and_replays(tmp_path, capsys):
    ce = tmp_path / "walk.json"
    assert main(["--legacy-immediate-release", "--simulate", "50", "--save", str(ce)]) == 0
    out = capsys.readouterr().out
    assert "(one-minimal, maybe not shortest: --shortest) counterexample" in out and "VIOLATION freed_while_writing" in out
    assert main(["--replay", str(ce), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["diverged"] is None


@pytest.mark.parametrize("flag", [["--seed", "3"], ["--max-steps", "9"], ["--fault-rate", "0.5"], ["--no-minimize"]],
                         ids=lambda f: f[0])
def test_a_walk_flag_without_simulate_is_refused(flag, capsys):
    assert main(SMALL + flag) == 2
    assert f"{flag[0]}: expected it only with --simulate WALKS, got it without" in capsys.readouterr().err
