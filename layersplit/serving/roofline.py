"""Per-layer compute times of one prefill batch (MODELLED): the part of the cost model that does not
depend on where the cache lives. Used by :mod:`.cost_model` (every serving mode) and by
:mod:`.calibration` (the published configurations).

Per layer and rank, with the batch's new tokens split evenly over the ``ranks`` attention ranks and
the routed experts over ``ep_ranks`` GPUs:

* projections + MLP/MoE: ``2 * active_params(l) * tokens / ranks`` FLOPs at fp8 peak x GEMM efficiency
  ``e_max * m / (m + m_half)``, ``m`` = rows per expert GEMM (small batches under-fill experts);
* CP all-gather of the new tokens' cache rows (``(ranks - 1) / ranks`` of them arrive at each rank);
* lightning indexer: ``2 * H_I * D * sum_i new_i * (prefix_i + new_i / 2) / ranks`` FLOPs (causal) at
  fp8 peak x ``e_indexer``, plus its logits: ``logits_bytes`` (fp32, written once and read once by the
  top-k) per (query, context token) pair at HBM bandwidth x ``e_hbm``;
* sparse MLA, a roofline: ``2 * H * min(top-k, ctx) * (L + R + L)`` FLOPs per new token (``ctx`` the
  causal context, averaged over the request's new tokens) at bf16 peak x
  ``e_attn``, or, if slower, the gather of ``min(top-k, ctx)`` cache rows per new token at HBM
  bandwidth x ``e_hbm`` (64 heads share each gathered latent row: GLM-5 runs at 121 FLOP/B at bf16 KV,
  below the H200's ridge of 206, so it is gather-bound; 128 heads at 242 FLOP/B are not);
* EP dispatch + combine on MoE layers: each token goes once to every other GPU of its node (across
  nodes: every other node) that holds one of its top-k experts (``(G - 1) * (1 - (1 - 1/E)^k)`` with
  uniform routing over ``E`` ranks, ``G`` of them in the node), fp8 hidden + scales out and bf16
  hidden back, at the NVLink rate (across nodes: ``ep_bandwidth``), less the share ``ep_hidden`` that
  two-batch overlap hides. Norms, rope and activation functions are not modelled.

Sources (efficiencies): GEMM ``e_max`` 0.78 — DeepGEMM's README reports up to ~1550 fp8 TFLOP/s on
H800 (peak 1979); ``e_attn`` = 640 / 989 — FlashMLA's README: sparse prefill up to 640 TFLOP/s on H800
(its test runs 128 heads); ``e_hbm`` = 3000 / 3350 — FlashMLA's README: dense decoding up to 3000 GB/s
memory-bound on H800 (3.35 TB/s); NVLink 380 / 450 — DESIGN.md section 2. Assumed (no public figure at
hand): ``m_half`` = 128 rows, ``e_indexer`` = 0.5, ``logits_bytes`` = 8, ``ep_hidden`` = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from layersplit.plan.capacity import NVLINK_EFFICIENCY
from layersplit.plan.config import HardwareConfig, ModelConfig


@dataclass(frozen=True)
class Efficiency:
    gemm_max: float = 0.78
    gemm_half_rows: int = 128
    indexer: float = 0.5
    attention: float = 640 / 989
    hbm: float = 3000 / 3350
    nvlink: float = NVLINK_EFFICIENCY
    ep_hidden: float = 0.0  # share of EP dispatch/combine hidden under compute (two-batch overlap)
    logits_bytes: int = 8  # indexer logits per (query, context token): fp32 written + read
    ep_bandwidth: float = 0.0  # bytes/s per GPU for EP traffic between nodes (RDMA); 0: the NVLink rate


@dataclass(frozen=True)
class LayerTime:
    pre: float  # projections + CP all-gather of the new rows
    indexer: float  # 0 on layers without an indexer
    attention: float
    mlp: float  # MLP/MoE GEMMs + exposed EP dispatch/combine


class Roofline:
    """Per-layer constants of ``model`` on ``hw``, computed once (``has_indexer`` rebuilds a set per call)."""

    def __init__(self, model: ModelConfig, hw: HardwareConfig, kv_dtype: str, eff: Efficiency = Efficiency()) -> None:
        self.m, self.hw, self.eff = model, hw, eff
        layers = range(model.num_layers)
        self.indexer = [model.has_indexer(layer) for layer in layers]
        self.attn_params = [model.attention_params(layer) for layer in layers]
        self.mlp_params = [model.mlp_params(layer, active=True) for layer in layers]
        self.per_layer = [model.layer_bytes_per_token(layer, kv_dtype) for layer in layers]
        self.kv_bytes = model.kv_bytes_per_token(kv_dtype)
        self.nvlink = hw.nvlink_bandwidth * eff.nvlink

    def gemm_s(self, flops: float, rows: float) -> float:
        e = self.eff.gemm_max * rows / (rows + self.eff.gemm_half_rows)
        return flops / (self.hw.dense_flops_fp8 * e) if flops else 0.0

    def ep_s(self, tokens: float, ep_ranks: int) -> float:
        """Exposed dispatch + combine of ``tokens`` (this rank's) over ``ep_ranks`` GPUs: within a node
        each token goes once to every other GPU its top-k experts live on, over NVLink; across nodes
        (``ep_ranks`` above the node's GPUs) once to every other node they live on, at ``ep_bandwidth``
        (DeepEP forwards inside the node over NVLink); the slower of the two, uniform routing."""
        if ep_ranks <= 1:
            return 0.0
        m, k = self.m, self.m.num_experts_per_tok
        per_token = m.hidden_size + m.hidden_size // 128 * 4 + 2 * m.hidden_size  # fp8 + scales out, bf16 back
        gpus = min(ep_ranks, self.hw.gpus_per_node)
        intra = (gpus - 1) * (1 - (1 - 1 / ep_ranks) ** k) * per_token / self.nvlink
        nodes = -(-ep_ranks // self.hw.gpus_per_node)
        inter = 0.0
        if nodes > 1:
            inter = (nodes - 1) * (1 - (1 - 1 / nodes) ** k) * per_token / (self.eff.ep_bandwidth or self.nvlink)
        return tokens * max(intra, inter) * (1 - self.eff.ep_hidden)

    def layers(self, reqs: list[tuple[int, int]], ranks: int, ep_ranks: int | None = None,
               allgather_new: bool = True) -> list[LayerTime]:
        """``reqs``: (context before the new tokens, new tokens) per request; ``ranks`` share them."""
        m, hw, eff = self.m, self.hw, self.eff
        ep_ranks = ranks if ep_ranks is None else ep_ranks
        new = sum(n for _, n in reqs)
        local = new / ranks
        pairs = sum(n * (p + n / 2) for p, n in reqs) / ranks  # causal (query, context) pairs on a rank
        indexer_s = (2 * m.index_n_heads * m.index_head_dim * pairs / (hw.dense_flops_fp8 * eff.indexer)
                     + pairs * eff.logits_bytes / (hw.hbm_bandwidth * eff.hbm))
        # rows attention reads: min(top-k, causal context), the context averaged over the new tokens
        selected = sum(min(m.index_topk, p + n / 2) * n for p, n in reqs) / ranks
        attn_flops = 2 * m.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * selected
        attn_s = max(attn_flops / (hw.dense_flops_bf16 * eff.attention),
                     selected * self.kv_bytes / (hw.hbm_bandwidth * eff.hbm))
        # rows per expert GEMM: every attention rank's tokens reach the experts (DP attention: ep / ranks groups)
        moe_rows = new * max(1, ep_ranks // ranks) * m.num_experts_per_tok / m.n_routed_experts
        ep_s = self.ep_s(local, ep_ranks)
        out = []
        for layer in range(m.num_layers):
            moe = layer >= m.first_k_dense
            gather = new * self.per_layer[layer] * (ranks - 1) / ranks / self.nvlink if allgather_new else 0.0
            out.append(LayerTime(
                pre=self.gemm_s(2 * self.attn_params[layer] * local, local) + gather,
                indexer=indexer_s if self.indexer[layer] else 0.0,
                attention=attn_s,
                mlp=self.gemm_s(2 * self.mlp_params[layer] * local, moe_rows if moe else local) + (ep_s if moe else 0.0)))
        return out
