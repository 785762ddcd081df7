"""The measured sweep, paired (the CPU main job): per length both modes run on the same requests in
one spawn of the rank processes after one discarded warm-up of each. Within a repeat their batches
*interleave* (a0 b0 a1 b1 ...: :meth:`~layersplit.serving.sweep_engines.RealEngine.run_paired`) and
the lead *alternates* per repeat (A B, B A, ...; an even number of repeats leads with each equally
often), so a change of the machine's load longer than one batch hits both modes of a pair alike.

The gain of a mode is the **median of its n per-repeat throughput ratios** to redundant CP, with a
**distribution-free confidence interval for that median** (:func:`median_interval`): the order
statistics ``[r_(k), r_(n+1-k)]``, whose coverage is exactly ``1 - 2 P(Bin(n, 1/2) <= k - 1)`` for
any continuous distribution of the ratios. Why this statistic and not a mean or Hodges-Lehmann:

* the noise of a shared machine is one-sided and heavy-tailed (another job slows one mode of one
  repeat, never speeds it up), so nothing symmetric may be assumed: the Wilcoxon interval behind
  Hodges-Lehmann needs a symmetric distribution of ratios, a t interval a normal one;
* one outlier moves the median and its interval by one order statistic at most; with ``k >= 2``
  (n >= 8 at 90%) a single outlier on either side cannot pull the interval across 0, which is what
  sank the old 3-repeat range (+22.5% [-1.1, +23.0] on a quiet machine: one bad repeat);
* medians and order statistics commute with any monotone map, so the same interval holds for the
  ratio, its logarithm or the percent gain, and for the time ratio read the other way.

The table leads with what is counted, the same on any machine: KV bytes and tokens per rank, hit
tiers, bytes reloaded and broadcast (measured by the engine; equal to the cost model's, see
``test_real_and_model_agree_on_counted_values``), recomputed tokens, and the bytes a rank must reload
ahead of an even pace (:meth:`layersplit.serving.cost_model.CostModel.reload_ahead`: contiguous
ownership makes one rank reload its whole layer range before the forward passes it). Times and gains
come after, labelled measured, with their interval.
"""

from __future__ import annotations

import math
import statistics

from layersplit.serving.cost_model import CostModel

LEVEL = 0.90  # the least coverage asked of a gain's interval


def alternating(modes: tuple[str, ...], repeats: int) -> list[str]:
    """The order modes run in: A B, B A, A B, ... (one entry per (repeat, mode))."""
    return [m for k in range(repeats) for m in (modes if k % 2 == 0 else modes[::-1])]


def coverage(n: int, k: int) -> float:
    """Exact coverage of ``[x_(k), x_(n+1-k)]`` (1-based order statistics of n independent draws) for
    the median of a continuous distribution: ``1 - 2 P(Bin(n, 1/2) <= k - 1)``. E.g. n=3, k=1: 0.75;
    n=8, k=2: 1 - 2 * 9/256 = 0.9296875."""
    if not 1 <= k <= (n + 1) // 2:  # a ValueError, not an assert: it must hold under python -O too
        raise ValueError(f"k: expected 1 <= k <= {(n + 1) // 2} for n={n}, got {k}")
    return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n


def order_k(n: int, level: float = LEVEL) -> int:
    """The largest k (the narrowest interval) whose coverage is at least ``level``; 1 (the range) where
    even that falls short, as for n < 5 at 90%: the interval then states its own, lower coverage."""
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(n, k + 1) >= level:
        k += 1
    return k


def median_interval(values: list[float], level: float = LEVEL) -> dict:
    """Median of ``values`` and the distribution-free interval for it: ``low``/``high`` =
    ``x_(k)``/``x_(n+1-k)`` with ``k = order_k(n, level)``; ``level`` is that interval's exact
    coverage (at least the one asked unless n is too small), ``n`` and ``k`` as used.

    >>> median_interval([3.0, 1.0, 2.0, 5.0, 4.0])  # n=5: k=1, coverage 1 - 2/32
    {'median': 3.0, 'low': 1.0, 'high': 5.0, 'level': 0.9375, 'n': 5, 'k': 1}
    """
    if not values:
        raise ValueError("values: expected at least one, got none")
    xs, n = sorted(values), len(values)
    k = order_k(n, level)
    return {"median": statistics.median(xs), "low": xs[k - 1], "high": xs[n - k], "level": coverage(n, k),
            "n": n, "k": k}


def paired_gains(totals: dict[str, list[float]], tokens: dict[str, int], base: str,
                 level: float = LEVEL) -> dict[str, dict]:
    """Per mode: its per-repeat throughput ratios to ``base`` (percent; repeat i of each mode ran
    interleaved with the base's repeat i on the same requests), their median and its
    :func:`median_interval` (``low``, ``high``, ``level``, ``n``, ``k``). ``totals``: seconds per
    repeat; ``tokens``: request tokens per repeat."""
    out = {}
    for mode, seconds in totals.items():
        assert len(seconds) == len(totals[base]), f"expected paired repeats, got {len(seconds)} vs {len(totals[base])}"
        ratios = [100 * (tokens[mode] / s / (tokens[base] / b) - 1) for s, b in zip(seconds, totals[base])]
        out[mode] = median_interval(ratios, level) | {"ratios": ratios}
    return out


def spans_zero(gain: dict) -> bool:
    return gain["low"] <= 0 <= gain["high"]


def counted(point: dict, cost: CostModel, batches) -> dict:
    """The counted columns of a measured point (engine-independent): the prefix tokens the run recomputed
    (all ranks together), and the most bytes one rank must reload ahead of an even pace in any batch."""
    reload_rows = [sum(-(-s.req.prefix // 64) * 64 for s in b.served if s.tier == "L2") for b in batches]
    point["recomputed_tokens_per_run"] = sum(s.req.prefix for b in batches for s in b.served if s.tier == "miss")
    point["reload_ahead_bytes_per_rank"] = max((cost.reload_ahead(r) for r in reload_rows), default=0)
    return point


def _pct(x: float, rounding=math.trunc) -> str:
    """One decimal, rounded the cautious way: a gain toward 0, an interval's bounds outward (the
    inner ``round`` drops float noise such as 10 * 0.3 = 3.0000000000000004 before the cut)."""
    return f"{rounding(round(10 * x, 6)) / 10:+.1f}"


def _gain_cell(p: dict) -> str:
    if p["mode"] == "redundant":
        return "-"
    g = p["paired_gain"]
    return (f"{_pct(g['median'])}% [{_pct(g['low'], math.floor)}, {_pct(g['high'], math.ceil)}]"
            f"{' (interval spans 0)' if spans_zero(g) else ''}")


def _ratio_of_medians(points: list[dict]) -> str:
    """Per length, each non-base mode's ratio of the request tokens/s medians (what that column implies)."""
    base = {p["length"]: p["request_tokens_per_s"] for p in points if p["mode"] == "redundant"}
    return ", ".join(f"{p['mode']} {_pct(100 * (p['request_tokens_per_s'] / base[p['length']] - 1))}% at "
                     f"{p['length'] // 1000}k" for p in points if p["mode"] != "redundant")


def table(points: list[dict], cfg) -> str:
    g = points[0]["paired_gain"]
    n, k, level = g["n"], g["k"], g["level"]
    lines = [f"Sweep `{cfg.name}`: {cfg.model} on {cfg.cp} x {cfg.hardware}, engine `real`; token counts scaled "
             f"x{cfg.scale:g}; {cfg.sessions} sessions, {cfg.requests} requests; `{cfg.ownership}` ownership. "
             f"**Counted** columns first (the same on any machine), then **measured** ones: n = {n} repeats, each "
             f"running both modes on the same requests, their batches interleaved and the lead alternating. "
             f"The gain is the median of the n paired per-repeat throughput ratios, with a distribution-free "
             f"{level:.2%} confidence interval for that median (the ratios' order statistics {k} and {n + 1 - k} "
             f"of {n}; coverage 1 - 2 P(Bin({n}, 1/2) <= {k - 1}), exact for any continuous distribution); "
             f"\"(interval spans 0)\" marks a gain not told apart from noise.", "",
             f"`request tokens/s` (all context tokens of the requests, cached and new, per second) is each mode's "
             f"own median over its {n} repeats, a different statistic: the ratio of two such medians compares "
             f"numbers from different repeats, so load that slowed one repeat of both modes does not cancel in it "
             f"as it does in a paired ratio. Here it reads {_ratio_of_medians(points)}; where it differs from the "
             f"gain, read the gain.", "",
             "A `/rank` column is one rank's (bytes moved: its total over the run), a `/run` column the whole "
             "run's (every rank together).", "",
             "| length | mode | KV/rank (MB) | L1 tokens/rank | L1 | L2 | miss | reloaded/rank (MB) "
             f"| broadcast/rank (MB) | recomputed tokens/run | reload ahead/rank (MB) "
             f"| request tokens/s (measured, median of {n}) | gain vs redundant "
             f"(measured, median of {n} paired ratios [{level:.2%} CI]) |", "|---" * 13 + "|"]
    for p in points:
        lines.append(f"| {p['length'] // 1000}k | {p['mode']} | {p['kv_bytes_per_rank'] / 1e6:.2f} "
                     f"| {p['l1_tokens_per_rank']:,} | {p['hit_L1']:.0%} | {p['hit_L2']:.0%} | {p['miss']:.0%} "
                     f"| {p['reload_bytes_per_rank'] / 1e6:.2f} | {p['bcast_bytes_per_rank'] / 1e6:.2f} "
                     f"| {p['recomputed_tokens_per_run']:,} | {p['reload_ahead_bytes_per_rank'] / 1e6:.3f} "
                     f"| {math.floor(p['request_tokens_per_s']):,} | {_gain_cell(p)} |")
    return "\n".join(lines) + "\n"
