"""``layersplit prefill``: ``--timeout-s`` (checked at parse time, passed through, named when it fires), a
report whose every count says whether it is per run or per rank (text and JSON, ``new_tokens_per_s`` and
``request_tokens_per_s``), and the device refusals (GPU memory; a capability below sm89 where Triton's e4m3
kernels would run), driven on a CPU through their one seam (``layersplit.engine.prefill.probe_gpus``, which
returns each device's free and total bytes and capability, read once per prefill call)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest

import layersplit
from layersplit.cli import prefill_cmd
from layersplit.cli.app import main
from layersplit.engine import prefill as engine_prefill
from layersplit.plan.config import load_model
from layersplit.plan.modes import scratch_pages_for

TINY = load_model("tiny")
PREFILL = ["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "300", "--hit", "0.5"]


def _no_spawn(*args, **kwargs):
    raise AssertionError("a rank process was started")


def _rank_workers() -> list[int]:
    """This process's children that run a CP rank (Linux ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"layersplit.engine.rank_worker" in cmd:
            found.append(int(stat.parent.name))
    return found


# --timeout-s --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e9", "ten"])
def test_timeout_s_checked_at_parse_time(value, capsys, monkeypatch):
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", _no_spawn)
    assert main([*PREFILL, "--timeout-s", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("layersplit prefill: error: argument --timeout-s: expected a number in (0, 604800], got")


@pytest.mark.parametrize("value,message", [(0, "timeout_s: expected a number of seconds in (0, 604800], got 0"),
                                           (float("nan"), "got nan"), (float("inf"), "got inf"), (True, "got True"),
                                           ("600", "got '600'")])
def test_api_timeout_s_checked_before_work(value, message, monkeypatch):
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", _no_spawn)
    with pytest.raises(ValueError) as info:
        layersplit.prefill("tiny", cp=2, context_len=300, timeout_s=value)
    assert message in str(info.value)


@pytest.mark.timeout(120)
def test_timeout_fires_naming_the_flag_and_ends_the_ranks(capsys):
    """0.3 s: the rank processes have not even imported torch. One line naming the flag, exit 1, no rank left."""
    assert main([*PREFILL, "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "layersplit prefill: error: --timeout-s: the 2 rank process(es) gave no result within 0.3 s (they were ended); "
        "raise it"), err
    assert _rank_workers() == []


def test_timeout_s_reaches_the_library(capsys, monkeypatch):
    seen = []

    def fake(model, **kwargs):  # stops the run right after the CLI handed its arguments over
        seen.append(kwargs["timeout_s"])
        raise ValueError("stop")

    monkeypatch.setattr(engine_prefill, "prefill", fake)
    assert main(PREFILL) == 2 and main([*PREFILL, "--timeout-s", "1234.5"]) == 2
    assert seen == [600.0, 1234.5]


# the report: per run or per rank --------------------------------------------------------------------

@lru_cache(maxsize=None)
def _report():
    return layersplit.prefill("tiny", cp=2, mode="layersplit", context_len=300, hit=0.5, requests=2)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_json_report_names_the_scope_of_every_count():
    report = _report().as_dict()
    assert "tokens_per_s" not in report  # renamed: one name per quantity
    assert report["new_tokens_per_s"] * report["prefill_seconds"] == pytest.approx(report["new_tokens"])
    assert report["request_tokens_per_s"] * report["prefill_seconds"] == pytest.approx(2 * 300)  # prefix included
    counts = [k for k in report if re.search(r"(_per_rank|_per_layer|_per_s|_seconds|_deviation_vs_\w+|new_tokens|"
                                             r"indexer_waits_for_kv_bcast)$", k)]
    assert len(counts) >= 12 and set(counts) <= set(report["count_scope"]), set(counts) - set(report["count_scope"])
    assert all(s.startswith(("per run", "per rank", "rank 0")) for s in report["count_scope"].values())
    assert report["allgather_bytes_per_layer"] and report["bcast_bytes_per_layer"]
    json.dumps(report)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_text_report_says_per_run_or_per_rank(capsys, monkeypatch):
    report = _report()
    monkeypatch.setattr(engine_prefill, "prefill", lambda model, **kwargs: report)
    assert main(PREFILL) == 0
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.splitlines())
    d = report.as_dict()
    assert rows["throughput (measured)"] == (f"{d['new_tokens_per_s']:,.0f} new tokens/s, "
                                             f"{d['request_tokens_per_s']:,.0f} request tokens/s (per run)")
    settings = {"model / CP / mode", "KV cache dtype", "kernels / schedule"}
    for key, value in rows.items():
        if key not in settings:
            assert re.search(r"per run|per rank|rank 0", f"{key} {value}"), f"{key}: {value}"
    assert rows["all-gather per layer (rank 0)"].endswith("the rest indexer keys")


# GPU memory, through its seam ------------------------------------------------------------------------

def _gpu_need(context_len: int, cp: int = 2) -> int:
    """What one GPU must hold for ``cp`` layersplit ranks on it: their weights and caches, or afterwards the
    reference's (every layer), whichever is more."""
    pages = -(-context_len // 64)
    weights = engine_prefill.weight_bytes(TINY)
    rank = weights + engine_prefill.rank_cache_bytes(TINY, cp=cp, mode="layersplit", ownership="contiguous",
                                                     pool_pages=pages, scratch_pages=scratch_pages_for(context_len, 1))
    return max(cp * rank, weights + engine_prefill.cache_bytes(TINY, pages))


@pytest.fixture
def gpu(monkeypatch):
    """One GPU whose free bytes (``free[0]``) and capability (``cap[0]``, sm90 unless set) the test sets; the
    host has plenty; nothing may be spawned. ``asked``: the device count of each probe (one per prefill call)."""
    free, asked, cap = [0], [], [(9, 0)]

    def probe(devices: int) -> list[engine_prefill.GpuFacts]:
        asked.append(devices)
        return [engine_prefill.GpuFacts(free[0], 80 * 2**30, cap[0])]

    monkeypatch.setattr(engine_prefill, "probe_gpus", probe)
    monkeypatch.setattr(engine_prefill, "available_memory_bytes", lambda: 2**40)
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", _no_spawn)
    return free, asked, cap


def test_gpu_refusal_names_the_largest_context_that_fits(gpu, capsys):
    free, asked, _ = gpu
    free[0] = _gpu_need(4096)  # 4,096 tokens fit exactly; 4,097 need a 65th page
    assert _gpu_need(4097) > free[0]
    assert main(["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "65536"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "layersplit prefill: error: --context-len: expected <= 4,096 on this GPU, got 65,536: cuda:0 has "), err
    assert "2 rank process(es)" in err[0] and asked == [1]
    with pytest.raises(ValueError, match=r"^context_len: expected <= 4,096 on this GPU, got 65,536"):
        layersplit.prefill("tiny", cp=2, mode="layersplit", context_len=65536)
    assert asked == [1, 1]  # one probe per prefill call


def test_gpu_refusal_names_the_model_when_no_context_fits(gpu, capsys):
    gpu[0][0] = engine_prefill.weight_bytes(TINY)  # the weights alone, nothing for a cache
    assert main(["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "4096"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("layersplit prefill: error: --model: 'tiny' does not fit any context"), err


def test_gpu_that_fits_lets_the_run_start(gpu):
    gpu[0][0] = _gpu_need(4096)
    with pytest.raises(AssertionError, match="a rank process was started"):
        layersplit.prefill("tiny", cp=2, mode="layersplit", context_len=4096)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("cap,backend,refused", [
    ((8, 6), "auto", True), ((8, 0), "triton", True), ((8, 6), "torch", False), ((8, 9), "auto", False),
    ((9, 0), "auto", False), ((10, 0), "triton", False),
], ids=["sm86", "sm80-triton", "sm86-torch-kernels", "sm89", "sm90", "sm100"])
def test_e4m3_kernels_below_sm89_refused_before_any_rank_starts(gpu, cap, backend, refused, kv_dtype, monkeypatch,
                                                                capsys):
    """On CUDA the engine's Triton kernels use e4m3 (the index keys in every KV dtype, the MLA cache too at
    fp8), which does not compile below sm89: refused in the parent, from the one probe's capability, not at
    the first index-key quantize inside the ranks. The torch reference kernels run anywhere."""
    free, asked, caps = gpu
    free[0], caps[0] = 80 * 2**30, cap
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    monkeypatch.setattr("lsconfig.envs.check_machine", lambda cuda: None)  # "triton" on a CPU host: a GPU is faked
    argv = ["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "64", "--kv-dtype", kv_dtype]
    if refused:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        ops = "quantize_index_keys, dequantize_index_keys, indexer_scores" + (
            ", pack_mla_kv, unpack_mla_kv, sparse_mla_prefill" if kv_dtype == "fp8" else "")
        need = "index keys are e4m3 in every KV dtype" + (", and so is the fp8 MLA cache" if kv_dtype == "fp8" else "")
        assert err == [f"layersplit prefill: error: LAYERSPLIT_KERNEL_BACKEND: {backend} picks Triton for {ops} "
                       f"({need}), whose e4m3 needs sm89+ (Ada/Hopper/Blackwell), got sm{cap[0]}{cap[1]} on cuda:0; "
                       "set LAYERSPLIT_KERNEL_BACKEND=torch to run the torch reference kernels (--kv-dtype bf16 alone "
                       "does not avoid e4m3)"], err
    else:
        with pytest.raises(AssertionError, match="rank process was started"):  # past every check: the launch is next
            main(argv)
    assert asked == [1]  # one child probe for the memory and the capability checks together


def test_kernel_device_check_reads_only_the_facts_it_is_given():
    """No facts (no CUDA, or the probe failed): nothing to refuse; sm89+ devices pass; the first device
    below sm89 is named."""
    sm90, sm86 = engine_prefill.GpuFacts(1, 2, (9, 0)), engine_prefill.GpuFacts(1, 2, (8, 6))
    engine_prefill.check_kernel_devices(None, "fp8")
    engine_prefill.check_kernel_devices([sm90, sm90], "fp8")
    with pytest.raises(ValueError, match=r"got sm86 on cuda:1;"):
        engine_prefill.check_kernel_devices([sm90, sm86], "bf16")


# the probe itself (every other test replaces it whole) -------------------------------------------

def test_probe_parses_the_childs_last_line(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)

    def fake_run(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 0, stdout="a warning\n[[100, 200, 9, 0]]\n", stderr="")

    monkeypatch.setattr(engine_prefill.subprocess, "run", fake_run)
    assert engine_prefill.probe_gpus(1) == [engine_prefill.GpuFacts(100, 200, (9, 0))]
    assert engine_prefill.gpu_memory_bytes(1) == [(100, 200)]
    engine_prefill.check_kernel_devices(engine_prefill.probe_gpus(1), "fp8")  # sm90: no refusal


def test_a_failed_probe_says_the_checks_are_off(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)

    def boom(argv, **kwargs):
        raise subprocess.CalledProcessError(1, argv, "", "RuntimeError: CUDA error")

    monkeypatch.setattr(engine_prefill.subprocess, "run", boom)
    assert engine_prefill.probe_gpus(1) is None
    assert "GPU memory and compute capability are not checked" in capsys.readouterr().err


def test_the_probe_script_reads_every_device():
    """The child's script, run against a stand-in torch module: one row per device, capability included."""
    fake = textwrap.dedent("""
        import sys, types
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(mem_get_info=lambda d: (1 + d, 2 + d), get_device_capability=lambda d: (9, 0))
        sys.modules["torch"] = torch
    """)
    out = subprocess.run([sys.executable, "-c", fake + engine_prefill._GPU_PROBE, "2"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == [[1, 2, 9, 0], [2, 3, 9, 0]]
