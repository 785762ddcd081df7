"""The README's prefill-worker command line goes through SGLang 0.5.23's own server-argument
resolution and validation (``prepare_server_args`` + ``ServerArgs.resolve_once``: its parser, model
hooks and cross-checks) on a GLM-5 ``config.json`` (no weights), with the plug-in registered.

Test-only additions, because this machine has no GPU and no tokenizer files: ``--device cuda``,
``--skip-tokenizer-init``, and ``torch.cuda.get_device_capability`` answering (9, 0) (H200, SM90).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.plan.config import load_model  # noqa: E402
from layersplit.sglang_plugin import landing, register, unregister  # noqa: E402

from tests.readme_blocks import readme_block  # noqa: E402
TEST_ONLY = ["--device", "cuda", "--skip-tokenizer-init"]


def readme_command() -> list[str]:
    """The arguments of the ``python -m sglang.launch_server`` line of the README's ``sglang-launch`` block."""
    text = re.sub(r"\\\n", " ", readme_block("sglang-launch"))  # continuation lines
    line = next(ln for ln in text.splitlines() if "sglang.launch_server" in ln)
    args = shlex.split(line.split("#", 1)[0])
    return args[args.index("sglang.launch_server") + 1:]


def glm5_config_dir(tmp_path: Path) -> Path:
    """A GLM-5 ``config.json`` (Hugging Face's ``GlmMoeDsaConfig``) from configs/models/glm-5.yaml."""
    from transformers import GlmMoeDsaConfig

    m = load_model("glm-5")
    cfg = GlmMoeDsaConfig(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim, index_n_heads=m.index_n_heads,
        index_head_dim=m.index_head_dim, index_topk=m.index_topk, n_routed_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok, n_shared_experts=m.n_shared_experts,
        first_k_dense_replace=m.first_k_dense, moe_intermediate_size=m.moe_intermediate_size,
        intermediate_size=m.intermediate_size, vocab_size=m.vocab_size)
    data = cfg.to_dict()
    data["architectures"] = ["GlmMoeDsaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def resolve(args: list[str], model_dir: Path, monkeypatch) -> dict:
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    i = args.index("--model-path")
    argv = args[:i + 1] + [str(model_dir)] + args[i + 2:] + TEST_ONLY
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args.resolved_dict()


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SGLANG_PLUGIN", "0")  # restored (unset) afterwards; the flag sets it to 1
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server", *readme_command()])
    try:
        assert register()  # --layersplit on the command line turns it on
        yield
    finally:
        unregister()


@pytest.mark.parametrize("kv", [[], ["--kv-cache-dtype", "fp8_e4m3"]], ids=["bf16", "fp8"])
def test_readme_command_passes_sglangs_validation(tmp_path, monkeypatch, plugin, kv):
    args = readme_command()
    assert "--layersplit" in args and "--model-path" in args
    resolved = resolve(args + kv, glm5_config_dir(tmp_path), monkeypatch)
    assert resolved["enable_dsa_cache_layer_split"] and resolved["enable_prefill_cp"]
    assert resolved["cp_strategy"] == "interleave" and resolved["attn_cp_size"] == 8
    assert resolved["disaggregation_mode"] == "prefill" and os.environ["LAYERSPLIT_SGLANG_PLUGIN"] == "1"
    # the DSA prefill kernel SGLang picks on SM90 reads through the plug-in's remapped tables
    assert resolved["dsa_prefill_backend"] == ("flashmla_kv" if kv else "flashmla_sparse")
    assert resolved["dsa_prefill_backend"] in landing.COVERED_IMPLS


def test_the_previous_readme_command_is_refused(tmp_path, monkeypatch, plugin):
    """The line the README used to give (no ``--cp-strategy interleave``, no mooncake): SGLang's
    validation refuses it, so the test above can fail."""
    previous = ["--model-path", "zai-org/GLM-5", "--disaggregation-mode", "prefill", "--tp-size", "8",
                "--enable-prefill-cp", "--attn-cp-size", "8", "--enable-dsa-cache-layer-split",
                "--enable-hierarchical-cache", "--layersplit"]
    with pytest.raises(ValueError, match="requires --enable-prefill-cp and --cp-strategy interleave"):
        resolve(previous, glm5_config_dir(tmp_path), monkeypatch)
