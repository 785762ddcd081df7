"""The 40k-120k sweep at 90% prefix reuse: LayerSplit + HiCache vs redundant CP.

For each request length and mode: build the workload, run the serving loop with that mode's tier
capacities, time its batches with the chosen engine, and aggregate one point. Outputs (``--out``):
``points.jsonl``, ``table.md`` and ``throughput.png``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from layersplit.capacity import PlanRequest, capacity_plan
from layersplit.config import load_hardware, load_model
from layersplit.cost_model import CostModel
from layersplit.serving import ServingLoop
from layersplit.sweep_config import SweepConfig
from layersplit.sweep_engines import ModelEngine, RealEngine
from layersplit.capacity import mode_bytes
from layersplit.workload import capacity, make_requests

MODES = ("redundant", "layersplit")
SEED_GAIN = {40000: 10.0, 120000: 132.0}  # the seed's reported gains (percent) at the ends of the range


@dataclass
class Setup:
    cfg: SweepConfig
    model: object
    hw: object
    device_bytes: float


def setup(cfg: SweepConfig) -> Setup:
    model, hw = load_model(cfg.model), load_hardware(cfg.hardware)
    device = cfg.device_kv_bytes_per_rank
    if not device:
        device = capacity_plan(model, hw, PlanRequest(cp=cfg.cp, kv_dtype=cfg.kv_dtype))["kv_budget_bytes_per_rank"]
    return Setup(cfg, model, hw, device)


def plan_point(s: Setup, length: int, mode: str):
    """Counted part of one point (engine-independent): capacities, requests, batches."""
    c = s.cfg
    mb = mode_bytes(s.model, c.cp, c.kv_dtype, mode, c.scaled(c.max_batch_context), c.max_batch_requests)
    cap = capacity(mb, s.device_bytes, c.host_bytes_per_rank)
    reqs = make_requests(c.scaled(length), c.new_fraction, c.sessions, c.requests, c.seed)
    loop = ServingLoop(cap, c.scaled(c.max_batch_tokens), c.scaled(c.max_batch_context), c.max_batch_requests)
    return mb, cap, loop, loop.run(reqs)


def aggregate(length: int, mode: str, mb, cap, loop, batches, costs, measured: bool) -> dict:
    seconds = sum(x.seconds for x in costs)
    req_tokens = sum(s.req.prefix + s.req.new for b in batches for s in b.served)
    new_tokens = sum(s.req.new for b in batches for s in b.served)
    prefix = sum(s.req.prefix for b in batches for s in b.served)
    hit = {t: sum(b.tokens(t) for b in batches) / prefix for t in ("L1", "L2", "miss")}
    return {
        "length": length, "mode": mode, "kind": "measured" if measured else "modelled",
        "request_tokens_per_s": req_tokens / seconds, "new_tokens_per_s": new_tokens / seconds,
        "hit_L1": hit["L1"], "hit_L2": hit["L2"], "miss": hit["miss"], "batches": len(batches),
        "requests": sum(len(b.served) for b in batches), "seconds": seconds,
        "reload_bytes_per_rank": sum(x.reload_bytes_per_rank for x in costs),
        "bcast_bytes": sum(x.bcast_bytes for x in costs), "exposed_comm_s": sum(x.exposed_comm_s for x in costs),
        "l1_tokens_per_rank": cap.l1_tokens, "l2_tokens_per_rank": cap.l2_tokens,
        "kv_bytes_per_rank": cap.l1_tokens * mb.bytes_per_token + mb.scratch_bytes,
        "peak_l1_tokens": loop.peak_l1, "batch_sizes": [len(b.served) for b in batches],
    }


def run_sweep(cfg: SweepConfig, progress=None) -> list[dict]:
    s = setup(cfg)
    if cfg.engine == "real":
        engine = RealEngine(s.model, cfg.cp, cfg.kv_dtype, cfg.seed)
    else:
        engine = ModelEngine({m: CostModel(s.model, s.hw, cfg.cp, cfg.kv_dtype, mode_bytes(
            s.model, cfg.cp, cfg.kv_dtype, m, cfg.scaled(cfg.max_batch_context), cfg.max_batch_requests)) for m in MODES})
    points = []
    for length in cfg.lengths:
        for mode in MODES:
            mb, cap, loop, batches = plan_point(s, length, mode)
            points.append(aggregate(length, mode, mb, cap, loop, batches, engine.run(batches, mode), engine.measured))
            if progress:
                progress(1)
        base, ls = points[-2], points[-1]
        ls["gain_pct"] = 100 * (ls["request_tokens_per_s"] / base["request_tokens_per_s"] - 1)
        base["gain_pct"] = 0.0
    return points


def table(points: list[dict], cfg: SweepConfig) -> str:
    kind = points[0]["kind"]
    scale = f", token counts scaled x{cfg.scale:g}" if cfg.scale != 1 else ""
    lines = [f"Sweep `{cfg.name}`: {cfg.model} on {cfg.cp} x {cfg.hardware}, engine `{cfg.engine}` "
             f"(**{kind}**{scale}); {cfg.sessions} sessions, {cfg.requests} requests, "
             f"{100 * (1 - cfg.new_fraction):.0f}% reusable prefix.", "",
             "| length | mode | req tok/s | new tok/s | hit L1 | hit L2 | miss | reloaded/rank (GB) | broadcast (GB) "
             "| exposed comm (s) | KV/rank (GB) | L1 tokens/rank | batches | gain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['length'] // 1000}k | {p['mode']} | {p['request_tokens_per_s']:,.0f} | {p['new_tokens_per_s']:,.0f} "
                     f"| {p['hit_L1']:.0%} | {p['hit_L2']:.0%} | {p['miss']:.0%} | {p['reload_bytes_per_rank'] / 1e9:.3f} "
                     f"| {p['bcast_bytes'] / 1e9:.3f} | {p['exposed_comm_s']:.3f} | {p['kv_bytes_per_rank'] / 1e9:.3f} "
                     f"| {p['l1_tokens_per_rank']:,} | {p['batches']} | {p['gain_pct']:+.0f}% |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], cfg: SweepConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = points[0]["kind"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in MODES:
        pts = [p for p in points if p["mode"] == mode]
        ax.plot([p["length"] / 1000 for p in pts], [p["request_tokens_per_s"] for p in pts], marker="o", label=mode)
    for p in points:
        if p["mode"] == "layersplit":
            ax.annotate(f"{p['gain_pct']:+.0f}%", (p["length"] / 1000, p["request_tokens_per_s"]),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax2 = ax.twinx()
    ax2.plot([40, 120], [SEED_GAIN[40000], SEED_GAIN[120000]], "k--", alpha=0.5, label="seed's gain (+10% at 40k, +132% at 120k; line between)")
    ax2.plot([p["length"] / 1000 for p in points if p["mode"] == "layersplit"],
             [p["gain_pct"] for p in points if p["mode"] == "layersplit"], "g:", alpha=0.7, label="our gain")
    ax2.set_ylabel("gain over redundant CP (%)")
    ax.set_xlabel("request length (k tokens, nominal)")
    ax.set_ylabel(f"request tokens/s ({kind})")
    ax.set_title(f"{cfg.model} CP{cfg.cp} on {cfg.hardware}: {kind}, 90% prefix reuse")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(points: list[dict], cfg: SweepConfig, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / "points.jsonl", "table": out / "table.md", "plot": out / "throughput.png"}
    paths["jsonl"].write_text("".join(json.dumps(p) + "\n" for p in points))
    paths["table"].write_text(table(points, cfg))
    plot(points, cfg, paths["plot"])
    return paths
