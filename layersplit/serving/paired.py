"""The measured sweep, paired (the CPU main job): per length both modes run on the same requests in
one spawn of the rank processes, *alternating* per repeat (A B, B A, A B, ...) after one discarded
warm-up of each, so a drift of the machine's load hits both modes alike; a mode's gain is the median
of its per-repeat throughput ratios to redundant CP, with their range.

The table leads with what is counted, the same on any machine: KV bytes and tokens per rank, hit
tiers, bytes reloaded and broadcast (measured by the engine; equal to the cost model's, see
``test_real_and_model_agree_on_counted_values``), recomputed tokens, and the bytes a rank must reload
ahead of an even pace (:meth:`layersplit.serving.cost_model.CostModel.reload_ahead`: contiguous
ownership makes one rank reload its whole layer range before the forward passes it). Times and gains
come after, labelled measured, with their interval.
"""

from __future__ import annotations

import statistics

from layersplit.serving.cost_model import CostModel


def alternating(modes: tuple[str, ...], repeats: int) -> list[str]:
    """The order modes run in: A B, B A, A B, ... (one entry per (repeat, mode))."""
    return [m for k in range(repeats) for m in (modes if k % 2 == 0 else modes[::-1])]


def paired_gains(totals: dict[str, list[float]], tokens: dict[str, int], base: str) -> dict[str, dict]:
    """Per mode: median and range of its per-repeat throughput ratio to ``base`` (percent)."""
    out = {}
    for mode, seconds in totals.items():
        ratios = [100 * (tokens[mode] / s / (tokens[base] / b) - 1) for s, b in zip(seconds, totals[base])]
        out[mode] = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "ratios": ratios}
    return out


def counted(point: dict, cost: CostModel, batches) -> dict:
    """The counted columns of a measured point (engine-independent)."""
    reload_rows = [sum(-(-s.req.prefix // 64) * 64 for s in b.served if s.tier == "L2") for b in batches]
    point["recomputed_tokens"] = sum(s.req.prefix for b in batches for s in b.served if s.tier == "miss")
    point["reload_ahead_bytes"] = max((cost.reload_ahead(r) for r in reload_rows), default=0)
    return point


def table(points: list[dict], cfg) -> str:
    lines = [f"Sweep `{cfg.name}`: {cfg.model} on {cfg.cp} x {cfg.hardware}, engine `real`; token counts scaled "
             f"x{cfg.scale:g}; {cfg.sessions} sessions, {cfg.requests} requests; `{cfg.ownership}` ownership. "
             f"**Counted** columns first (the same on any machine), then **measured** ones: each mode's repeats "
             f"alternate with the other's on the same requests; the gain is the median of {cfg.repeats} paired "
             f"per-repeat ratios, with their range.", "",
             "| length | mode | KV/rank (MB) | L1 tokens/rank | L1 | L2 | miss | reloaded/rank (MB) | broadcast (MB) "
             "| recomputed tokens | reload ahead/rank (MB) | req tok/s (measured, median) | gain vs redundant "
             "(measured, median [range]) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        g = p["paired_gain"]
        gain = "-" if p["mode"] == "redundant" else (f"{g['median']:+.1f}% [{g['low']:+.1f}, {g['high']:+.1f}]"
                                                     f"{' (interval spans 0)' if g['low'] <= 0 <= g['high'] else ''}")
        lines.append(f"| {p['length'] // 1000}k | {p['mode']} | {p['kv_bytes_per_rank'] / 1e6:.2f} "
                     f"| {p['l1_tokens_per_rank']:,} | {p['hit_L1']:.0%} | {p['hit_L2']:.0%} | {p['miss']:.0%} "
                     f"| {p['reload_bytes_per_rank'] / 1e6:.2f} | {p['bcast_bytes'] / 1e6:.2f} "
                     f"| {p['recomputed_tokens']:,} | {p['reload_ahead_bytes'] / 1e6:.3f} "
                     f"| {p['request_tokens_per_s']:,.0f} | {gain} |")
    return "\n".join(lines) + "\n"
