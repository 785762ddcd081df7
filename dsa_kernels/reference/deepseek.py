"""An independent restatement of DeepSeek-V3.2's indexer, in the shape of its public inference code.

This is the oracle the paged indexer (torch and Triton) is tested against. It follows, in our own
words, DeepSeek-V3.2-Exp ``inference/model.py`` ``Indexer.forward`` and ``inference/kernel.py``
``act_quant`` (with ``fast_round_scale``) and ``fp8_index``, on one request with a dense key cache
(no pages, no bytes):

* ``act_quant(x)``: per 128 values, ``amax = max(|x|, 1e-4)``; the scale is ``amax * fp32(1/448)``
  with its exponent rounded up by bit arithmetic (exponent field minus 127, plus one when any
  mantissa bit is set), i.e. the next power of two (ue8m0); ``x / scale`` clamped to +-448, cast
  to e4m3.
* head weights: ``weights_proj(x) * H^-0.5``, then times the query's scale and ``D^-0.5``.
* ``fp8_index``: per key, ``sum_h relu(q_h . k) * w_h``, then times the key's scale.
* the causal mask adds ``-inf`` past each query's position; ``topk(min(k, end_pos))``.

The model-side steps before quantization (RoPE on the first ``rope_dim`` values — non-interleaved
for the indexer since DeepSeek's 2025-11 fix — then ``rotate_activation``) are the model's job: see
``dsa_kernels.rotation`` and the tiny model.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., N], scale [..., N / block])`` with power-of-two scales from the fp32 bits."""
    n = x.shape[-1]
    blk = min(block, n)
    xb = x.float().reshape(*x.shape[:-1], n // blk, blk)
    amax = xb.abs().amax(dim=-1).clamp_min(1e-4)
    raw = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    bits = raw.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = ((exponent + 127) << 23).view(torch.float32)
    y = (xb / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return y.reshape(x.shape), scale


def fp8_index(q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``[T, S]``: ``k_scale[s] * sum_h relu(q_fp8[t, h] . k_fp8[s]) * weights[t, h]``."""
    logits = torch.einsum("thd,sd->tsh", q_fp8.float(), k_fp8.float())
    return (logits.clamp_min(0) * weights[:, None, :]).sum(-1) * k_scale[None, :]


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start_pos: int, topk: int
) -> list[set[int]]:
    """One request: ``q [T, H, D]`` for positions ``start_pos + i``, ``weights [T, H]``
    (``weights_proj`` output), ``keys [start_pos + T, D]``. Returns each query's selected positions
    with a finite score (DeepSeek's top-k may also return masked positions when ``k`` exceeds the
    visible context; they carry ``-inf`` and select nothing)."""
    t_count, heads, dim = q.shape
    end_pos = start_pos + t_count
    q_fp8, q_scale = act_quant(q)  # q_scale [T, H, 1]
    k_fp8, k_scale = act_quant(keys)  # k_scale [S, 1]
    w = (weights * heads**-0.5)[..., None] * q_scale * dim**-0.5
    score = fp8_index(q_fp8, w[..., 0], k_fp8, k_scale[:, 0])
    mask = torch.arange(end_pos)[None, :] > (start_pos + torch.arange(t_count))[:, None]
    score = score.masked_fill(mask, float("-inf"))
    vals, idx = score.topk(min(topk, end_pos), dim=-1)
    return [set(i[torch.isfinite(v)].tolist()) for v, i in zip(vals, idx)]
