"""Bad input to the command line: one line naming the flag or config field, exit 2, before any
process starts or anything is written (each case fails within seconds; the issue's table)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from layersplit.cli.app import build_parser, main
from tests.paths import ROOT

CPU_SWEEP = ROOT / "configs" / "sweeps" / "cpu.yaml"


def _sweep_config(tmp_path: Path, field: str, value: str) -> str:
    lines = [f"{field}: {value}" if line.startswith(f"{field}:") else line
             for line in CPU_SWEEP.read_text().splitlines()]
    path = tmp_path / "bad.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


CASES = [
    (["prefill", "--cp", "16", "--mode", "layersplit"], "layersplit prefill: error: --cp: expected <= 8"),
    (["prefill", "--cp", "2", "--mode", "layersplit", "--model", "glm-5"], "--model 'glm-5' with context_len"),
    (["prefill", "--cp", "2", "--mode", "layersplit", "--trace", "/etc/hostname/t.json"], "argument --trace: cannot write"),
    (["prefill", "--cp", "2", "--mode", "layersplit", "--seed", str(2**70)], "argument --seed: expected an integer in"),
    (["plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--max-batch-tokens", str(10**15)],
     "--max-batch-tokens: two scratch slots"),
    (["plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200", "--context-len", str(10**15)],
     "--context-len: expected <= 1,624,268 tokens"),
    (["stress", "hicache", "--seed", str(2**70)], "layersplit stress hicache: error: argument --seed"),
    (["stress", "pd", "--drop", "1.5"], "layersplit stress pd: error: argument --drop: expected a number in [0, 1)"),
    (["stress", "pd", "--decode-pages", "4"], "argument --decode-pages: expected an integer >= 8, got 4"),
    (["sweep", "--out", "/etc/hostname/sweep"], "argument --out: cannot write"),
    (["monitor", "replay", str(ROOT / "tests" / "layersplit" / "pd" / "spec" / "data" / "empty.jsonl")],
     "layersplit monitor replay: error: file: expected at least one JSONL record"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0][:3]) + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_input_fails_fast_with_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert time.perf_counter() - start < 20  # nothing was started
    assert not any(tmp_path.iterdir())  # nothing was written


@pytest.mark.parametrize("field,value,message", [
    ("cp", "16", "field 'cp': expected <= 8"),
    ("max_batch_requests", "0", "field 'max_batch_requests': expected an integer >= 1"),
    ("model", "glm-6", "field 'model': model 'glm-6'"),
    ("seed", str(2**70), "field 'seed'"),
])
def test_bad_sweep_config_fails_before_work(tmp_path, capsys, field, value, message):
    out = tmp_path / "out"
    assert main(["sweep", "--config", _sweep_config(tmp_path, field, value), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("layersplit sweep: error: --config:") and message in err
    assert not out.exists()


def test_every_flag_has_help():
    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.option_strings and action.help is None:
                missing.append(f"{path} {action.option_strings[0]}")

    walk(build_parser(), "layersplit")
    assert not missing, f"flags without help: {missing}"


def _parsers(parser: argparse.ArgumentParser, path: str):
    """(path, parser) of ``parser`` and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_parser_refuses_a_value_given_twice():
    """Every (sub)parser of the product and the maintainers' tools is an ``options.Parser``, so every flag
    with a value refuses a second, different one; what is meant to repeat (append, count) still does."""
    import importlib.util

    from layersplit.cli import options
    from tools.pd_check.cli import build_parser as pd_check_parser
    from tools.pd_real.cli import build_parser as pd_real_parser

    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "benchmarks" / "gpu_check.py")
    gpu_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_script)
    roots = {"layersplit": build_parser(), "pd_check": pd_check_parser(), "pd_real": pd_real_parser(),
             "gpu_check.py": gpu_script.build_parser()}
    once, repeatable = 0, 0
    for root, parser in roots.items():
        for path, sub in _parsers(parser, root):
            assert isinstance(sub, options.Parser), path
            for action in sub._actions:
                if isinstance(action, argparse._StoreAction) and action.option_strings:
                    assert isinstance(action, options._StoreOnce), f"{path} {action.option_strings[0]}"
                    once += 1
                repeatable += isinstance(action, (argparse._AppendAction, argparse._CountAction))
    assert once > 100 and repeatable >= 3  # --kill-rank, --restart-decode, --guard-off (stress pd, pd_check)


PLAN = ["plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200"]
PREFILL = ["prefill", "--mode", "layersplit"]


@pytest.mark.parametrize("argv,kept", [
    (["stress", "pd", "--guard-off", "owners-only", "--guard-off", "fence-refuses-writes"],
     ("guard_off", ["owners-only", "fence-refuses-writes"])),  # append: meant to repeat
    ([*PLAN, "--cp", "8"], ("cp", 8)),  # the same value twice drops nothing
    ([*PLAN, "--kv-dtype", "fp8", "--kv-cache-dtype", "fp8_e4m3"], ("kv_dtype", "fp8")),  # agree as parsed
    (["stress", "hicache", "--iterations", "7", "--loads", "7"], ("loads", 7)),  # a hidden old name, agreeing
], ids=["append", "same-value", "alias-agrees", "hidden-alias-agrees"])
def test_what_may_repeat_is_taken(argv, kept):
    args = build_parser().parse_args(argv)
    assert getattr(args, kept[0]) == kept[1]


def test_a_parser_forgets_the_last_command_line(capsys):
    """The flags seen are this parse's: parsing again with the same parser (a test, a REPL) is not a repeat."""
    parser = build_parser()
    assert parser.parse_args([*PREFILL, "--cp", "2"]).cp == 2
    assert parser.parse_args([*PREFILL, "--cp", "4"]).cp == 4
    with pytest.raises(SystemExit) as info:
        parser.parse_args([*PREFILL, "--cp", "4", "--cp=2"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "layersplit prefill: error: argument --cp: given twice (4, then 2): give it once\n"
