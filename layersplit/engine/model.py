"""Tiny DSA model with seeded random weights, split into the stages the CP engine interleaves with comm.

Per layer (DeepSeek-V3.2 / GLM-5 structure, fp32 weights and activations, bf16 KV cache):

1. ``project``: RMSNorm -> q_a (low-rank q) -> q (nope ++ rope, RoPE on the rope part), the latent
   ``kv_c`` (normed) and rope key ``k_pe``; the absorbed query ``q_attn = [q_nope @ W_UK, q_pe]``;
   the indexer query ``q_a @ W_iq`` and key ``norm(h @ W_ik)``, each with RoPE on its rope part and the
   Hadamard rotation (``index_rope_rotate``), and head weights ``h @ W_iw`` (the indexer scales them);
2. lightning indexer + top-k + sparse MLA (``dsa_kernels``, run by the engine against its caches);
3. ``attention_out``: latent output @ W_UV -> o_proj, residual;
4. ``mlp``: SwiGLU MLP, residual (dense on every layer: the tiny model has no experts).

The indexer runs only on the config's indexer layers; the others reuse the last top-k.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch

from dsa_kernels import hadamard_rotate
from layersplit.plan.config import ModelConfig


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half) of the last dim of ``x [t, ..., R]`` at ``positions [t]``."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angle = positions.float()[:, None] * freq[None]  # [t, half]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def index_rope_rotate(x: torch.Tensor, positions: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """The indexer's q / k before fp8 (DeepSeek-V3.2-Exp ``inference/model.py``, ``Indexer.forward``):
    RoPE on the first ``qk_rope_head_dim`` values (rotate-half, i.e. non-interleaved, as DeepSeek's
    indexer after its 2025-11 fix), the rest untouched, then the Hadamard rotation (``rotate_activation``).
    Both are row-wise, so CP ranks and a single process compute the same bits for a token."""
    pe, nope = x.split([c.qk_rope_head_dim, x.shape[-1] - c.qk_rope_head_dim], dim=-1)
    return hadamard_rotate(torch.cat([rope(pe, positions), nope], dim=-1))


@dataclass
class Projections:
    """Stage-1 outputs for ``t`` local tokens of one layer."""

    q_attn: torch.Tensor  # [t, H, L + R]
    kv_c: torch.Tensor  # [t, L]
    k_pe: torch.Tensor  # [t, R]
    q_index: torch.Tensor  # [t, H_I, D]
    index_weights: torch.Tensor  # [t, H_I]
    index_k: torch.Tensor  # [t, D]


class TinyDSA:
    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        c = cfg
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.embed = torch.randn(c.vocab_size, c.hidden_size, generator=g)
        self.layers = [
            {
                "q_a": w(c.hidden_size, c.q_lora_rank), "q_b": w(c.q_lora_rank, c.num_heads * qk),
                "kv_a": w(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim),
                "w_uk": w(c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim),
                "w_uv": w(c.kv_lora_rank, c.num_heads, c.v_head_dim),
                "o": w(c.num_heads * c.v_head_dim, c.hidden_size),
                "i_q": w(c.q_lora_rank, c.index_n_heads * c.index_head_dim),
                "i_k": w(c.hidden_size, c.index_head_dim), "i_w": w(c.hidden_size, c.index_n_heads),
                "gate": w(c.hidden_size, c.intermediate_size), "up": w(c.hidden_size, c.intermediate_size),
                "down": w(c.intermediate_size, c.hidden_size),
            }
            for _ in range(c.num_layers)
        ]
        self.sm_scale = 1.0 / math.sqrt(qk)
        # weights are drawn on the CPU (same values on every device), then moved
        self.embed = self.embed.to(device)
        self.layers = [{k: v.to(device) for k, v in p.items()} for p in self.layers]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens]

    def project(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> Projections:
        c, p = self.cfg, self.layers[layer]
        t = h.shape[0]
        x = rms_norm(h)
        q_a = rms_norm(x @ p["q_a"])
        q = (q_a @ p["q_b"]).view(t, c.num_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv = x @ p["kv_a"]
        kv_c = rms_norm(kv[:, : c.kv_lora_rank])
        k_pe = rope(kv[:, c.kv_lora_rank:], positions)
        q_lat = torch.einsum("thn,lhn->thl", q_nope, p["w_uk"])
        q_attn = torch.cat([q_lat, rope(q_pe, positions)], dim=-1)
        q_index = index_rope_rotate((q_a @ p["i_q"]).view(t, c.index_n_heads, c.index_head_dim), positions, c)
        index_k = index_rope_rotate(rms_norm(x @ p["i_k"]), positions, c)
        # the raw weights_proj output: the indexer folds H^-0.5, D^-0.5 and q's fp8 scale into it
        return Projections(q_attn, kv_c, k_pe, q_index, x @ p["i_w"], index_k)

    def attention_out(self, layer: int, h: torch.Tensor, out_latent: torch.Tensor) -> torch.Tensor:
        v = torch.einsum("thl,lhv->thv", out_latent, self.layers[layer]["w_uv"])
        return h + v.reshape(h.shape[0], v.shape[1] * v.shape[2]) @ self.layers[layer]["o"]  # any rows, 0 too

    def mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        p = self.layers[layer]
        x = rms_norm(h)
        return h + (torch.nn.functional.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h)


class RowBlocks:
    """``model`` with its row-wise stages (projections, output projection, MLP) run over ``blocks``
    row blocks and concatenated: the same math on other GEMM shapes. A GPU's GEMMs are not
    batch-invariant (cuBLAS picks kernels by row count), so this changes a row's last bits the way
    a CP rank multiplying only its own rows does; the GPU check measures that floor with it."""

    def __init__(self, model: TinyDSA, blocks: int) -> None:
        if blocks < 1:
            raise ValueError(f"blocks: expected >= 1, got {blocks}")
        self.model, self.blocks = model, blocks

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _split(self, *tensors: torch.Tensor) -> zip:
        return zip(*(t.tensor_split(self.blocks) for t in tensors))

    def project(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> Projections:
        parts = [astuple(self.model.project(layer, hb, pb)) for hb, pb in self._split(h, positions)]
        return Projections(*(torch.cat(field) for field in zip(*parts)))

    def attention_out(self, layer: int, h: torch.Tensor, out_latent: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.model.attention_out(layer, hb, ob) for hb, ob in self._split(h, out_latent)])

    def mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.model.mlp(layer, hb) for (hb,) in self._split(h)])
