"""A tool that never surprises its operator (issue 44): every bad input below is refused with exit 2 and one
line on stderr, ``PROG: error: ...``, naming the flag, variable, file or field the user gave, before anything
is spawned, computed or written, and without a traceback; a result that cannot be saved is printed first;
a run that checked nothing or could not replay does not exit 0.

Each row of ``CASES``: an id, the command line (``layersplit``, ``python -m tools.pd_check``, ``python -m
tools.pd_real`` or ``python benchmarks/gpu_check.py``), the environment, the exit status and a fragment of
the first line on stderr. ``{in}`` in an argument is a folder
of prepared inputs (``_inputs``); the command runs from an empty folder that must stay empty. Rows run
in-process (``main(argv)``) on the same pretend machine (``MACHINE``); ``SUBPROCESS`` runs a few as a user does, where the environment is read by a
fresh interpreter and its rank processes, and one SIGTERM."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from layersplit.cli import app, resources
from tests.paths import ROOT
from tools.pd_check import cli as pd_check_cli
from tools.pd_real import cli as pd_real_cli

CUDA = torch.cuda.is_available()
PLAN = ["plan", "--model", "glm-5", "--cp", "8", "--hardware", "h200"]
PREFILL = ["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "64"]
SMALL = ["--prefill-ranks", "1", "--requests", "1", "--faults", "0", "--cancels", "0", "--retries", "0",
         "--polls", "0", "--channel-capacity", "1"]  # a pd_check search of a second or two
PD = "python -m tools.pd_check"
PD_REAL = "python -m tools.pd_real"
GPU_SCRIPT = "python benchmarks/gpu_check.py"
# every row runs on this pretend machine: host memory (what the prefill and sweep engines check) and one GPU
# with the free memory the sweep's rank check reads (too little for the CPU sweep's 28.5 MiB a rank)
MACHINE = {"host_bytes": 16 * 2**30, "gpu_free_bytes": [24 * 2**20]}
LONG = "n" * 300


def _inputs(folder: Path) -> None:
    """Bad files of every kind the commands read: configs (inf, nan, a key twice, a length twice), JSONL and
    counterexample files (not UTF-8, not JSON, an empty trace, unknown bounds, a step no longer possible)."""
    from tools.pd_check.bounds import CheckBounds

    folder.mkdir()
    h200 = (ROOT / "configs" / "hardware" / "h200.yaml").read_text()
    (folder / "hw_inf.yaml").write_text(h200.replace("hbm_bandwidth: ", "hbm_bandwidth: .inf #"))
    (folder / "hw_nan.yaml").write_text(h200.replace("nvlink_bandwidth: ", "nvlink_bandwidth: .nan #"))
    (folder / "hw_twice.yaml").write_text(h200 + "gpus_per_node: 4\n")
    sweep = yaml.safe_load((ROOT / "configs" / "sweeps" / "glm5-h200.yaml").read_text())
    (folder / "lengths_twice.yaml").write_text(yaml.safe_dump(sweep | {"lengths": [40000, 40000, 120000]}))
    (folder / "scale_inf.yaml").write_text(yaml.safe_dump(sweep) .replace("scale: 1.0", "scale: .inf"))
    (folder / "monitor_twice.yaml").write_text((ROOT / "configs" / "monitor.yaml").read_text() + "window_steps: 3\n")
    (folder / "latin1.jsonl").write_bytes(b'{"meta_info": {"completion_tokens": 3}}\n{"caf\xe9": 1}\n')
    (folder / "broken.jsonl").write_text('{"meta_info": \n')
    (folder / "latin1.json").write_bytes(b'{"bounds": {}, "trace": ["caf\xe9"], "violation": []}')
    (folder / "broken.json").write_text('{"bounds": {}, "trace": [\n')
    good = CheckBounds(prefill_ranks=1, requests=1, faults=0, cancels=0, retries=0, polls=0).to_dict()
    (folder / "empty_trace.json").write_text(json.dumps({"bounds": good, "trace": [], "violation": []}))
    (folder / "bad_bounds.json").write_text(json.dumps({"bounds": good | {"ranks": 3}, "trace": ["x"], "violation": []}))
    (folder / "diverged.json").write_text(json.dumps({"bounds": good, "trace": ["no such step"], "violation": []}))
    (folder / "a_file").write_text("")


# id, argv (PD first: python -m tools.pd_check), environment, exit status, fragment of stderr's first line
CASES = [
    # 1. resources before work
    ("sweep-real-glm5", ["sweep", "--config", "glm5-h200", "--engine", "real"], {}, 2,
     "layersplit sweep: error: --engine real with --config glm5-h200: the CP engine keeps glm-5's weights in fp32"),
    ("sweep-real-gpu-full", ["sweep", "--engine", "real", "--out", "out"], {}, 2,
     "layersplit sweep: error: --engine real with --config cpu: each of 2 rank processes needs about 28.5 MiB on its "
     "GPU (tiny's fp32 weights, 18.2 MiB, and a KV pool of 10.3 MiB (bf16) for a batch of 4,096 tokens); 2 ranks "
     "share cuda:0, which has 24.0 MiB free; use --engine model (modelled), or set CUDA_VISIBLE_DEVICES="),
    ("stress-pd-huge", ["stress", "pd", "--requests", "100000000"], {}, 2,
     "layersplit stress pd: error: --requests: expected <= "),
    # 2. output paths, checked up front
    ("gpu-check-out-file", ["gpu-check", "--out", "{in}/a_file"], {}, 2,
     "layersplit gpu-check: error: argument --out: expected a folder, got the file"),
    ("gpu-check-out-under-file", ["gpu-check", "--out", "{in}/a_file/x"], {}, 2, "a_file' is not a folder"),
    ("gpu-check-out-unwritable", ["gpu-check", "--out", "/proc/layersplit-out"], {}, 2,
     "argument --out: cannot write '/proc/layersplit-out': the folder '/proc' is not writable"),
    ("gpu-check-out-empty", ["gpu-check", "--out", ""], {}, 2, "argument --out: expected a folder path, got ''"),
    ("gpu-check-out-long", ["gpu-check", "--out", LONG], {}, 2, "argument --out: expected names of at most 255 bytes"),
    ("sweep-out-file", ["sweep", "--engine", "model", "--out", "{in}/a_file"], {}, 2,
     "argument --out: expected a folder, got the file"),
    ("sweep-out-empty", ["sweep", "--engine", "model", "--out", ""], {}, 2, "argument --out: expected a folder path"),
    ("prefill-trace-long", [*PREFILL, "--trace", f"{LONG}.json"], {}, 2,
     "layersplit prefill: error: argument --trace: expected names of at most 255 bytes"),
    ("prefill-trace-folder", [*PREFILL, "--trace", "{in}"], {}, 2, "argument --trace: expected a file path, got the folder"),
    ("pd-check-save-folder", [PD, *SMALL, "--save", "{in}"], {}, 2,
     "python -m tools.pd_check: error: argument --save: expected a file path, got the folder"),
    ("pd-check-save-long", [PD, *SMALL, "--save", LONG], {}, 2, "argument --save: expected names of at most 255 bytes"),
    ("pd-check-save-empty", [PD, *SMALL, "--save", ""], {}, 2, "argument --save: expected a file path, got ''"),
    ("plan-model-long", ["plan", "--model", LONG, "--cp", "8", "--hardware", "h200"], {}, 2,
     "argument --model/--model-path: expected names of at most 255 bytes"),
    ("sweep-config-long", ["sweep", "--config", LONG], {}, 2, "argument --config: expected names of at most 255"),
    ("replay-file-long", ["monitor", "replay", LONG], {}, 2, "argument file: expected names of at most 255 bytes"),
    ("replay-file-missing", ["monitor", "replay", "{in}/none.jsonl"], {}, 2, "argument file: expected an existing file"),
    ("pd-check-save-no-folder", [PD, *SMALL, "--save", "{in}/no/ce.json"], {}, 2,
     "argument --save: expected a file in a writable folder"),
    # 2. environment variables: one strict parse each, in the parent
    ("cp-backend-mpi", PREFILL, {"LAYERSPLIT_CP_BACKEND": "mpi"}, 2,
     "layersplit prefill: error: LAYERSPLIT_CP_BACKEND: expected one of ('auto', 'nccl', 'gloo'), got 'mpi'"),
    ("kernel-backend-sweep", ["sweep", "--engine", "model", "--out", "out"], {"LAYERSPLIT_KERNEL_BACKEND": "cuda"}, 2,
     "layersplit sweep: error: LAYERSPLIT_KERNEL_BACKEND: expected one of"),
    ("kernel-backend-prefill", PREFILL, {"LAYERSPLIT_KERNEL_BACKEND": "fast"}, 2, "LAYERSPLIT_KERNEL_BACKEND: expected"),
    ("sanitize-maybe", PLAN, {"LAYERSPLIT_SANITIZE": "maybe"}, 2,
     "layersplit plan: error: LAYERSPLIT_SANITIZE: expected 1/true/yes/on or 0/false/no/off, got 'maybe'"),
    ("sanitize-2", ["stress", "hicache", "--iterations", "1"], {"LAYERSPLIT_SANITIZE": "2"}, 2,
     "LAYERSPLIT_SANITIZE: expected 1/true/yes/on or 0/false/no/off, got '2'"),
    ("variable-typo", PLAN, {"LAYERSPLIT_SANITISE": "1"}, 2,
     "LAYERSPLIT_SANITISE: expected one of the known variables"),
    ("config-dir-missing", PLAN, {"LAYERSPLIT_CONFIG_DIR": "/nonexistent-layersplit"}, 2,
     "LAYERSPLIT_CONFIG_DIR: expected an existing folder of configs"),
    ("scratch-tokens", PLAN, {"LAYERSPLIT_SGLANG_SCRATCH_TOKENS": "lots"}, 2,
     "LAYERSPLIT_SGLANG_SCRATCH_TOKENS: expected a positive integer, got 'lots'"),
    ("landing", PLAN, {"LAYERSPLIT_SGLANG_LANDING": "both"}, 2, "LAYERSPLIT_SGLANG_LANDING: expected one of"),
    ("plugin-flag", PLAN, {"LAYERSPLIT_SGLANG_PLUGIN": "enabled"}, 2, "LAYERSPLIT_SGLANG_PLUGIN: expected 1/true"),
    ("spec-monitor-flag", PLAN, {"LAYERSPLIT_SGLANG_SPEC_MONITOR": "2"}, 2, "LAYERSPLIT_SGLANG_SPEC_MONITOR: expected"),
    ("unsafe-skip", PLAN, {"LAYERSPLIT_SGLANG_UNSAFE_SKIP": "everything"}, 2, "LAYERSPLIT_SGLANG_UNSAFE_SKIP: expected"),
    ("pd-check-env", [PD, *SMALL], {"LAYERSPLIT_CP_BACKEND": "mpi"}, 2, "python -m tools.pd_check: error: LAYERSPLIT_CP"),
    # 3. sglang-plan: its own checks before SGLang is asked
    ("sglang-plan-empty", ["sglang-plan", "--sglang-args", ""], {}, 2,
     "layersplit sglang-plan: error: --sglang-args: expected the prefill worker's flags, got none"),
    ("sglang-plan-quote", ["sglang-plan", "--sglang-args", '--model-path "/m'], {}, 2,
     "--sglang-args: expected flags quoted as on a command line"),
    ("sglang-plan-sm", ["sglang-plan", "--sglang-args", "--tp 8", "--sm", "9"], {}, 2,
     "--sm: expected a compute capability like 90 or 100, got '9'"),
    ("sglang-plan-one-of-two", ["sglang-plan", "--sglang-args", "--tp 8", "--model", "glm-5"], {}, 2,
     "--model/--hardware: expected both"),
    ("sglang-plan-cpu-hardware", ["sglang-plan", "--sglang-args", "--tp 8", "--model", "tiny", "--hardware", "cpu"], {},
     2, "--hardware: 'cpu' has no CUDA device"),
    # 4. nothing silently dropped: two spellings of one setting
    ("alias-kv-dtype", [*PLAN, "--kv-dtype", "bf16", "--kv-cache-dtype", "fp8_e4m3"], {}, 2,
     "layersplit plan: error: --kv-dtype/--kv-cache-dtype: expected one value for one setting, got --kv-dtype 'bf16' "
     "and --kv-cache-dtype 'fp8'"),
    ("alias-model", ["plan", "--model", "glm-5", "--model-path", "tiny", "--cp", "8", "--hardware", "h200"], {}, 2,
     "--model/--model-path: expected one value"),
    ("alias-mem-fraction", [*PLAN, "--mem-fraction", "0.8", "--mem-fraction-static", "0.9"], {}, 2,
     "--mem-fraction/--mem-fraction-static: expected one value for one setting, got --mem-fraction 0.8"),
    ("alias-abbreviated", [*PLAN, "--kv-dtype", "bf16", "--kv-cache", "fp8"], {}, 2,
     "--kv-dtype/--kv-cache-dtype: expected one value for one setting, got --kv-dtype 'bf16' and --kv-cache-dtype "
     "'fp8'"),
    ("alias-hidden-context", [*PREFILL, "--context", "128"], {}, 2,
     "layersplit prefill: error: --context-len/--context: expected one value for one setting, got --context-len 64 "
     "and --context 128"),
    ("alias-hidden-loads", ["stress", "hicache", "--iterations", "5", "--loads", "6"], {}, 2, "--iterations/--loads"),
    ("prefill-timeout-zero", [*PREFILL, "--timeout-s", "0"], {}, 2,
     "layersplit prefill: error: argument --timeout-s: expected a number in (0, 604800], got 0"),
    ("prefill-timeout-nan", [*PREFILL, "--timeout-s", "nan"], {}, 2, "argument --timeout-s: expected a number in (0, "),
    ("prefill-timeout-huge", [*PREFILL, "--timeout-s", "1e9"], {}, 2, "argument --timeout-s: expected a number in (0, "),
    ("prefill-timeout-word", [*PREFILL, "--timeout-s", "soon"], {}, 2, "--timeout-s: expected a number in (0, 604800], "
     "got 'soon'"),
    # 4. nothing silently dropped: one flag given twice with different values, in every parser
    ("twice-prefill-timeout", [*PREFILL, "--timeout-s", "60", "--timeout-s", "90"], {}, 2,
     "layersplit prefill: error: argument --timeout-s: given twice (60.0, then 90.0): give it once"),
    ("twice-prefill-cp", [*PREFILL, "--cp", "4"], {}, 2,
     "layersplit prefill: error: argument --cp: given twice (2, then 4): give it once"),
    ("twice-sweep-config", ["sweep", "--config", "cpu", "--config", "glm5-h200"], {}, 2,
     "layersplit sweep: error: argument --config: given twice ('cpu', then 'glm5-h200'): give it once"),
    ("twice-plan-abbreviated", [*PLAN, "--hard", "b200"], {}, 2,
     "layersplit plan: error: argument --hardware: given twice ('h200', then 'b200'): give it once"),
    ("twice-plan-as-parsed", [*PLAN, "--kv-dtype", "fp8", "--kv-dtype", "fp8_e4m3", "--kv-dtype", "bf16"], {}, 2,
     "argument --kv-dtype: given 3 times ('fp8', then 'bf16'): give it once"),
    ("twice-stress-pd", ["stress", "pd", "--seed", "1", "--seed", "2"], {}, 2,
     "layersplit stress pd: error: argument --seed: given twice (1, then 2): give it once"),
    ("twice-stress-hicache", ["stress", "hicache", "--loads", "5", "--loads", "6"], {}, 2,
     "layersplit stress hicache: error: argument --loads: given twice (5, then 6)"),
    ("twice-monitor-eval", ["monitor", "eval", "--requests", "3", "--requests=4"], {}, 2,
     "layersplit monitor eval: error: argument --requests: given twice (3, then 4): give it once"),
    ("twice-gpu-check", ["gpu-check", "--out", "{in}/a", "--out", "{in}/b"], {}, 2,
     "layersplit gpu-check: error: argument --out: given twice ('{in}/a', then '{in}/b'): give it once"),
    ("twice-sglang-plan", ["sglang-plan", "--sglang-args", "--tp 8", "--sm", "90", "--sm", "100"], {}, 2,
     "layersplit sglang-plan: error: argument --sm: given twice ('90', then '100'): give it once"),
    ("twice-pd-check", [PD, "--requests", "1", "--requests", "2"], {}, 2,
     "python -m tools.pd_check: error: argument --requests: given twice (1, then 2): give it once"),
    ("twice-pd-real", [PD_REAL, "storm", "--requests", "1", "--requests", "2"], {}, 2,
     "python -m tools.pd_real storm: error: argument --requests: given twice (1, then 2): give it once"),
    ("twice-gpu-script", [GPU_SCRIPT, "--out", "{in}/a", "--budget-s", "60", "--budget-s", "90"], {}, 2,
     "python benchmarks/gpu_check.py: error: argument --budget-s: given twice (60, then 90): give it once"),
    # 4. the maintainers' tools' usage errors are one line too, naming the tool as it was run
    ("pd-real-usage", [PD_REAL, "storm", "--requests", "x"], {}, 2,
     "python -m tools.pd_real storm: error: argument --requests: expected an integer >= 1, got 'x'"),
    ("pd-real-no-command", [PD_REAL], {}, 2,
     "python -m tools.pd_real: error: the following arguments are required: command"),
    ("pd-real-unknown-flag", [PD_REAL, "probes", "--bogus"], {}, 2,
     "python -m tools.pd_real: error: unrecognized arguments: --bogus"),
    ("gpu-script-usage", [GPU_SCRIPT, "--out", "{in}/a", "--budget-s", "0"], {}, 2,
     "python benchmarks/gpu_check.py: error: argument --budget-s: expected an integer >= 1, got 0"),
    ("gpu-script-no-out", [GPU_SCRIPT], {}, 2,
     "python benchmarks/gpu_check.py: error: the following arguments are required: --out"),
    # 4. mode-only flags without their mode
    ("outage-rank-alone", ["stress", "pd", "--requests", "10", "--outage-rank", "1"], {}, 2,
     "layersplit stress pd: error: --outage-rank: expected it only with --partition, --prefill-down, --lease-loss"),
    ("outage-at-alone", ["stress", "pd", "--requests", "10", "--outage-at", "3"], {}, 2, "--outage-at: expected it only"),
    ("replay-with-bounds", [PD, "--replay", "{in}/diverged.json", "--requests", "3"], {}, 2,
     "python -m tools.pd_check: error: --requests: expected no bound or search flag with --replay"),
    ("replay-with-save", [PD, "--replay", "{in}/diverged.json", "--save", "{in}/x.json"], {}, 2, "--save: expected no"),
    ("walk-flag-alone", [PD, *SMALL, "--seed", "3"], {}, 2, "--seed: expected it only with --simulate"),
    # 4. empty names, configs the loaders refuse naming the field or key
    ("sweep-config-empty", ["sweep", "--config", ""], {}, 2,
     "layersplit sweep: error: argument --config: expected a config name or path, got ''"),
    ("plan-model-empty", ["plan", "--model", "", "--cp", "8", "--hardware", "h200"], {}, 2,
     "argument --model/--model-path: expected a config name or path"),
    ("plan-hardware-empty", ["plan", "--model", "glm-5", "--cp", "8", "--hardware", ""], {}, 2, "argument --hardware"),
    ("hicache-model-empty", ["stress", "hicache", "--model", ""], {}, 2, "argument --model: expected a config name"),
    ("monitor-config-empty", ["monitor", "eval", "--config", ""], {}, 2, "argument --config: expected a config name"),
    ("weight-shards", [*PLAN, "--weight-shards", "100000"], {}, 2,
     "layersplit plan: error: --weight-shards: expected <= 256 (the routed experts of glm-5"),
    ("hardware-inf", ["plan", "--model", "glm-5", "--cp", "8", "--hardware", "{in}/hw_inf.yaml"], {}, 2,
     "hw_inf.yaml: field 'hbm_bandwidth': expected a finite number, got inf"),
    ("hardware-nan", ["plan", "--model", "glm-5", "--cp", "8", "--hardware", "{in}/hw_nan.yaml"], {}, 2,
     "field 'nvlink_bandwidth': expected a finite number, got nan"),
    ("hardware-key-twice", ["plan", "--model", "glm-5", "--cp", "8", "--hardware", "{in}/hw_twice.yaml"], {}, 2,
     "duplicate key 'gpus_per_node' (first at line"),
    ("sweep-length-twice", ["sweep", "--config", "{in}/lengths_twice.yaml", "--out", "out"], {}, 2,
     "field 'lengths': expected distinct lengths, got [40000, 40000, 120000] (40000 more than once)"),
    ("sweep-scale-inf", ["sweep", "--config", "{in}/scale_inf.yaml", "--out", "out"], {}, 2,
     "field 'scale': expected a finite number, got inf"),
    ("monitor-key-twice", ["monitor", "eval", "--config", "{in}/monitor_twice.yaml"], {}, 2, "duplicate key 'window_steps'"),
    # 4. the flag the user typed, not the library's name
    ("pd-prefill-cp", ["stress", "pd", "--requests", "10", "--prefill-cp", "100"], {}, 2,
     "layersplit stress pd: error: --prefill-cp: expected <= num_layers (61) of --layers so every rank owns"),
    ("pd-kill-rank", ["stress", "pd", "--requests", "10", "--kill-rank", "5@10"], {}, 2,
     "--kill-rank: expected a rank in [0, 1] (--prefill-cp 2), got 5"),
    ("pd-kill-nan", ["stress", "pd", "--kill-rank", "0@nan"], {}, 2, "argument --kill-rank: expected RANK@SECONDS"),
    ("pd-guard-off", ["stress", "pd", "--requests", "10", "--guard-off", "nope"], {}, 2,
     "layersplit stress pd: error: --guard-off: expected one of"),
    ("pd-restart-decode-nan", ["stress", "pd", "--restart-decode", "nan"], {}, 2,
     "argument --restart-decode: expected a number in [0, 1e+06]"),
    ("pd-cancel-one", ["stress", "pd", "--cancel", "1"], {}, 2, "argument --cancel: expected a number in [0, 1)"),
    ("plan-cp", ["plan", "--model", "glm-5", "--cp", "100", "--hardware", "h200"], {}, 2, "layersplit plan: error: --cp:"),
    ("pd-check-fault-kinds", [PD, *SMALL, "--fault-kinds", "bogus"], {}, 2, "error: --fault-kinds: expected some of"),
    ("usage-one-line", ["plan", "--cp", "x"], {}, 2, "layersplit plan: error: argument --cp: expected an integer"),
    # 4. files that are not what they should be, named
    ("replay-latin1", ["monitor", "replay", "{in}/latin1.jsonl"], {}, 2,
     "latin1.jsonl:2: expected UTF-8 text, got byte 0xe9"),
    ("replay-broken", ["monitor", "replay", "{in}/broken.jsonl"], {}, 2, "broken.jsonl:1: expected a JSON object"),
    ("counterexample-latin1", [PD, "--replay", "{in}/latin1.json"], {}, 2, "latin1.json: expected UTF-8 text"),
    ("counterexample-broken", [PD, "--replay", "{in}/broken.json"], {}, 2, "broken.json:2:1: expected valid JSON"),
    ("counterexample-empty", [PD, "--replay", "{in}/empty_trace.json"], {}, 2,
     "empty_trace.json: expected a counterexample with at least one step"),
    ("counterexample-bounds", [PD, "--replay", "{in}/bad_bounds.json"], {}, 2, "bad_bounds.json: field 'bounds'"),
    # 5. exit codes that say what happened
    ("replay-diverged", [PD, "--replay", "{in}/diverged.json"], {}, 3,
     "python -m tools.pd_check: diverged: step 1 of"),
]
if not CUDA:  # refusals of a machine without CUDA
    CASES += [
        ("cp-backend-nccl", PREFILL, {"LAYERSPLIT_CP_BACKEND": "nccl"}, 2,
         "LAYERSPLIT_CP_BACKEND: expected auto or gloo on a machine without CUDA, got 'nccl'"),
        ("kernel-triton-no-interpreter", PREFILL, {"LAYERSPLIT_KERNEL_BACKEND": "triton", "TRITON_INTERPRET": None}, 2,
         "LAYERSPLIT_KERNEL_BACKEND: 'triton' on a machine without CUDA needs Triton's interpreter; set "
         "TRITON_INTERPRET=1"),
        ("kernel-triton-interpreter-off", ["sweep", "--engine", "real", "--out", "out"],
         {"LAYERSPLIT_KERNEL_BACKEND": "triton", "TRITON_INTERPRET": "off"}, 2, "set TRITON_INTERPRET=1"),
        ("sglang-plan-no-gpu", ["sglang-plan", "--sglang-args", "--tp 8"], {}, 2,
         "--sm: no GPU here to resolve as; expected --sm (e.g. 90 for H200"),
    ]


def _argv(argv: list[str], inputs: Path) -> list[str]:
    return [a.replace("{in}", str(inputs)) for a in argv]


@functools.cache
def _gpu_script():
    """``benchmarks/gpu_check.py`` as a module (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_in_process(argv: list[str]) -> int:
    tools = {PD: pd_check_cli.main, PD_REAL: pd_real_cli.main, GPU_SCRIPT: lambda rest: _gpu_script().main(rest)}
    return tools[argv[0]](argv[1:]) if argv[0] in tools else app.main(argv)


def pretend_machine(monkeypatch) -> None:
    """Every row on ``MACHINE``: the host memory the engines read, the GPU the sweep's rank check reads."""
    for where in ("layersplit.engine.prefill", "layersplit.api"):
        monkeypatch.setattr(f"{where}.available_memory_bytes", lambda: MACHINE["host_bytes"])
    monkeypatch.setattr(resources, "gpu_free_bytes", lambda ranks: MACHINE["gpu_free_bytes"][:ranks])
    # prefill's own device checks (tests/layersplit/cli/test_prefill_cmd.py) see no GPU here, on any machine
    monkeypatch.setattr("layersplit.engine.prefill.probe_gpus", lambda devices: None)


@pytest.fixture
def places(tmp_path, monkeypatch):
    """(inputs, cwd): the prepared files, and an empty folder to run in (it must stay empty)."""
    _inputs(tmp_path / "in")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "in", tmp_path / "cwd"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, places, capsys, monkeypatch):
    name, argv, env, status, fragment = case
    inputs, cwd = places
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    pretend_machine(monkeypatch)
    monkeypatch.setattr(resources, "STORM_MEASURED", 50)  # the storm's short measurement, shorter
    before = sorted(inputs.iterdir())
    start = time.perf_counter()
    assert _run_in_process(_argv(argv, inputs)) == status
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and fragment.replace("{in}", str(inputs)) in lines[0], captured.err
    assert "Traceback" not in captured.err
    if status == 2:
        assert len(lines) == 1 and ": error: " in lines[0], captured.err  # one line, nothing before it
    assert time.perf_counter() - start < 30  # refused before the work
    assert not any(cwd.iterdir()) and sorted(inputs.iterdir()) == before  # nothing written


def test_agreeing_spellings_are_one_value(capsys):
    """Two spellings of one setting with the same value (as parsed) are not a conflict."""
    assert app.main([*PLAN, "--kv-dtype", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_dtype"] == "fp8"
    assert app.main([*PLAN, "--mem-fraction", "0.8", "--mem-fraction-static", "0.80", "--json"]) == 0


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                      ("0", False), ("off", False), ("", False), ("2", False), (" 1", False)])
def test_triton_interpret_is_read_as_triton_reads_it(value, on, monkeypatch):
    """Triton 3.x lowercases TRITON_INTERPRET and takes 1/true/on/yes/y as on, anything else as off."""
    from lsconfig import envs

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert envs.triton_interpret() is on
    try:
        from triton._C.libtriton import getenv_bool
    except ImportError:
        return
    assert getenv_bool("TRITON_INTERPRET", False) is on  # the installed Triton agrees


@pytest.mark.parametrize("value,on", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False),
                                      ("", False)])
def test_flag_variables_take_both_spellings(value, on, monkeypatch):
    from lsconfig import envs

    monkeypatch.setenv("LAYERSPLIT_SANITIZE", value)
    assert envs.sanitize() is on


@pytest.mark.parametrize("call,error,message", [
    (lambda: __import__("layersplit").load_sweep(None), TypeError, "name_or_path: expected a sweep config name"),
    (lambda: __import__("layersplit").load_model(42), TypeError, "name_or_path: expected a model config name or path "
                                                                 "(str or Path), got 42 (int)"),
    (lambda: __import__("layersplit").load_hardware(""), ValueError, "hardware '': expected a config name or a path"),
    (lambda: __import__("layersplit").sweep(None), TypeError, "config: expected a sweep config name"),
    (lambda: __import__("layersplit").sweep(""), ValueError, "sweep '': expected a config name"),
    (lambda: __import__("layersplit").plan_capacity(42), TypeError, "model: expected a model config name"),
    (lambda: __import__("layersplit").plan_capacity("glm-5", ["h200"]), TypeError, "hardware: expected"),
    (lambda: __import__("layersplit").plan_capacity("glm-5", "h200", weight_shards=10**6), ValueError,
     "weight_shards: expected <= 256"),
])
def test_api_names_the_argument_before_work(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert message in str(info.value)


def test_api_sweep_refuses_what_does_not_fit_before_writing(tmp_path, monkeypatch):
    import layersplit

    monkeypatch.setattr("layersplit.engine.prefill.available_memory_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr("layersplit.api.available_memory_bytes", lambda: 16 * 2**30)
    with pytest.raises(ValueError, match="the CP engine keeps glm-5's weights in fp32 .* use engine='model'"):
        layersplit.sweep("glm5-h200", engine="real", out=tmp_path / "out")
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LAYERSPLIT_KERNEL_BACKEND"):
        layersplit.sweep("glm5-h200", engine="model", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # no empty points.jsonl blocking a rerun


def test_a_check_that_checked_nothing_is_incomplete():
    from layersplit.gpu_check import report

    only_environment = {"sections": {"environment": {"status": "ok"}, "kernels": {"status": "skipped"}},
                        "skipped": [{"what": "kernels", "reason": "not selected (--sections)", "counts": False}]}
    assert report.verdict(only_environment) == "incomplete" and report.exit_code(only_environment) == 3
    nothing = {"sections": {"environment": {"status": "skipped"}}, "skipped": []}
    assert report.exit_code(nothing) == 3


def test_long_runs_say_how_long(capsys):
    """A long ``stress hicache`` says, once, about how long it will take (a short one says nothing)."""
    clock = iter([0.0, 6.0, 7.0])
    step = resources.eta_printer("stress hicache", 100_000, "layer loads", clock=lambda: next(clock))
    step(100)  # 100 loads in 6 s: 100,000 take about 100 min
    step(100)
    err = capsys.readouterr().err.splitlines()
    assert err == ["layersplit stress hicache: about 100 min for 100,000 layer loads (17 layer loads/s so far; "
                   "Ctrl-C stops it)"]
    clock = iter([0.0, 6.0])
    resources.eta_printer("stress hicache", 200, "layer loads", clock=lambda: next(clock))(190)
    assert capsys.readouterr().err == ""


def test_model_checker_reports_progress(monkeypatch, capsys):
    """A search says where it is (states, depth, elapsed) on stderr at a steady interval; stdout stays JSON."""
    monkeypatch.setattr(pd_check_cli, "PROGRESS_S", 0.0)
    assert pd_check_cli.main([*SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["complete"]
    lines = captured.err.splitlines()
    assert lines and all(line.startswith(f"{PD}: ") and " states, depth " in line and line.endswith(" s")
                         for line in lines)


def test_a_failed_save_prints_the_result_first(capsys):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    assert pd_check_cli.main([*SMALL, "--legacy-immediate-release", "--save", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert "counterexample:" in captured.out and "VIOLATION" in captured.out  # the search's result, printed
    assert captured.err.strip().splitlines() == [f"{PD}: error: --save: could not write '/dev/full': No space left on "
                                                 "device"]


def test_sglang_plan_without_sglang(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    assert app.main(["sglang-plan", "--sglang-args", "--tp 8", "--sm", "90"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "layersplit sglang-plan: error: sglang-plan needs SGLang: pip install '.[sglang]' (from a checkout) or pip "
        "install 'layersplit[sglang]'; got no sglang module here"]
    assert app.main(["sglang-plan", "--help"]) == 0
    assert "pip install '.[sglang]'" in " ".join(capsys.readouterr().out.split())


# as a user runs them: a fresh interpreter reads the environment, the rank processes would inherit it
SUBPROCESS = [
    ("cp-backend-mpi", ["-m", "layersplit", *PREFILL], {"LAYERSPLIT_CP_BACKEND": "mpi"}, 2,
     "layersplit prefill: error: LAYERSPLIT_CP_BACKEND: expected one of"),
    ("kernel-backend-sweep", ["-m", "layersplit", "sweep", "--engine", "model", "--out", "out"],
     {"LAYERSPLIT_KERNEL_BACKEND": "bogus"}, 2, "layersplit sweep: error: LAYERSPLIT_KERNEL_BACKEND"),
    ("sanitize-maybe", ["-m", "layersplit", "stress", "hicache", "--iterations", "1"], {"LAYERSPLIT_SANITIZE": "maybe"},
     2, "LAYERSPLIT_SANITIZE: expected"),
    ("save-dev-full", ["-m", "tools.pd_check", *SMALL, "--legacy-immediate-release", "--save", "/dev/full"], {}, 2,
     f"{PD}: error: --save: could not write '/dev/full'"),
]


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSPLIT_")}
    return env | {"PYTHONPATH": str(ROOT)} | extra


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", SUBPROCESS, ids=[c[0] for c in SUBPROCESS])
def test_bad_input_as_a_user_runs_it(case, tmp_path):
    name, argv, env, status, fragment = case
    proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=_env(env), capture_output=True, text=True,
                          timeout=100)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == status and lines and fragment in lines[0], proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="signals as on Linux")
def test_sigterm_during_a_search_is_one_line(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tools.pd_check", "--requests", "3", "--faults", "3"], cwd=tmp_path,
                            env=_env({}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(8)  # imported and searching (its first progress line comes at 10 s)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == f"{PD}: terminated", err
    assert "Traceback" not in err


@pytest.mark.parametrize("ranks,free,refused", [
    (3, [63, 64], "2 ranks share cuda:0, which has 63.0 MiB free"),  # ranks 0 and 2 on cuda:0 (rank % 2)
    (3, [96, 31], "one rank on cuda:1, which has 31.0 MiB free"),
    (3, [96, 64], None),
    (2, None, None),  # no CUDA: the ranks run on the CPU, host memory alone (api.check_fits) decides
], ids=["shared-device", "one-small-device", "fits", "no-cuda"])
def test_the_gpu_check_counts_the_ranks_each_device_holds(ranks, free, refused, monkeypatch):
    """Rank r runs on cuda:(r % devices), as rank_worker places it: a device's need is its ranks' bytes."""
    seen = []

    def free_bytes(asked: int):
        seen.append(asked)
        return None if free is None else [f * 2**20 for f in free]

    monkeypatch.setattr(resources, "gpu_free_bytes", free_bytes)
    check = lambda: resources.check_gpu_fits(ranks, 32 * 2**20, "weights", "use --engine model")  # noqa: E731
    if refused is None:
        check()
    else:
        with pytest.raises(ValueError) as info:
            check()
        assert str(info.value) == (f"each of {ranks} rank processes needs about 32.0 MiB on its GPU (weights); "
                                   f"{refused}; use --engine model")
    assert seen == [ranks]


def test_gpu_free_bytes_reads_each_device_the_ranks_use():
    """The seam itself: None without CUDA (no child started), else the free bytes of min(ranks, devices)
    devices, read in a child so this process holds no CUDA context."""
    initialized = torch.cuda.is_initialized()
    free = resources.gpu_free_bytes(3)
    if not CUDA:
        assert free is None
        return
    devices = min(3, torch.cuda.device_count())
    assert len(free) == devices
    assert all(0 < b <= torch.cuda.get_device_properties(d).total_memory for d, b in enumerate(free))
    assert torch.cuda.is_initialized() == initialized  # the probe made no context here
