"""The 40k-120k sweep at 90% prefix reuse: every serving mode on the same workload.

For each request length and mode (:data:`layersplit.plan.capacity.MODES`; the measured engine runs the
two the CP engine implements): build the workload, run the serving loop with that mode's tier
capacities, time its batches with the chosen engine, and aggregate one point. Each point carries its
gain over redundant CP, over upstream SGLang's layer split and over SGLang's page-level KV sharding,
and (model engine) a time breakdown: compute, recompute of misses, exposed reload, exposed broadcast.
The model engine runs every KV dtype of the config, each against itself (``kv_dtype`` on each point),
marks each layout peer / design bar / ours and whether it runs on the config's GPU, and gives the gain
over the best peer that does (:func:`add_best_available_peer`). Measured points are paired
(:mod:`.paired`): per length both modes interleave on the same requests, the lead alternating per repeat,
and a gain is the median of the per-repeat ratios with a distribution-free interval for it. Outputs (``--out``):
``points.jsonl`` (written as points finish), ``table.md`` (model engine: + the query-moving peer per
layer, the sensitivity per length and the calibration table) and ``throughput.png`` (the first KV dtype).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from layersplit.plan.capacity import MODES, ROLE, PlanRequest, capacity_plan, mode_bytes, modes_at, unavailable_reason
from layersplit.plan.config import load_hardware, load_model
from layersplit.serving.cost_model import CostModel, Efficiency
from layersplit.serving.serving import ServingLoop
from layersplit.serving.sweep_config import SweepConfig
from layersplit.serving.sweep_engines import ModelEngine, RealEngine
from layersplit.serving.workload import capacity, make_requests

REAL_MODES = ("redundant", "layersplit")  # what the CP engine implements (measured)
SEED_GAIN = {40000: 10.0, 120000: 132.0}  # the seed's reported gains (percent) at the ends of the range


@dataclass
class Setup:
    cfg: SweepConfig
    model: object
    hw: object
    device_bytes: float
    eff: Efficiency = Efficiency()


def setup(cfg: SweepConfig, hw=None, eff: Efficiency | None = None) -> Setup:
    """``hw`` / ``eff``: other hardware or efficiencies than the config's (the sensitivity runs)."""
    model, hw = load_model(cfg.model), hw or load_hardware(cfg.hardware)
    device = cfg.device_kv_bytes_per_rank
    if not device:
        device = capacity_plan(model, hw, PlanRequest(cp=cfg.cp, kv_dtype=cfg.kv_dtype))["kv_budget_bytes_per_rank"]
    return Setup(cfg, model, hw, device, eff or Efficiency())


def point_bytes(s: Setup, mode: str):
    c = s.cfg
    return mode_bytes(s.model, c.cp, c.kv_dtype, mode, c.scaled(c.max_batch_context), c.max_batch_requests,
                      c.ownership if mode in ("layersplit", "query-moving") else "contiguous", c.scaled(c.context_len),
                      c.scaled(c.max_batch_tokens))


def plan_point(s: Setup, length: int, mode: str):
    """Counted part of one point (engine-independent): capacities, requests, batches."""
    c = s.cfg
    mb = point_bytes(s, mode)
    cap = capacity(mb, s.device_bytes, c.host_bytes_per_rank)
    reqs = make_requests(c.scaled(length), c.new_fraction, c.sessions, c.requests, c.seed)
    loop = ServingLoop(cap, c.scaled(c.max_batch_tokens), c.scaled(c.max_batch_context), c.max_batch_requests)
    return mb, cap, loop, loop.run(reqs)


def aggregate(length: int, mode: str, mb, cap, loop, batches, costs, measured: bool,
              reusable: float = 0.9) -> dict:
    seconds = sum(x.seconds for x in costs)
    req_tokens = sum(s.req.prefix + s.req.new for b in batches for s in b.served)
    new_tokens = sum(s.req.new for b in batches for s in b.served)
    prefix = sum(s.req.prefix for b in batches for s in b.served)
    hit = {t: sum(b.tokens(t) for b in batches) / prefix for t in ("L1", "L2", "miss")}
    return {
        "length": length, "mode": mode, "kind": "measured" if measured else "modelled",
        "reusable_fraction": reusable,
        "request_tokens_per_s": req_tokens / seconds, "new_tokens_per_s": new_tokens / seconds,
        "hit_L1": hit["L1"], "hit_L2": hit["L2"], "miss": hit["miss"], "batches": len(batches),
        "requests": sum(len(b.served) for b in batches), "seconds": seconds,
        "reload_bytes_per_rank": sum(x.reload_bytes_per_rank for x in costs),
        "bcast_bytes_per_rank": sum(x.bcast_bytes for x in costs),  # what each receiving rank receives
        "exposed_comm_s": sum(x.exposed_comm_s for x in costs),
        # the breakdown is the cost model's; the measured engine times waits for broadcasts only
        "exposed_reload_s": None if measured else sum(x.exposed_reload_s for x in costs),
        "recompute_s": None if measured else sum(x.recompute_s for x in costs),
        "compute_s": None if measured else sum(x.compute_s for x in costs),
        "l1_tokens_per_rank": cap.l1_tokens, "l2_tokens_per_rank": cap.l2_tokens,
        "kv_bytes_per_rank": cap.l1_tokens * mb.bytes_per_token + mb.scratch_bytes,
        "peak_l1_tokens_per_rank": loop.peak_l1, "batch_sizes": [len(b.served) for b in batches],
    }


def modes_of(cfg: SweepConfig) -> tuple[str, ...]:
    return REAL_MODES if cfg.engine == "real" else MODES


def point_count(cfg: SweepConfig, modes: tuple[str, ...] | None = None) -> int:
    """The points :func:`run_sweep` yields for ``cfg`` (what its progress counts): per length every mode, and
    with the model engine every KV dtype's modes (KV sharding as shipped: fp8 only); the measured engine
    runs the first KV dtype."""
    modes = modes or modes_of(cfg)
    dtypes = cfg.kv_dtypes if cfg.engine == "model" else (cfg.kv_dtype,)
    return len(cfg.lengths) * sum(len(modes_at(modes, dtype)) for dtype in dtypes)


def _engine(s: Setup, modes: tuple[str, ...]):
    cfg = s.cfg
    if cfg.engine == "real":
        return RealEngine(s.model, cfg.cp, cfg.kv_dtype, cfg.seed, cfg.ownership)
    costs = {}
    for m in modes:
        mb = point_bytes(s, m)
        pool = capacity(mb, s.device_bytes, cfg.host_bytes_per_rank).l1_tokens
        costs[m] = CostModel(s.model, s.hw, cfg.cp, cfg.kv_dtype, mb, s.eff, pool_tokens=pool)
    return ModelEngine(costs)


def add_gains(points: list[dict]) -> None:
    """``gain_vs_redundant`` / ``gain_vs_upstream`` / ``gain_vs_kv_sharding`` (percent, request
    tokens/s) of every point of one length; ``gain_pct`` is the first (kept for scripts that read it).
    A measured point's gain over redundant is its paired statistic (``paired_gain``: the median of the
    per-repeat ratios, :mod:`.paired`), ``gain_within_noise`` where that interval spans 0; a modelled
    point's is the ratio of the two points' request tokens/s (one deterministic run: no noise to be within)."""
    from layersplit.serving.paired import spans_zero

    by_mode = {p["mode"]: p["request_tokens_per_s"] for p in points}
    for p in points:
        p["gain_vs_redundant"] = p["gain_pct"] = 100 * (p["request_tokens_per_s"] / by_mode["redundant"] - 1)
        for key, peer in (("gain_vs_upstream", "upstream-layersplit"), ("gain_vs_kv_sharding", "kv-sharding")):
            p[key] = 100 * (p["request_tokens_per_s"] / by_mode[peer] - 1) if peer in by_mode else None
        if "paired_gain" in p:  # the paired median, not the ratio of two modes' medians, is the measured gain
            p["gain_vs_redundant"] = p["gain_pct"] = p["paired_gain"]["median"]
            p["gain_within_noise"] = p["mode"] != "redundant" and spans_zero(p["paired_gain"])


def run_sweep(cfg: SweepConfig, progress=None, on_length=None, hw=None, eff: Efficiency | None = None,
              modes: tuple[str, ...] | None = None) -> list[dict]:
    """Every point; ``on_length(points)`` gets each length's points as soon as they are done. ``hw``,
    ``eff``, ``modes``: other hardware, efficiencies or a subset of the modes (model engine)."""
    s = setup(cfg, hw, eff)
    modes = modes or modes_of(cfg)
    engine, points = _engine(s, modes), []
    if engine.measured:
        return _run_paired(s, engine, modes, progress, on_length)
    engines = {cfg.kv_dtype: (s, engine)}  # the model runs every KV dtype of the config, each like with like
    for dtype in cfg.kv_dtypes[1:]:
        other = setup(replace(cfg, kv_dtype=dtype, kv_dtypes=(dtype,)), hw, eff)
        engines[dtype] = (other, _engine(other, modes))
    for length in cfg.lengths:
        done = []
        for dtype, (at, engine) in engines.items():
            group = []
            for mode in modes_at(modes, dtype):  # KV sharding as shipped: fp8 rows only
                mb, cap, loop, batches = plan_point(at, length, mode)
                (costs,) = engine.run(batches, mode)  # the model is deterministic: one run, no spread to report
                point = aggregate(length, mode, mb, cap, loop, batches, costs, engine.measured, 1 - cfg.new_fraction)
                point["kv_dtype"], point["owner_wait_s"] = dtype, sum(x.owner_wait_s for x in costs)
                group.append(point)
                if progress:
                    progress(1)
            add_gains(group)
            add_best_available_peer(group, s.hw)
            done += group
        points += done
        if on_length:
            on_length(done)
    return points


def add_best_available_peer(points: list[dict], hw) -> None:
    """Mark each modelled point of one (length, KV dtype) with its role (``peer``: an SGLang 0.5.23
    layout; ``design``: a bar; ``ours``), whether it runs on ``hw`` (``not_available``: why not), and
    the gain over the fastest peer that runs there (``best_available_peer``, ``gain_vs_best_available_peer``)."""
    for p in points:
        p["role"], p["not_available"] = ROLE[p["mode"]], unavailable_reason(p["mode"], hw)
    peers = [p for p in points if p["role"] == "peer" and not p["not_available"]]
    best = max(peers, key=lambda p: p["request_tokens_per_s"]) if peers else None
    for p in points:
        p["best_available_peer"] = best["mode"] if best else None
        p["gain_vs_best_available_peer"] = (100 * (p["request_tokens_per_s"] / best["request_tokens_per_s"] - 1)
                                            if best else None)


def _run_paired(s: Setup, engine, modes: tuple[str, ...], progress, on_length) -> list[dict]:
    """The measured sweep: per length, every mode on the same requests, alternating per repeat. A
    point's tok/s is its mode's median over the repeats; its gain is the paired statistic (the median
    of per-repeat ratios with its interval, :mod:`.paired`), which a ratio of two medians is not."""
    import statistics

    from layersplit.serving import paired

    cfg, points = s.cfg, []
    for length in cfg.lengths:
        plans = {mode: plan_point(s, length, mode) for mode in modes}
        runs = engine.run_paired({m: plan[3] for m, plan in plans.items()}, cfg.repeats)
        totals = {m: [sum(x.seconds for x in costs) for costs in runs[m]] for m in modes}
        tokens = {m: sum(r.req.prefix + r.req.new for b in plan[3] for r in b.served) for m, plan in plans.items()}
        gains = paired.paired_gains(totals, tokens, "redundant")
        done = []
        for mode in modes:
            mb, cap, loop, batches = plans[mode]
            middle = sorted(range(cfg.repeats), key=totals[mode].__getitem__)[cfg.repeats // 2]
            point = aggregate(length, mode, mb, cap, loop, batches, runs[mode][middle], True, 1 - cfg.new_fraction)
            rate = statistics.median(tokens[mode] / t for t in totals[mode])  # the mode's own median tok/s
            point["new_tokens_per_s"] *= rate / point["request_tokens_per_s"]
            point["request_tokens_per_s"], point["seconds"] = rate, tokens[mode] / rate
            point["repeats"], point["seconds_runs"], point["paired_gain"] = cfg.repeats, totals[mode], gains[mode]
            point["spread_pct"] = 100 * (max(totals[mode]) - min(totals[mode])) / point["seconds"]
            cost = CostModel(s.model, s.hw, cfg.cp, cfg.kv_dtype, mb)  # counts only: which rank reloads what
            done.append(paired.counted(point, cost, batches))
            if progress:
                progress(1)
        add_gains(done)
        points += done
        if on_length:
            on_length(done)
    return points


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _s(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# one statistic per column: counts per rank (/rank; bytes moved: one rank's total over the run) or per run
# (/run), counted by the serving loop; rates and times as priced by the cost model (one deterministic run: no
# spread, no repeats)
_HEADER = ("| length | mode | runs on {hw} | request tokens/s (modelled) | reusable | L1 | L2 | miss "
           "| reloaded/rank (GB) | broadcast/rank (GB) | compute (s, modelled) | recompute (s, modelled) "
           "| exposed reload (s, modelled) | exposed bcast (s, modelled) | KV/rank (GB) | L1 tokens/rank | batches/run "
           "| vs redundant | vs upstream split | vs kv-sharding | vs best peer |")
_RUNS = {"design": "design bar", "ours": "ours"}


def _row(p: dict) -> str:
    runs = _RUNS.get(p.get("role"), "**not available**" if p.get("not_available") else "yes")
    return (f"| {p['length'] // 1000}k | {p['mode']} | {runs} | {p['request_tokens_per_s']:,.0f} "
            f"| {p['reusable_fraction']:.0%} | {p['hit_L1']:.0%} | {p['hit_L2']:.0%} | {p['miss']:.0%} "
            f"| {p['reload_bytes_per_rank'] / 1e9:.3f} | {p['bcast_bytes_per_rank'] / 1e9:.3f} | {_s(p['compute_s'])} "
            f"| {_s(p['recompute_s'])} | {_s(p['exposed_reload_s'], 3)} | {p['exposed_comm_s']:.3f} "
            f"| {p['kv_bytes_per_rank'] / 1e9:.3f} | {p['l1_tokens_per_rank']:,} | {p['batches']} "
            f"| {_pct(p['gain_vs_redundant'])} | {_pct(p['gain_vs_upstream'])} "
            f"| {_pct(p.get('gain_vs_kv_sharding'))} | {_pct(p.get('gain_vs_best_available_peer'))} |")


def _block(points: list[dict], cfg: SweepConfig, dtype: str) -> list[str]:
    """One KV dtype's rows (every layout at that dtype) and LayerSplit's gain over the best available peer."""
    from layersplit.plan.config import load_model

    model = load_model(cfg.model)
    rows = [p for p in points if p.get("kv_dtype", cfg.kv_dtype) == dtype]
    absent = [m for m in modes_of(cfg) if m not in {p["mode"] for p in rows}]
    lines = [f"**KV {dtype}** ({model.kv_bytes_per_token(dtype)} B a token per layer + a {model.index_bytes_per_token} B "
             f"indexer key): every layout at {dtype} (**modelled**)"
             + (f"; {', '.join(absent)} runs another KV dtype only (SGLang 0.5.23's gate), so it has no {dtype} row"
                if absent else ""), "", _HEADER.format(hw=cfg.hardware), "|---" * (_HEADER.count("|") - 1) + "|"]
    lines += [_row(p) for p in rows]
    ours = [p for p in rows if p["mode"] == "layersplit" and p.get("best_available_peer")]
    if ours:
        lines += ["", f"LayerSplit over the best peer that runs on {cfg.hardware} at {dtype} (**modelled**): " + "; ".join(
            f"{p['length'] // 1000}k {_pct(p['gain_vs_best_available_peer'])} over {p['best_available_peer']}"
            for p in ours)]
    return lines + [""]


def table(points: list[dict], cfg: SweepConfig) -> str:
    """The modelled table: one block per KV dtype (fp8 rows compared with fp8 rows), each layout marked
    peer / design bar / ours and, for a peer, whether it runs on the config's GPU."""
    from layersplit.plan.config import load_hardware

    hw = load_hardware(cfg.hardware)
    kind = points[0]["kind"]
    scale = f", token counts scaled x{cfg.scale:g}" if cfg.scale != 1 else ""
    peers = [m for m in modes_of(cfg) if ROLE.get(m) == "peer"]
    lines = [f"Sweep `{cfg.name}`: {cfg.model} on {cfg.cp} x {cfg.hardware} (SM {hw.sm_major}), engine `{cfg.engine}` "
             f"(**{kind}**{scale}); {cfg.sessions} sessions, {cfg.requests} requests, "
             f"{cfg.host_bytes_per_rank / 1e9:g} GB host tier per GPU. `reusable` is the workload's reusable "
             f"share of each request; L1 / L2 / miss are the shares of those prefix tokens each mode found "
             f"resident, reloaded from host, or recomputed (counted by the serving loop). A `/rank` column is one "
             f"rank's (bytes moved: its total over the run), a `/run` column the whole run's (every rank "
             f"together). `broadcast/rank` is what a rank receives for the history (query-moving: the queries "
             f"into and outputs out of each layer's owner). `request tokens/s` counts all context tokens of the "
             f"requests (cached and new) per second; the gains compare it.",
             "", f"Layouts: **peers** are what SGLang 0.5.23 runs ({', '.join(peers)}); a **design bar** is modelled "
                 f"from a description and is never the peer to beat (kv-sharding: SGLang's page-level sharding with "
                 f"batch-sized scratch at any KV dtype; query-moving: arXiv 2606.01502, moving queries to each "
                 f"layer's owner); **ours**: sglang-plugin, layersplit. `vs best peer`: the gain over the fastest "
                 f"peer that runs on {cfg.hardware} at that KV dtype.", ""]
    for mode in modes_of(cfg):
        if (why := unavailable_reason(mode, hw)):
            lines += [f"**Not available on {cfg.hardware}: {mode}** ({why.split(': ', 1)[1]}). Its rows stay as a "
                      f"design bar, never the peer to beat on {cfg.hardware}.", ""]
    for dtype in cfg.kv_dtypes:
        lines += _block(points, cfg, dtype)
    return "\n".join(lines).rstrip("\n") + "\n"


def plot(points: list[dict], cfg: SweepConfig, path: Path) -> None:
    """Request tokens/s per mode and the gain over redundant CP. Measured points draw the gain's interval as
    error bars and nothing else (the seed's published GLM-5 / H200 gains are not on this machine's
    axes); modelled points are drawn beside the seed's two gains."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    kind = points[0]["kind"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {m: f"C{i}" for i, m in enumerate(modes_of(cfg))}  # one colour per mode in both panels
    for mode in modes_of(cfg):
        pts = [p for p in points if p["mode"] == mode]
        x = [p["length"] / 1000 for p in pts]
        ax.plot(x, [p["request_tokens_per_s"] for p in pts], marker="o", label=mode, color=colors[mode])
        if mode == "redundant":
            continue
        if kind == "measured":
            _plot_paired_gain(ax2, x, [p["paired_gain"] for p in pts], mode, colors[mode])
        else:
            ax2.plot(x, [p["gain_vs_redundant"] for p in pts], marker="o", label=mode, color=colors[mode])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    if kind == "modelled":
        ax2.scatter([k / 1000 for k in SEED_GAIN], list(SEED_GAIN.values()), marker="*", s=160, color="k", zorder=5,
                    label="seed's published gain (2 points, not a curve)")
        for length, gain in SEED_GAIN.items():
            ax2.annotate(f"seed +{gain:.0f}%", (length / 1000, gain), textcoords="offset points", xytext=(8, -4),
                         fontsize=8)
    ax2.axhline(0, color="grey", lw=0.5)
    ax2.set_ylabel(f"gain over redundant CP (%, {kind})", fontsize=9)  # measured: what it is, in the legend
    per = f", median of {points[0]['repeats']}" if kind == "measured" else ""
    ax.set_ylabel(f"request tokens/s ({kind}{per})", fontsize=9)
    for a in (ax, ax2):
        a.set_xlabel("request length (k tokens, nominal)", fontsize=9)
        a.tick_params(labelsize=8)
        a.grid(alpha=0.3)
        # the legend sits under its axes, never on the data
        a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.suptitle(f"{cfg.model} CP{cfg.cp} on {cfg.hardware} ({kind}): {cfg.sessions} sessions, "
                 f"{cfg.host_bytes_per_rank / 1e9:g} GB host per rank, {100 * (1 - cfg.new_fraction):.0f}% reusable",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _plot_paired_gain(ax, x: list[float], gains: list[dict], mode: str, color: str) -> None:
    """The paired gain per length with its confidence interval as error bars (``paired.median_interval``)."""
    mid = [g["median"] for g in gains]
    bars = [[m - g["low"] for m, g in zip(mid, gains)], [g["high"] - m for m, g in zip(mid, gains)]]
    g = gains[0]
    ax.errorbar(x, mid, yerr=bars, marker="o", capsize=5, color=color,
                label=f"{mode}: median of {g['n']} paired ratios, bars: its {g['level']:.2%} CI")


def write_outputs(points: list[dict], cfg: SweepConfig, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / "points.jsonl", "table": out / "table.md", "plot": out / "throughput.png"}
    paths["jsonl"].write_text("".join(json.dumps(p) + "\n" for p in points))
    paths["table"].write_text(report(points, cfg))
    plot([p for p in points if p.get("kv_dtype", cfg.kv_dtype) == cfg.kv_dtype], cfg, paths["plot"])  # one dtype
    return paths


def report(points: list[dict], cfg: SweepConfig) -> str:
    """The table; for the model engine also the sensitivity per length and the calibration table."""
    if points[0]["kind"] != "modelled":
        from layersplit.serving import paired

        return paired.table(points, cfg)
    from layersplit.serving import calibration, per_layer, sensitivity

    first = replace(cfg, kv_dtypes=(cfg.kv_dtype,))  # the sensitivity runs at the first KV dtype
    base = [p for p in points if p.get("kv_dtype", cfg.kv_dtype) == cfg.kv_dtype]
    return "\n".join([table(points, cfg), per_layer.table(cfg),
                      f"At KV {cfg.kv_dtype} (the config's first dtype):",
                      sensitivity.lines(sensitivity.sensitivity(first, base, run_sweep)), calibration.table()])
