"""Per layer, one prefill batch (MODELLED): LayerSplit's row broadcast against the query-moving peer
(:mod:`layersplit.plan.query_moving`), in bytes and seconds, at each length and KV dtype of a sweep.

The batch is the sweep's fullest all-resident batch at that length: as many requests as the config's
``max_batch_requests``, ``max_batch_tokens`` (new tokens) and ``max_batch_context`` allow, each with
its reusable prefix cached and its new tokens to compute. Bytes and the owner's work are those of one
layer with an indexer; per-layer times are the cost model's batch time over the layers (the same
:class:`~layersplit.serving.cost_model.CostModel` the sweep uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from layersplit.plan import query_moving
from layersplit.plan.capacity import mode_bytes
from layersplit.plan.config import HardwareConfig, ModelConfig, load_hardware, load_model
from layersplit.serving.cost_model import CostModel, attention_phase, pages_rows
from layersplit.serving.roofline import Roofline
from layersplit.serving.serving import Batch, Req, Served
from layersplit.serving.sweep_config import SweepConfig


@dataclass(frozen=True)
class LayerCompare:
    length: int
    kv_dtype: str
    requests: int
    prefix: int  # cached tokens per request
    new: int  # new tokens per request
    rows_bytes: int  # LayerSplit: the history rows of one layer a rank receives
    rows_s: float  # ... at the cost model's NVLink rate (issued before the previous layer's MLP)
    mlp_s: float  # the MLP/MoE that hides it
    queries_bytes: int  # query-moving: into the layer's owner
    outputs_bytes: int  # ... out of it
    transfer_s: float  # both at the NVLink rate, one after the other
    attention_s: float  # one rank's indexer + sparse attention in CP (its share of the batch)
    phase_s: float  # query-moving: queries sent .. last output back (the owner attends for every rank)
    layersplit_layer_s: float  # cost-model batch time / layers
    moving_layer_s: float
    owner_wait_layer_s: float  # the owner attending for the others while they idle, per layer


def representative(cfg: SweepConfig, length: int) -> tuple[int, int, int]:
    """(requests, prefix, new) of the fullest all-resident batch the config forms at ``length``."""
    length = cfg.scaled(length)
    new = max(1, round(length * cfg.new_fraction))
    n = min(cfg.max_batch_requests, cfg.scaled(cfg.max_batch_tokens) // new,
            cfg.scaled(cfg.max_batch_context) // length)
    return max(1, n), length - new, new


def _layer(model: ModelConfig) -> int:
    """The first MoE layer that runs the indexer (the layers most of the model is made of)."""
    return next(layer for layer in model.indexer_layer_ids if layer >= model.first_k_dense)


def compare(cfg: SweepConfig, model: ModelConfig, hw: HardwareConfig, length: int, kv_dtype: str) -> LayerCompare:
    n, prefix, new = representative(cfg, length)
    layer, cp = _layer(model), cfg.cp
    roof = Roofline(model, hw, kv_dtype)
    ts = roof.layers([(prefix, new)] * n, cp)[layer]
    rows = n * pages_rows(prefix) * model.layer_bytes_per_token(layer, kv_dtype)
    into, out = query_moving.layer_bytes(model, cp, n * new, layer)
    share = n * new / cp / roof.nvlink
    c = ts.indexer + ts.attention
    phase = attention_phase(c, share * query_moving.query_bytes_per_token(model, layer),
                            share * query_moving.output_bytes_per_token(model, layer), cp)
    batch = Batch([Served(Req(i, prefix, new), "L1") for i in range(n)])
    cost = {}
    for mode in ("layersplit", "query-moving"):
        mb = mode_bytes(model, cp, kv_dtype, mode, cfg.scaled(cfg.max_batch_context), cfg.max_batch_requests,
                        "round-robin", chunk_tokens=cfg.scaled(cfg.max_batch_tokens))
        cost[mode] = CostModel(model, hw, cp, kv_dtype, mb).batch(batch)
    layers = model.num_layers
    return LayerCompare(length, kv_dtype, n, prefix, new, rows, rows / roof.nvlink, ts.mlp, into, out,
                        (into + out) / roof.nvlink, c, phase, cost["layersplit"].seconds / layers,
                        cost["query-moving"].seconds / layers, cost["query-moving"].owner_wait_s / layers)


def _ms(x: float) -> str:
    return f"{x * 1e3:,.2f}"


def _where_it_wins(cfg: SweepConfig, model: ModelConfig, layer: int) -> str:
    ratios = {d: query_moving.crossover_prefix_ratio(model, cfg.cp, d, layer) for d in cfg.kv_dtypes}
    reuse = (1 - cfg.new_fraction) / cfg.new_fraction  # cached tokens per new one in these prefills
    per_token = query_moving.query_bytes_per_token(model, layer) + query_moving.output_bytes_per_token(model, layer)
    rows_100k = 100000 * model.layer_bytes_per_token(layer, cfg.kv_dtype)
    return ("Where it would win (**modelled**): moving queries moves fewer bytes than broadcasting rows only when a "
            "request's cached prefix exceeds " + ", ".join(f"{r:.0f}x (KV {d})" for d, r in ratios.items())
            + f" its new tokens; these prefills have {reuse:.0f}x, so it moves "
            + ", ".join(f"{r / reuse:.0f}x (KV {d})" for d, r in ratios.items())
            + " the bytes, on the critical path (a query exists only after its layer's projections), and the owner "
              "does the attention of every rank while the others idle (the MoE's expert-parallel exchange keeps every "
              "rank on the same layer, so nothing fills the wait). It wins on decode-like steps, a few new tokens on "
              f"long prefixes (one token on a 100k prefix moves {per_token / 1e3:.0f} kB instead of "
              f"{rows_100k / 1e6:.0f} MB of {cfg.kv_dtype} rows), and with prefixes longer than the ratio above; a "
              "prefill worker does not serve those steps (decode runs on the PD decode workers).")


def table(cfg: SweepConfig) -> str:
    """The per-layer comparison at every length and KV dtype of ``cfg`` (**modelled**), with where the
    query-moving peer would win."""
    model, hw = load_model(cfg.model), load_hardware(cfg.hardware)
    layer = _layer(model)
    lines = [f"Query-moving peer per layer (**modelled**; arXiv 2606.01502, a design bar): layer {layer} of "
             f"{cfg.model} on {cfg.cp} x {cfg.hardware}, the fullest all-resident batch at each length. LayerSplit "
             f"broadcasts the layer's history rows (per cached token); query-moving sends every new token's "
             f"queries to the layer's owner ({query_moving.query_bytes_per_token(model, layer):,} B) and its output "
             f"back ({query_moving.output_bytes_per_token(model, layer):,} B), and the owner attends for all "
             f"{cfg.cp} ranks while the others wait.", "",
             "| length | KV | batch (requests x new, prefix) | LayerSplit rows/layer (MB) | its broadcast (ms; "
             "hidden under the MLP's ms) | query-moving in + out/layer (MB) | its transfers (ms) | owner: "
             f"{cfg.cp} x a rank's indexer + attention (ms) | query-moving attention phase (ms) | per layer, "
             "LayerSplit / query-moving (ms) | query-moving's request tokens/s vs LayerSplit's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for length in cfg.lengths:
        for dtype in cfg.kv_dtypes:
            x = compare(cfg, model, hw, length, dtype)
            lines.append(
                f"| {length // 1000}k | {dtype} | {x.requests} x {x.new:,}, {x.prefix:,} | {x.rows_bytes / 1e6:,.1f} "
                f"| {_ms(x.rows_s)} ({_ms(x.mlp_s)}) | {x.queries_bytes / 1e6:,.1f} + {x.outputs_bytes / 1e6:,.1f} "
                f"| {_ms(x.transfer_s)} | {cfg.cp} x {_ms(x.attention_s)} = {_ms(cfg.cp * x.attention_s)} "
                f"| {_ms(x.phase_s)} | {_ms(x.layersplit_layer_s)} / {_ms(x.moving_layer_s)} "
                f"| {100 * (x.layersplit_layer_s / x.moving_layer_s - 1):+.1f}% |")
    lines += ["", _where_it_wins(cfg, model, layer), ""]
    return "\n".join(lines)
