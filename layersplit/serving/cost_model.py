"""Cost model of one prefill batch on N GPUs (default GLM-5 on 8 x H200). Everything it returns is
MODELLED, not measured.

Per layer and rank, with the batch's new tokens split evenly over the N CP ranks and weights split
over the same N GPUs (TP/EP = N):

* projections + MLP/MoE: ``2 * active_params(l) * tokens / N`` FLOPs at fp8 peak x GEMM efficiency
  ``e_max * m / (m + m_half)``, ``m`` = rows per expert GEMM (small batches under-fill experts);
* lightning indexer: ``2 * H_I * D * sum_i new_i * (prefix_i + new_i / 2) / N`` FLOPs (causal) at
  fp8 peak x ``e_indexer``;
* sparse MLA: ``2 * H * min(top-k, ctx) * (L + R + L)`` FLOPs per new token at bf16 peak x ``e_attn``;
* host-tier reload: each rank copies the prefix pages of its held layers from host memory, layer by
  layer on a load stream that runs ahead of compute (the layer's compute waits for its load: the wait
  is *exposed reload*); the CP ranks reload at once, so a rank gets
  ``HardwareConfig.reload_bandwidth(cp)``: its PCIe link, its share of its PCIe switch uplink and of
  host DRAM (with a shared host copy every rank reloads every layer from it);
* row broadcasts (``layersplit``, ``sglang-plugin``): the owner broadcasts the batch's prefix rows of
  layer ``l`` over NVLink once its load of ``l`` is done and layer ``l-1``'s attention ended (issued
  before ``l-1``'s MLP); the indexer waits for the index part, attention for the KV part;
* upstream layer split (``upstream-layersplit``): the whole pool-sized landing layer (every pool
  token's rows) is broadcast on each read; its indexer part synchronously when the indexer reads it,
  its KV part one layer ahead into the single landing buffer (so not before the previous layer's
  attention ended); waiting for a broadcast is *exposed broadcast*;
* every mode all-gathers the new tokens' cache rows before attention (not overlapped);
* recompute of misses: the share of a batch's compute spent on prefixes it recomputes, taken as
  their share of the batch's prefill tokens (an approximation: attention grows faster than linear).

Sources: GEMM ``e_max`` 0.78 — DeepGEMM's README reports up to ~1550 fp8 TFLOP/s on H800 (peak 1979);
``e_attn`` 0.65 — FlashMLA's README reports up to 640 TFLOP/s for sparse prefill on H800 (peak 989);
NVLink efficiency 380/450 — DESIGN.md section 2 (measured ~380 GB/s of 450 per direction). Assumed
(no public measurement at hand): ``m_half`` = 128 rows, ``e_indexer`` = 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsa_kernels.layout import PAGE_SIZE
from layersplit.plan.capacity import ModeBytes
from layersplit.plan.config import HardwareConfig, ModelConfig
from layersplit.serving.serving import Batch


@dataclass(frozen=True)
class Efficiency:
    gemm_max: float = 0.78
    gemm_half_rows: int = 128
    indexer: float = 0.5
    attention: float = 0.65
    nvlink: float = 380 / 450


@dataclass
class BatchCost:
    seconds: float
    exposed_comm_s: float  # waiting for broadcasts (worst rank)
    reload_bytes_per_rank: int  # max over ranks
    bcast_bytes: int  # summed over layers (what each non-owner receives)
    exposed_reload_s: float = 0.0  # waiting for host-tier loads (worst rank)
    recompute_s: float = 0.0  # compute spent recomputing missed prefixes

    @property
    def compute_s(self) -> float:
        """Compute that is not recomputing misses (what any mode must do for the new tokens)."""
        return max(0.0, self.seconds - self.exposed_comm_s - self.exposed_reload_s - self.recompute_s)


def pages_rows(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


class CostModel:
    def __init__(self, model: ModelConfig, hw: HardwareConfig, cp: int, kv_dtype: str, mb: ModeBytes,
                 eff: Efficiency = Efficiency(), pool_tokens: int = 0) -> None:
        """``pool_tokens``: the device pool's tokens per rank (upstream's landing layer is that large)."""
        self.m, self.hw, self.cp, self.mb, self.eff = model, hw, cp, mb, eff
        self.per_layer = [model.layer_bytes_per_token(layer, kv_dtype) for layer in range(model.num_layers)]
        self.kv_bytes = model.kv_bytes_per_token(kv_dtype)
        self.owner = {layer: r for r, held in enumerate(mb.held_layers) for layer in held} if mb.broadcast else {}
        self.pool_rows = pages_rows(pool_tokens)
        self.reload_bw = hw.reload_bandwidth(cp)
        # per-layer constants, computed once (``has_indexer`` rebuilds the indexer-layer set per call)
        self.indexer = [model.has_indexer(layer) for layer in range(model.num_layers)]
        self.attn_params = [model.attention_params(layer) for layer in range(model.num_layers)]
        self.mlp_params = [model.mlp_params(layer, active=True) for layer in range(model.num_layers)]
        self._memo: dict[tuple, BatchCost] = {}  # a batch's cost depends only on its (prefix, tokens, tier) list

    def _gemm_s(self, flops: float, rows: float) -> float:
        e = self.eff.gemm_max * rows / (rows + self.eff.gemm_half_rows)
        return flops / (self.hw.dense_flops_fp8 * e) if flops else 0.0

    def _layer_times(self, batch: Batch, reqs: list[tuple[int, int, str]]) -> list[dict[str, float]]:
        """Per layer, the same on every rank: projections + all-gather, indexer, attention, MLP (s)."""
        m, cp, hw = self.m, self.cp, self.hw
        new = batch.new_tokens
        moe_rows = new * m.num_experts_per_tok / m.n_routed_experts
        nv = hw.nvlink_bandwidth * self.eff.nvlink
        indexer_s = sum(2 * m.index_n_heads * m.index_head_dim * n * (p + n / 2) for p, n, _ in reqs) / cp
        indexer_s /= hw.dense_flops_fp8 * self.eff.indexer
        attn_s = sum(2 * m.num_heads * min(m.index_topk, p + n) * (2 * m.kv_lora_rank + m.qk_rope_head_dim) * n
                     for p, n, _ in reqs) / cp / (hw.dense_flops_bf16 * self.eff.attention)
        times = []
        for layer in range(m.num_layers):
            rows = moe_rows if layer >= m.first_k_dense else new / cp
            times.append({
                "pre": self._gemm_s(2 * self.attn_params[layer] * new / cp, new / cp)
                       + new * self.per_layer[layer] * (cp - 1) / cp / nv,  # + all-gather of the new rows
                "indexer": indexer_s if self.indexer[layer] else 0.0,
                "attention": attn_s,
                "mlp": self._gemm_s(2 * self.mlp_params[layer] * new / cp, rows),
            })
        return times

    def _loads(self, reload_rows: int) -> dict[tuple[int, int], float]:
        """When each rank's load stream finishes each held layer (from t = 0)."""
        loads = {}
        for r, held in enumerate(self.mb.held_layers):
            t = 0.0
            for layer in held:
                t += reload_rows * self.per_layer[layer] / self.reload_bw
                loads[(r, layer)] = t
        return loads

    def _bcast_ready(self, layer: int, rows: int, t: float, issue: float, loaded: float) -> tuple[float, float]:
        """(index-ready, KV-ready) on a non-owner: row broadcasts issued one layer ahead; upstream's
        indexer part synchronous at the indexer (``t``), its KV part one layer ahead."""
        nv = self.hw.nvlink_bandwidth * self.eff.nvlink
        index_s = rows * (self.per_layer[layer] - self.kv_bytes) / nv
        if self.mb.broadcast == "pool":
            idx_ready = max(t, loaded) + index_s
            return idx_ready, max(issue, loaded) + rows * self.kv_bytes / nv
        idx_ready = max(issue, loaded) + index_s
        return idx_ready, idx_ready + rows * self.kv_bytes / nv

    def _rank(self, r: int, layer_s: list[dict], loads: dict, rows: int) -> tuple[float, float, float]:
        """(end, exposed broadcast, exposed reload) of rank ``r``."""
        t, bcast, reload, issue = 0.0, 0.0, 0.0, 0.0
        for layer, ts in enumerate(layer_s):
            t += ts["pre"]
            owner = self.owner.get(layer, r)
            loaded = loads.get((owner, layer), 0.0)
            idx_ready = kv_ready = loaded
            if owner != r and rows:
                idx_ready, kv_ready = self._bcast_ready(layer, rows, t, issue, loaded)
            steps = ([(idx_ready, ts["indexer"])] if self.indexer[layer] else []) + [(kv_ready, ts["attention"])]
            for ready, work in steps:  # the indexer waits for its keys, attention for the KV
                wait = max(0.0, ready - t)
                bcast, reload = (bcast + wait, reload) if owner != r else (bcast, reload + wait)
                t = max(t, ready) + work
            issue = t  # layer l+1's broadcast is issued before this layer's MLP
            t += ts["mlp"]
        return t, bcast, reload

    def batch(self, batch: Batch) -> BatchCost:
        """The batch's cost; batches with the same (prefix, tokens, tier) list share one (memoised)."""
        key = tuple((s.req.prefix, s.prefill_tokens, s.tier) for s in batch.served)
        if key not in self._memo:
            self._memo[key] = self._batch(batch)
        return replace(self._memo[key])

    def _batch(self, batch: Batch) -> BatchCost:
        cp = self.cp
        reqs = [(s.req.prefix if s.tier != "miss" else 0, s.prefill_tokens, s.tier) for s in batch.served]
        reload_rows = sum(pages_rows(p) for p, _, tier in reqs if tier == "L2")
        rows = 0
        if self.owner and cp > 1:
            rows = self.pool_rows if self.mb.broadcast == "pool" else sum(pages_rows(p) for p, _, _ in reqs)
        layer_s = self._layer_times(batch, reqs)
        loads = self._loads(reload_rows)
        ranks = [self._rank(r, layer_s, loads, rows) for r in range(cp)]
        end = max(x[0] for x in ranks)
        bcast, reload_s = max(x[1] for x in ranks), max(x[2] for x in ranks)
        reload = max(reload_rows * sum(self.per_layer[layer] for layer in held) for held in self.mb.held_layers)
        missed = sum(s.req.prefix for s in batch.served if s.tier == "miss")
        recompute = (end - bcast - reload_s) * missed / batch.new_tokens if batch.new_tokens else 0.0
        return BatchCost(end, bcast, reload, rows * sum(self.per_layer), reload_s, recompute)
