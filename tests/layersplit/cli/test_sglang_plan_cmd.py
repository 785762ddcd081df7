"""``layersplit sglang-plan``: a prefill worker's flags, resolved by SGLang 0.5.23's own parsing, give the
plug-in's start-up plan (landing, fallbacks, bytes) or its refusal, and the capacity next to upstream's.
GLM-5 ``config.json`` (no weights), resolved as on an H200 (``--sm 90``)."""

from __future__ import annotations

import json
import os

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.cli.app import main  # noqa: E402
from tests.layersplit.sglang_plugin.test_cmdline import TEST_ONLY, glm5_config_dir, readme_command  # noqa: E402


def _flags(tmp_path, extra: list[str]) -> str:
    args = readme_command()
    args[args.index("--model-path") + 1] = str(glm5_config_dir(tmp_path))
    return " ".join(args + TEST_ONLY + extra)


def _run(capsys, tmp_path, extra, *more) -> tuple[int, dict]:
    rc = main(["sglang-plan", "--sglang-args", _flags(tmp_path, extra), "--sm", "90", "--json", *more])
    return rc, json.loads(capsys.readouterr().out)


def test_readme_worker_reads_through_remapped_tables_with_capacity(tmp_path, capsys):
    rc, out = _run(capsys, tmp_path, [], "--model", "glm-5", "--hardware", "h200")
    assert rc == 0 and out["landing"] == "batch" and out["fallbacks"] == []
    assert out["dsa_prefill_backend"] == "flashmla_sparse" and out["context_len"] == 202752
    assert out["slot_tokens"] == 202752 + 64  # one whole context per slot
    assert out["staging_bytes"] == 2 * (202752 // 64 + 1) * (64 * 1152 + 64 * 132)
    cap = out["capacity_model"]
    for dtype in ("bf16", "fp8"):
        assert cap[dtype]["plugin"] > cap[dtype]["upstream"] > cap[dtype]["redundant"] > 0, cap


def test_trtllm_keeps_upstreams_landing_counted(tmp_path, capsys):
    rc, out = _run(capsys, tmp_path, ["--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "trtllm"])
    assert rc == 0 and out["landing"] == "pool"
    assert any("--dsa-prefill-backend trtllm" in r for r in out["fallbacks"])
    assert out["staging_bytes"] == 2 * (202752 // 64 + 1) * (64 * 576 + 64 * 132)  # trtllm's raw fp8 rows


def test_hisparse_is_refused_before_start(tmp_path, capsys):
    rc, out = _run(capsys, tmp_path, ["--enable-hisparse"])
    assert rc == 2 and "--enable-hisparse is refused" in out["refused"]


def _readme_sglang_plan() -> list[str]:
    """The README's ``layersplit sglang-plan`` command as argv: its ``sglang-plan`` block (by marker), or until
    that marker is in the README, the bash block that starts with the command. An optional part the README
    writes in brackets (``[--sm 90]``) is left out: the command must run without it, on a machine without a GPU."""
    import re
    import shlex

    from tests.readme_blocks import README, readme_block

    try:
        text = readme_block("sglang-plan")
    except LookupError:
        text = re.search(r"^```bash\n(layersplit sglang-plan .*?)^```", README.read_text(), re.M | re.S).group(1)
    text = re.sub(r"\s*\[[^\]]*\]", "", re.sub(r"\\\n", " ", text)).strip()
    argv = shlex.split(text)
    assert argv[:2] == ["layersplit", "sglang-plan"], argv
    return argv[1:]


def test_readme_command_runs_as_shown_without_a_gpu(tmp_path, capsys):
    """The README's command, with only its model folder replaced by a GLM-5 ``config.json`` (no weights): a
    capacity planner that runs on a CPU-only laptop (SGLang's own device resolution would ask this machine for
    an accelerator), printing the plan and the capacity the README quotes."""
    argv = _readme_sglang_plan()
    i = argv.index("--sglang-args") + 1
    flags = argv[i].split()
    flags[flags.index("--model-path") + 1] = str(glm5_config_dir(tmp_path))
    argv[i] = " ".join(flags)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "flashmla_sparse" in out and "landing                   batch" in out and "fallback                none" in out
    assert "2 staging slots x 202,816 tokens = 0.485 GiB" in out
    for numbers in ("plug-in 2,191,043  upstream split 2,028,888  redundant CP 286,125",
                    "plug-in 3,595,531  upstream split 3,305,955  redundant CP 466,224"):  # the README's bf16, fp8
        assert numbers in out, out
