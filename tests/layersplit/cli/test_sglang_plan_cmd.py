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
