"""The cost model against published prefill figures (MODELLED vs published). Each row prices the
published configuration with :class:`layersplit.serving.roofline.Roofline` at the default
efficiencies, twice where EP traffic matters: exposed, and hidden by two-batch overlap (both
publications overlap it with dual micro-batches); the error is the model's over the published figure.

What each configuration assumes is in its ``setup`` text: where a publication does not state a
detail the model needs (prompts per batch, average prompt length), the assumption is named there.
DeepSeek-V3 is DeepSeek-V3.2's config without the indexer (V3.2 is V3 plus the lightning indexer).
The H100 is the H800 config with NVLink at 450 GB/s per direction (NVIDIA's H100 SXM datasheet:
900 GB/s bidirectional; H800 and H100 SXM have the same compute and HBM).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from layersplit.plan.config import IndexerLayers, load_hardware, load_model
from layersplit.serving.roofline import Efficiency, Roofline

DEEPEP_EP32_RDMA = 58e9  # DeepEP README (normal kernels, H800 + CX7 400 Gb/s): internode EP32 dispatch, B/s


@dataclass(frozen=True)
class Published:
    label: str
    figure: float
    unit: str
    source: str
    setup: str


def _deepseek_v3():
    return replace(load_model("deepseek-v3.2"), name="deepseek-v3", indexer_layers=IndexerLayers(0, 0, 0))


def _h100():
    return replace(load_hardware("h800"), name="h100", nvlink_bandwidth=4.5e11)


def _tokens_per_gpu_s(model, hw, prompt: int, hit: float, per_batch: int, ep: int, eff: Efficiency) -> float:
    """Input tokens (cached prefix included) per GPU-second: DP attention (each GPU its own batch of
    ``per_batch`` prompts), routed experts over ``ep`` GPUs, EP traffic at DeepEP's EP32 rate."""
    prefix = round(prompt * hit)
    reqs = [(prefix, prompt - prefix)] * per_batch
    eff = replace(eff, ep_bandwidth=DEEPEP_EP32_RDMA)
    layers = Roofline(model, hw, "bf16", eff).layers(reqs, ranks=1, ep_ranks=ep, allgather_new=False)
    seconds = sum(x.pre + x.indexer + x.attention + x.mlp for x in layers)
    return prompt * per_batch / seconds


def _sparse_tflops(heads: int, eff: Efficiency) -> float:
    """FlashMLA's sparse prefill benchmark shape on H800: top-k 2048 of a long context, d_qk 576, bf16."""
    model = replace(_deepseek_v3(), num_heads=heads)
    roof = Roofline(model, load_hardware("h800"), "bf16", eff)
    reqs = [(1 << 16, 4096)]
    attn = roof.layers(reqs, ranks=1, allgather_new=False)[0].attention
    flops = 2 * heads * (2 * model.kv_lora_rank + model.qk_rope_head_dim) * model.index_topk * 4096
    return flops / attn / 1e12


def rows(eff: Efficiency = Efficiency()) -> list[dict]:
    """One dict per published figure: published, model (EP exposed), model (EP hidden), errors."""
    v3, h100, h800 = _deepseek_v3(), _h100(), load_hardware("h800")
    hidden = replace(eff, ep_hidden=1.0)
    cases = [
        (Published("SGLang large-scale EP, 2k prompts", 52.3e3 / 8, "input tok/s per GPU",
                   "lmsys.org/blog/2025-05-05-large-scale-ep: 52.3k input tokens/s per node (8 x H100)",
                   "DeepSeek-V3, H100, 2,000-token prompts, no prefix; EP32 over 4 nodes, DP attention; "
                   "assumed: 8 prompts per GPU batch"),
         lambda e: _tokens_per_gpu_s(v3, h100, 2000, 0.0, 8, 32, e)),
        (Published("SGLang large-scale EP, 4k prompts", 50302 / 8, "input tok/s per GPU",
                   "same blog, 4 nodes EP32: 50,302 tokens/s per node for 4K prompts",
                   "DeepSeek-V3, H100, 4,096-token prompts, no prefix, EP32; assumed: 4 prompts per GPU batch"),
         lambda e: _tokens_per_gpu_s(v3, h100, 4096, 0.0, 4, 32, e)),
        (Published("DeepSeek production prefill", 73.7e3 / 8, "input tok/s per GPU (cache hits incl.)",
                   "deepseek-ai/open-infra-index, day 6 inference-system overview: ~73.7k tokens/s input "
                   "(including cache hits) per H800 node, 56.3% of input tokens hit the KV cache",
                   "DeepSeek-V3, H800, EP32 prefill; a 24-hour average under varying load; assumed: "
                   "4,096-token prompts, 56.3% cached, 4 prompts per GPU batch"),
         lambda e: _tokens_per_gpu_s(v3, h800, 4096, 0.563, 4, 32, e)),
        (Published("FlashMLA sparse prefill, 128 heads", 640, "TFLOP/s",
                   "deepseek-ai/FlashMLA README: sparse MLA prefill up to 640 TFLOP/s on H800 SXM5",
                   "h_q 128, d_qk 576, top-k 2048, bf16 (the efficiency e_attn = 640/989 is fit to this row)"),
         lambda e: _sparse_tflops(128, e)),
        (Published("FlashMLA sparse prefill, 64 heads", float("nan"), "TFLOP/s",
                   "not found: FlashMLA's README gives no 64-head figure",
                   "h_q 64 (GLM-5), otherwise as above: the roofline's gather bound"),
         lambda e: _sparse_tflops(64, e)),
    ]
    out = []
    for pub, model_of in cases:
        exposed, overlapped = model_of(eff), model_of(hidden)
        err = lambda x: 100 * (x / pub.figure - 1) if pub.figure == pub.figure else None  # noqa: E731 (nan: none)
        out.append({"label": pub.label, "published": pub.figure, "unit": pub.unit, "source": pub.source,
                    "setup": pub.setup, "model_ep_exposed": exposed, "model_ep_hidden": overlapped,
                    "error_ep_exposed_pct": err(exposed), "error_ep_hidden_pct": err(overlapped)})
    return out


def table(eff: Efficiency = Efficiency()) -> str:
    def pct(x):
        return "-" if x is None else f"{x:+.0f}%"

    lines = ["Calibration (**model** vs published): the cost model's roofline on each published configuration; "
             "`model` with EP dispatch/combine exposed, then hidden (two-batch overlap).", "",
             "| published figure | value | configuration | model | model, EP hidden | error | error, EP hidden | source |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows(eff):
        value = "not found" if r["published"] != r["published"] else f"{r['published']:,.0f} {r['unit']}"
        lines.append(f"| {r['label']} | {value} | {r['setup']} | {r['model_ep_exposed']:,.0f} "
                     f"| {r['model_ep_hidden']:,.0f} | {pct(r['error_ep_exposed_pct'])} "
                     f"| {pct(r['error_ep_hidden_pct'])} | {r['source']} |")
    return "\n".join(lines) + "\n"
