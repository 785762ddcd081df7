"""Gain map: LayerSplit's gain over (request length) x (concurrent sessions, or host GB per GPU).

One curve hides what drives the gain: it is mostly a capacity cliff of device + host memory, whose
position depends on how many sessions compete for the cache and how large the host tier is. The map
runs the same sweep for each value of one axis and shows ``layersplit``'s gain over every other
layout (redundant CP, with one shared host copy per node, upstream SGLang's layer split, KV sharding
as designed and as shipped, the query-moving design) and over the best *available* peer: the fastest
SGLang 0.5.23 layout that runs on the config's GPU at that KV dtype. A peer that does not run there
(KV sharding as shipped on Hopper) is marked "not available": a design bar, never the peer to beat. The
map runs every KV dtype of the config, each like with like (fp8 rows against fp8 rows). The
seed's two published gains (+10% at 40k, +132% at 120k) are marked on the cells that come closest
to them, so a reader sees which assumptions reproduce them. Everything here is as *modelled* (or
measured) as the engine of the sweep config.

Outputs: ``gain_map.png`` (one heatmap per comparison), ``gain_map.md``, ``gain_map.jsonl``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from layersplit.plan.capacity import unavailable_reason
from layersplit.plan.config import load_hardware
from layersplit.serving.sweep import SEED_GAIN, run_sweep
from layersplit.serving.sweep_config import SweepConfig

COMPARE = (("redundant", "gain_vs_redundant"), ("redundant-shared-host", None),
           ("upstream-layersplit", "gain_vs_upstream"), ("kv-sharding", "gain_vs_kv_sharding"),
           ("kv-sharding-shipped", None), ("query-moving", None))
BEST = "best_available_peer"  # the fastest peer that runs on the GPU at that KV dtype (sweep.add_best_available_peer)
LABEL = {"sessions": "concurrent sessions", "host_gb": "host tier per GPU (GB)"}


def _at(cfg: SweepConfig, axis: str, value: float) -> SweepConfig:
    if axis == "sessions":
        return replace(cfg, sessions=int(value))
    return replace(cfg, host_bytes_per_rank=value * 1e9)


def map_rows(cfg: SweepConfig, axis: str, values: list[float], progress=None) -> list[dict]:
    """One row per (axis value, KV dtype, length): layersplit's request tokens/s, its gain over each other
    layout (%) and over the best available peer (``gain_vs_best_available_peer``, which it names)."""
    rows = []
    for value in values:
        points = run_sweep(_at(cfg, axis, value))
        for dtype in cfg.kv_dtypes:
            for length in cfg.lengths:
                at = {p["mode"]: p for p in points
                      if p["length"] == length and p.get("kv_dtype", cfg.kv_dtype) == dtype}
                ours = at["layersplit"]["request_tokens_per_s"]
                row = {axis: value, "length": length, "kv_dtype": dtype, "kind": at["layersplit"]["kind"],
                       "layersplit_request_tokens_per_s": ours, BEST: at["layersplit"].get(BEST),
                       f"gain_vs_{BEST}": at["layersplit"].get(f"gain_vs_{BEST}")}
                for peer, _ in COMPARE:
                    if peer in at:
                        row[f"gain_vs_{peer}"] = 100 * (ours / at[peer]["request_tokens_per_s"] - 1)
                rows.append(row)
        if progress:
            progress(1)
    return rows


def _peers(rows: list[dict]) -> list[str]:
    """The columns of a map: every compared layout the rows have, then the best available peer."""
    return [p for p, _ in COMPARE if f"gain_vs_{p}" in rows[0]] + ([BEST] if rows[0].get(f"gain_vs_{BEST}") is not None
                                                                      else [])


def _title(peer: str, hw) -> str:
    if peer == BEST:
        return f"vs the best available peer (the fastest SGLang 0.5.23 layout that runs on {hw.name}; cell: gain, peer)"
    why = unavailable_reason(peer, hw)
    return f"vs {peer}" + (f" -- NOT AVAILABLE on {hw.name} (SM {hw.sm_major}): a design bar, never the peer to beat"
                           if why else "")


def _grid(rows: list[dict], axis: str, key: str, values: list[float], lengths: tuple[int, ...]) -> list[list[float]]:
    """One KV dtype's rows as a [value][length] grid of ``key``."""
    cell = {(r[axis], r["length"]): r.get(key) for r in rows}
    return [[cell[(v, n)] for n in lengths] for v in values]


def _of(rows: list[dict], dtype: str) -> list[dict]:
    return [r for r in rows if r.get("kv_dtype", dtype) == dtype]


def _seed_cells(grid: list[list[float]], lengths: tuple[int, ...]) -> list[tuple[int, int, float]]:
    """(row, column, seed gain) of the cell closest to each of the seed's points."""
    out = []
    for length, gain in SEED_GAIN.items():
        if length in lengths:
            col = lengths.index(length)
            row = min(range(len(grid)), key=lambda i: abs(grid[i][col] - gain))
            out.append((row, col, gain))
    return out


def _table(rows: list[dict], cfg: SweepConfig, axis: str, values: list[float], peer: str) -> list[str]:
    """One peer's grid (rows of one KV dtype); the best-peer grid names the peer in each cell."""
    grid = _grid(rows, axis, f"gain_vs_{peer}", values, cfg.lengths)
    names = _grid(rows, axis, BEST, values, cfg.lengths) if peer == BEST else None
    marks = {(r, c) for r, c, _ in _seed_cells(grid, cfg.lengths)} if peer == "redundant" else set()
    lines = [f"| {LABEL[axis]} | " + " | ".join(f"{n // 1000}k" for n in cfg.lengths) + " |",
             "|---|" + "---|" * len(cfg.lengths)]
    for i, v in enumerate(values):
        cells = [f"{g:+.1f}%{'*' if (i, j) in marks else ''}" + (f" ({names[i][j]})" if names else "")
                 for j, g in enumerate(grid[i])]
        lines.append(f"| {v:g} | " + " | ".join(cells) + " |")
    return lines + [""]


def write_table(rows: list[dict], cfg: SweepConfig, axis: str, values: list[float], path: Path) -> None:
    kind, hw = rows[0]["kind"], load_hardware(cfg.hardware)
    lines = [f"Gain map `{cfg.name}` ({kind}): `layersplit`'s request tokens/s over each other layout on {hw.name} "
             f"(SM {hw.sm_major}), by request length and {LABEL[axis]}; other settings as in the config "
             f"({cfg.sessions} sessions, {cfg.host_bytes_per_rank / 1e9:g} GB host per GPU, "
             f"{100 * (1 - cfg.new_fraction):.0f}% reusable). Each KV dtype against the same dtype. "
             f"Seed: +{SEED_GAIN[40000]:.0f}% at 40k, +{SEED_GAIN[120000]:.0f}% at 120k; `*` marks the cell closest "
             f"to each.", ""]
    for dtype in cfg.kv_dtypes:
        at = _of(rows, dtype)
        lines += [f"### KV {dtype} ({kind})", ""]
        for peer in _peers(at):
            lines += [f"**{_title(peer, hw)}**", ""] + _table(at, cfg, axis, values, peer)
    path.write_text("\n".join(lines))


def plot_map(rows: list[dict], cfg: SweepConfig, axis: str, values: list[float], path: Path) -> None:
    """Heatmaps at the config's first KV dtype (the table has every dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, hw = _of(rows, cfg.kv_dtype), load_hardware(cfg.hardware)
    peers = _peers(rows)
    cols = min(3, len(peers))
    rows_n = -(-len(peers) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 4.2 * rows_n), squeeze=False)
    for ax in axes.flat[len(peers):]:
        ax.axis("off")
    for ax, peer in zip(axes.flat, peers):
        grid = _grid(rows, axis, f"gain_vs_{peer}", values, cfg.lengths)
        im = ax.imshow(grid, cmap="RdYlGn", vmin=-max(50, max(map(max, grid))), vmax=max(50, max(map(max, grid))),
                       aspect="auto", origin="lower")
        for i, line in enumerate(grid):
            for j, g in enumerate(line):
                ax.text(j, i, f"{g:+.0f}%", ha="center", va="center", fontsize=7)
        if peer == "redundant":
            for r, c, gain in _seed_cells(grid, cfg.lengths):
                ax.scatter([c], [r], marker="*", s=260, facecolors="none", edgecolors="k", linewidths=1.5)
                ax.annotate(f"seed +{gain:.0f}%", (c, r), textcoords="offset points", xytext=(0, 11), ha="center",
                            fontsize=7)
        ax.set_xticks(range(len(cfg.lengths)), [f"{n // 1000}k" for n in cfg.lengths])
        ax.set_yticks(range(len(values)), [f"{v:g}" for v in values])
        ax.set_xlabel("request length")
        ax.set_ylabel(LABEL[axis])
        label = "best available peer" if peer == BEST else peer
        gone = " -- NOT AVAILABLE here" if peer != BEST and unavailable_reason(peer, hw) else ""
        ax.set_title(f"layersplit vs {label}{gone}\n({rows[0]['kind']}, KV {cfg.kv_dtype}, {hw.name})", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8, label="gain (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_map(cfg: SweepConfig, axis: str, values: list[float], out: Path, progress=None) -> dict[str, Path]:
    """Run the map and write its outputs under ``out``."""
    rows = map_rows(cfg, axis, values, progress)
    paths = {"map_png": out / "gain_map.png", "map_table": out / "gain_map.md", "map_jsonl": out / "gain_map.jsonl"}
    paths["map_jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_table(rows, cfg, axis, values, paths["map_table"])
    plot_map(rows, cfg, axis, values, paths["map_png"])
    return paths
