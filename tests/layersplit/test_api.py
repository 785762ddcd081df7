"""The public API: the README's example runs as written, and bad arguments fail before any work."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import layersplit

from tests.readme_blocks import readme_block


def _readme_example() -> str:
    return readme_block("python-api")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_readme_example_runs(capsys):
    code = _readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 6  # import + the 5-line example
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"LayerSplit holds \d+\.\d{3}x the tokens of redundant CP", out[0])
    m = re.fullmatch(r"([\d,]+) new tokens/s, max deviation (\S+)", out[1])
    assert m and float(m.group(2)) <= 1e-3


def _check_output(out: list[str]) -> None:
    assert re.fullmatch(r"LayerSplit holds \d+\.\d{3}x the tokens of redundant CP", out[0]), out
    m = re.fullmatch(r"([\d,]+) new tokens/s, max deviation (\S+)", out[1])
    assert m and float(m.group(2)) <= 1e-3, out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["file", "stdin"])
@pytest.mark.slow
def test_readme_example_as_a_user_runs_it(how, tmp_path):
    """In a fresh interpreter, from another folder: saved as a script (no ``__main__`` guard) and
    piped to ``python -``. The rank processes must not re-import the caller's ``__main__``."""
    code = _readme_example()
    if how == "file":
        script = tmp_path / "example.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=380)
    else:
        proc = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True,
                              timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert len(out) == 2, proc.stdout  # the script ran once: not again in each rank
    _check_output(out)


def test_version_and_exports():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*|0\+unknown", layersplit.__version__)
    for name in layersplit.__all__:
        assert getattr(layersplit, name) is not None
    with pytest.raises(AttributeError):
        layersplit.no_such_thing  # noqa: B018
    out = subprocess.run([sys.executable, "-m", "layersplit", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"layersplit {layersplit.__version__}"


def test_import_is_light():
    """``import layersplit`` (and the CLI's help) does not pull in torch."""
    code = "import sys, layersplit; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kwargs,message", [
    (dict(cp=16), "cp: expected <= 8"),
    (dict(cp=2, hit=1.0), "hit: expected a number in [0, 1)"),
    (dict(cp=2, seed=2**70), "seed: expected an integer in [0, 2**63 - 1]"),
    (dict(cp=2, mode="both"), "mode: expected one of"),
    (dict(cp=2, context_len=1), "context_len: expected an integer >= 2"),
])
def test_prefill_rejects_bad_arguments_before_work(kwargs, message):
    with pytest.raises(ValueError) as info:
        layersplit.prefill("tiny", **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("env,message,cpu_only", [
    ({"LAYERSPLIT_KERNEL_BACKEND": "fast"}, "LAYERSPLIT_KERNEL_BACKEND: expected one of", False),
    ({"LAYERSPLIT_SANITISE": "1"}, "LAYERSPLIT_SANITISE: expected one of the known variables", False),
    ({"LAYERSPLIT_SANITIZE": "maybe"}, "LAYERSPLIT_SANITIZE: expected 1/true/yes/on", False),
    ({"LAYERSPLIT_CP_BACKEND": "nccl"}, "LAYERSPLIT_CP_BACKEND: expected auto or gloo on a machine without CUDA", True),
    ({"LAYERSPLIT_KERNEL_BACKEND": "triton", "TRITON_INTERPRET": "0"},
     "LAYERSPLIT_KERNEL_BACKEND: 'triton' on a machine without CUDA needs", True),
], ids=["bad-value", "unknown-name", "bad-flag", "nccl-without-cuda", "triton-without-interpreter"])
def test_prefill_checks_the_environment_as_the_cli_does(env, message, cpu_only, monkeypatch):
    """The API runs the CLI's up-front check of the ``LAYERSPLIT_*`` variables (``lsconfig.envs``), before
    any process starts (the GPU-memory probe included). ``cpu_only``: what a machine with CUDA honours."""
    import torch

    if cpu_only and torch.cuda.is_available():
        pytest.skip("a machine with CUDA honours this")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", lambda *a, **k: pytest.fail("a rank process started"))
    monkeypatch.setattr("layersplit.engine.prefill.probe_gpus", lambda n: pytest.fail("the GPU probe started"))
    with pytest.raises(ValueError) as info:
        layersplit.prefill("tiny", cp=2, context_len=300)
    assert message in str(info.value)


def test_prefill_probes_the_gpus_once_for_both_device_checks(monkeypatch):
    """One child probe per call: the memory check and the kernel-capability check read the same facts (the
    memory fits here, so the sm86 refusal shows the capability came from that one probe)."""
    from layersplit.engine.prefill import GpuFacts

    calls = []

    def probe(devices: int) -> list[GpuFacts]:
        calls.append(devices)
        return [GpuFacts(2**40, 2**40, (8, 6))]

    monkeypatch.delenv("LAYERSPLIT_KERNEL_BACKEND", raising=False)  # auto: Triton on CUDA
    monkeypatch.setattr("layersplit.engine.prefill.probe_gpus", probe)
    monkeypatch.setattr("layersplit.engine.prefill.available_memory_bytes", lambda: 2**40)
    monkeypatch.setattr("layersplit.engine.launcher.run_cp", lambda *a, **k: pytest.fail("a rank process started"))
    with pytest.raises(ValueError, match=r"^LAYERSPLIT_KERNEL_BACKEND: .* got sm86 on cuda:0; set "
                                         r"LAYERSPLIT_KERNEL_BACKEND=torch"):
        layersplit.prefill("tiny", cp=2, context_len=300)
    assert calls == [1]


def test_prefill_rejects_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match=r"the engine keeps fp32 weights .* GiB available"):
        layersplit.prefill("glm-5", cp=2)


def test_plan_capacity_options_checked():
    plan = layersplit.plan_capacity("glm-5", "h200", cp=8)
    assert plan["capacity_ratio"] > plan["capacity_ratio_upstream"] > 1
    with pytest.raises(TypeError, match="unexpected option"):
        layersplit.plan_capacity("glm-5", "h200", cp=8, kv_type="bf16")
