"""The "move the query, not the cache" peer (arXiv 2606.01502), as sizes: what crosses NVLink per layer
when the cache stays on the layer's owner and the queries travel to it instead.

Layer ``l`` is owned by one CP rank (as in LayerSplit). Each rank projects its own new tokens, then
sends the owner, per token,

* the absorbed MLA query ``q`` [H, L + R] (bf16): what sparse MLA attends with;
* on a layer that runs the indexer, the indexer query ``q_I`` [H_I, D] (fp8) and its head weights
  ``w`` [H_I] (fp32, the query's scale folded in, as DeepGEMM's fp8 MQA logits take them); on a layer
  that reuses the last top-k (GLM-5.2), that top-k [top-k] (int32) instead;

the owner runs the indexer and sparse attention for every rank's tokens and sends back, per token, the
attention output in latent space ``o`` [H, L] (bf16; each rank applies ``W_UV`` and ``o_proj`` itself),
plus the top-k when a later layer reuses it. Every byte is per *new* token: the history stays put.

LayerSplit instead broadcasts the batch's history rows of the layer (``rows x (KV + indexer key)``),
per *cached* token. The query-moving peer moves fewer bytes only when a request's prefix exceeds
:func:`crossover_prefix_ratio` times its new tokens (decode-like steps on long prefixes); at 90% prefix
reuse a prefill request has 9 cached tokens per new one.

Assumed: queries and outputs travel in bf16 at both KV dtypes (SGLang's absorbed query is bf16); the
owner takes one source rank's queries at a time into two slots (:func:`scratch_bytes`).
"""

from __future__ import annotations

from layersplit.plan.config import ModelConfig

QUERY_BYTES, OUTPUT_BYTES, TOPK_INDEX_BYTES = 2, 2, 4  # bf16 query and output, int32 top-k index


def returns_topk(model: ModelConfig, layer: int) -> bool:
    """Does ``layer``'s owner send its top-k back: it runs the indexer and the next layer reuses the result."""
    return model.has_indexer(layer) and layer + 1 < model.num_layers and not model.has_indexer(layer + 1)


def query_bytes_per_token(model: ModelConfig, layer: int) -> int:
    """What one new token sends the owner of ``layer``: ``H (L + R)`` bf16 query + indexer query and weights
    (GLM-5: 64 x 576 x 2 + 32 x 128 + 32 x 4 = 77,952 B), or the reused top-k on a layer without an indexer."""
    q = model.num_heads * (model.kv_lora_rank + model.qk_rope_head_dim) * QUERY_BYTES
    if model.has_indexer(layer):
        return q + model.index_n_heads * model.index_head_dim + model.index_n_heads * 4
    return q + model.index_topk * TOPK_INDEX_BYTES


def output_bytes_per_token(model: ModelConfig, layer: int) -> int:
    """What the owner sends back per new token: ``H L`` bf16 output (GLM-5: 65,536 B), + the top-k when
    it computed one that the next layer reuses."""
    out = model.num_heads * model.kv_lora_rank * OUTPUT_BYTES
    return out + (model.index_topk * TOPK_INDEX_BYTES if returns_topk(model, layer) else 0)


def layer_bytes(model: ModelConfig, cp: int, new_tokens: int, layer: int) -> tuple[int, int]:
    """(into, out of) the owner of ``layer`` for a batch of ``new_tokens`` split evenly over ``cp``
    ranks: the other ``cp - 1`` ranks' shares of the queries in, of the outputs out."""
    others = new_tokens * (cp - 1) // cp
    return others * query_bytes_per_token(model, layer), others * output_bytes_per_token(model, layer)


def scratch_bytes(model: ModelConfig, cp: int, new_tokens: int) -> int:
    """The owner's receive slots beyond a rank's own activations: two slots, each one source rank's
    share of the batch's queries and outputs (the largest layer's)."""
    if cp <= 1:
        return 0
    per_token = max(query_bytes_per_token(model, layer) + output_bytes_per_token(model, layer)
                    for layer in range(model.num_layers))
    return 2 * -(-new_tokens // cp) * per_token


def crossover_prefix_ratio(model: ModelConfig, cp: int, kv_dtype: str, layer: int) -> float:
    """Cached tokens per new token above which moving queries moves fewer bytes through the owner's
    links than broadcasting the history rows of ``layer`` (LayerSplit): ``(N - 1)/N (q + o) / row``."""
    moved = (cp - 1) / cp * (query_bytes_per_token(model, layer) + output_bytes_per_token(model, layer))
    return moved / model.layer_bytes_per_token(layer, kv_dtype)
