"""What the plug-in will do on a prefill worker, from that worker's SGLang flags, before it starts.

:func:`resolve` runs SGLang's own argument parsing and resolution (``prepare_server_args`` +
``ServerArgs.resolve_once``: its parser, model hooks and cross-checks) on the flags, reads the model's
``config.json`` through SGLang's ``ModelConfig``, and makes the start-up :class:`~.startup.Plan` the
budget hook will make in the server: the landing, each fallback and why, the bytes allocated at
start-up, or the refusal. :func:`capacity` adds the KV tokens per rank next to upstream's layer split
and redundant CP for both KV dtypes, from ``layersplit plan``'s budget arithmetic (a model: HBM x
mem fraction - weights, not a measurement).
"""

from __future__ import annotations

import dataclasses
import shlex

from layersplit.sglang_plugin import startup

OUR_FLAGS = ("--layersplit", "--layersplit-spec-monitor")  # the plug-in's, not SGLang's parser's


def _server_args(flags: list[str], sm: tuple[int, int] | None):
    import torch
    from sglang.srt.server_args import prepare_server_args

    saved = torch.cuda.get_device_capability
    if sm is not None:  # resolve as on that GPU generation (SGLang picks kernels by it)
        torch.cuda.get_device_capability = lambda *a, **k: sm
    try:
        server_args = prepare_server_args([f for f in flags if f not in OUR_FLAGS])
        server_args.resolve_once()
    finally:
        torch.cuda.get_device_capability = saved
    return server_args


def _row_bytes(model_config, kv_dtype: str, prefill: str, decode: str) -> tuple[int, int]:
    """(latent KV row bytes, indexer page bytes per 64-token page) of SGLang's DSA pool layout on a CUDA
    prefill worker: fp8 is 512 e4m3 + 4 fp32 scales + 64 bf16 rope, except the raw 576-byte rows of
    ``trtllm`` and of TileLang on both sides (SGLang's ``calculate_mla_kv_cache_dim``, which the server's
    budget hook calls itself; it reads SGLang's published runtime context, which a CLI has not)."""
    from sglang.srt.configs.model_config import get_dsa_index_head_dim, get_dsa_index_kpool

    rope, rank = model_config.qk_rope_head_dim, model_config.kv_lora_rank
    raw = prefill == "trtllm" or (prefill == decode == "tilelang")
    if kv_dtype == "fp8":
        row = rank + rope if raw else rank + rank // 128 * 4 + rope * 2
    else:
        row = (rank + rope) * 2
    head, kpool = get_dsa_index_head_dim(model_config.hf_config), get_dsa_index_kpool(model_config.hf_config)
    return row, 64 // kpool * (head + head // 128 * 4)


def resolve(sglang_args: str | list[str], sm: tuple[int, int] | None = None, scratch_tokens: int | None = None) -> dict:
    """The start-up decision for these prefill-worker flags (a string as on the command line, or a list)."""
    from sglang.srt.configs.model_config import ModelConfig, get_dsa_index_kpool

    from lsconfig import envs

    flags = shlex.split(sglang_args) if isinstance(sglang_args, str) else list(sglang_args)
    server_args = _server_args(flags, sm)
    r = server_args.resolved_dict()
    if not r.get("enable_dsa_cache_layer_split"):
        raise ValueError("sglang-args: expected a prefill worker with --enable-dsa-cache-layer-split (the plug-in "
                         "replaces that pool), got flags without it")
    model = ModelConfig.from_server_args(server_args)
    kv_dtype = "fp8" if str(r["kv_cache_dtype"]).startswith("fp8") else "bf16"
    row, index_page = _row_bytes(model, kv_dtype, str(r["dsa_prefill_backend"]), str(r.get("dsa_decode_backend")))
    out = {"flags": flags, "dsa_prefill_backend": r["dsa_prefill_backend"], "kv_dtype": kv_dtype,
           "page_size": r["page_size"], "cp": r["attn_cp_size"], "context_len": model.context_len,
           "mem_fraction_static": r["mem_fraction_static"], "num_layers": model.num_hidden_layers}
    try:
        landing, reasons = startup.decide(
            prefill_impl=str(r["dsa_prefill_backend"]), graphs=startup.graphs_enabled(r.get("cuda_graph_config")),
            hisparse=bool(r.get("enable_hisparse")), index_kpool=get_dsa_index_kpool(model.hf_config),
            configured=envs.sglang_landing())
    except startup.StartupRefused as refused:
        return {**out, "refused": str(refused)}
    scratch = envs.sglang_scratch_tokens() if scratch_tokens is None else scratch_tokens
    plan = startup.Plan(landing=landing, reasons=reasons, page_size=r["page_size"], kv_row_bytes=row,
                        index_page_bytes=index_page,
                        slot_pages=startup.slot_pages(scratch, model.context_len, r["page_size"]))
    return {**out, "refused": None, "plan": plan, "landing": landing, "fallbacks": list(reasons),
            "slot_tokens": plan.slot_tokens, "staging_bytes": plan.staging_bytes,
            "remap_bytes_per_token": 1 if landing == "batch" else 0}


def capacity(view: dict, model_name: str, hardware: str) -> dict:
    """KV tokens per rank (model): the plug-in under its start-up plan, upstream's layer split and
    redundant CP, for bf16 and fp8 KV, in ``layersplit plan``'s budget."""
    from layersplit.plan.capacity import PlanRequest, capacity_plan
    from layersplit.plan.config import load_hardware, load_model

    model, hw = load_model(model_name), load_hardware(hardware)
    plan = view["plan"]
    rows = {}
    for dtype in ("bf16", "fp8"):
        got = capacity_plan(model, hw, PlanRequest(cp=view["cp"], kv_dtype=dtype, mem_fraction=view["mem_fraction_static"],
                                                   context_len=view["context_len"]))
        budget, owned = got["kv_budget_bytes_per_rank"], got["bytes_per_token_layersplit"]
        row = model.kv_bytes_per_token(dtype)
        staging = dataclasses.replace(plan, kv_row_bytes=row).staging_bytes  # the slots at this KV dtype
        per_token = owned + (1 if plan.landing == "batch" else row + model.index_bytes_per_token)
        rows[dtype] = {"plugin": int(max(0, budget - staging) // per_token), "staging_bytes": staging,
                       "upstream": got["tokens_per_rank_upstream_layersplit"],
                       "redundant": got["tokens_per_rank_redundant"], "budget_bytes": budget}
    return rows
