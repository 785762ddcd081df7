"""One-line sensitivity per length (model engine): LayerSplit's gain over redundant CP and over
page-level KV sharding, at the config's settings and over the documented alternatives of each
assumption that drives it. Everything here is MODELLED.

Alternatives (each changes one setting of the config, the others stay):

* PCIe: every GPU on its own switch uplink (the config assumes 2 GPUs share one);
* host tier per GPU: 64 GB and 1024 GB (the config: 256 GB);
* concurrent sessions: 16 and 128 (the config: 64);
* batch: 16,384 and 131,072 new tokens (the config: 65,536);
* MFU: every compute efficiency x 0.7 (GEMM, indexer, attention);
* EP dispatch/combine hidden under compute (two-batch overlap; the config: exposed).
"""

from __future__ import annotations

from dataclasses import replace

from layersplit.plan.config import load_hardware
from layersplit.serving.roofline import Efficiency
from layersplit.serving.sweep_config import SweepConfig

PEERS = ("redundant", "kv-sharding")
MODES = ("redundant", "kv-sharding", "layersplit")


def alternatives(cfg: SweepConfig) -> list[tuple[str, SweepConfig, object, Efficiency]]:
    """(label, config, hardware, efficiencies) of every alternative."""
    hw, eff = load_hardware(cfg.hardware), Efficiency()
    slow = replace(eff, gemm_max=eff.gemm_max * 0.7, indexer=eff.indexer * 0.7, attention=eff.attention * 0.7)
    return [("PCIe unshared", cfg, replace(hw, gpus_per_pcie_switch=1), eff),
            ("64 GB host", replace(cfg, host_bytes_per_rank=64e9), hw, eff),
            ("1024 GB host", replace(cfg, host_bytes_per_rank=1024e9), hw, eff),
            ("16 sessions", replace(cfg, sessions=16), hw, eff),
            ("128 sessions", replace(cfg, sessions=128), hw, eff),
            ("16k batches", replace(cfg, max_batch_tokens=16384), hw, eff),
            ("131k batches", replace(cfg, max_batch_tokens=131072), hw, eff),
            ("MFU x0.7", cfg, hw, slow),
            ("EP hidden (TBO)", cfg, hw, replace(eff, ep_hidden=1.0))]


def _gains(points: list[dict]) -> dict[tuple[int, str], float]:
    by = {(p["length"], p["mode"]): p["request_tokens_per_s"] for p in points}
    lengths = {p["length"] for p in points}
    return {(n, peer): 100 * (by[(n, "layersplit")] / by[(n, peer)] - 1) for n in lengths for peer in PEERS}


def sensitivity(cfg: SweepConfig, base: list[dict], run_sweep) -> list[dict]:
    """Per length and peer: the gain at the config, its range over the alternatives, and which
    alternatives give the ends. ``base``: the config's own points (already run); ``run_sweep``:
    :func:`layersplit.serving.sweep.run_sweep` (passed in: the sweep module imports this one)."""
    at = {"config": _gains(base)}
    for label, c, hw, eff in alternatives(cfg):
        at[label] = _gains(run_sweep(c, hw=hw, eff=eff, modes=MODES))
    rows = []
    for n in cfg.lengths:
        for peer in PEERS:
            values = {label: g[(n, peer)] for label, g in at.items()}
            lo, hi = min(values, key=values.get), max(values, key=values.get)
            rows.append({"length": n, "peer": peer, "gain": values["config"], "min": values[lo], "min_at": lo,
                         "max": values[hi], "max_at": hi, "all": values})
    return rows


def lines(rows: list[dict]) -> str:
    """One line per length (modelled)."""
    out = ["Sensitivity (**modelled**): LayerSplit's gain at the config's settings, and its range over the "
           "alternatives (PCIe unshared; 64 / 1024 GB host; 16 / 128 sessions; 16k / 131k-token batches; "
           "MFU x0.7; EP hidden), with the alternative at each end.", ""]
    for n in sorted({r["length"] for r in rows}):
        parts = [f"vs {r['peer']} {r['gain']:+.1f}% ({r['min']:+.1f}% {r['min_at']} .. {r['max']:+.1f}% {r['max_at']})"
                 for r in rows if r["length"] == n]
        out.append(f"- {n // 1000}k: " + "; ".join(parts))
    return "\n".join(out) + "\n"
