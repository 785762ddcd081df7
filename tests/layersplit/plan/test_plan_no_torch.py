"""``layersplit plan`` is arithmetic: in a fresh interpreter it never imports torch (issue 29, item 4:
``dsa_kernels.layout`` holds its constants as plain numbers), for a YAML name and for a ``config.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

FIXTURE = Path(__file__).resolve().parent / "model_configs" / "GLM-5"

SCRIPT = """
import io, json, sys, time
from contextlib import redirect_stdout
start = time.perf_counter()
from layersplit.cli import main
buf = io.StringIO()
with redirect_stdout(buf):
    code = main(["plan", "--model", sys.argv[1], "--cp", "8", "--hardware", "h200", "--json"])
heavy = sorted(m for m in ("torch", "triton", "numpy", "matplotlib", "sglang") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy, "seconds": time.perf_counter() - start,
                  "tokens": json.loads(buf.getvalue())["tokens_per_rank_layersplit"]}))
"""


@pytest.mark.parametrize("model", ["glm-5", str(FIXTURE)], ids=["yaml-name", "config-json"])
def test_plan_imports_no_torch(model):
    run = subprocess.run([sys.executable, "-c", SCRIPT, model], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["code"] == 0 and result["tokens"] > 0
    assert result["heavy"] == [], f"plan imported {result['heavy']} ({result['seconds']:.2f} s)"


def test_layout_constants_need_no_torch():
    """``dsa_kernels.layout`` alone: sizes without torch; ``FP8_DTYPE`` still resolves (to torch's dtype)."""
    code = ("import sys, dsa_kernels.layout as L; assert L.mla_row_bytes(512, 64, 'fp8') == 656; "
            "assert L.index_page_bytes(128) == 8448; assert 'torch' not in sys.modules, 'torch'; "
            "import torch; assert L.FP8_DTYPE is torch.float8_e4m3fn")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
