"""Gain map: LayerSplit's gain over (request length) x (concurrent sessions, or host GB per GPU).

One curve hides what drives the gain: it is mostly a capacity cliff of device + host memory, whose
position depends on how many sessions compete for the cache and how large the host tier is. The map
runs the same sweep for each value of one axis and shows ``layersplit``'s gain over redundant CP,
over redundant CP with one shared host copy per node, and over upstream SGLang's layer split. The
seed's two published gains (+10% at 40k, +132% at 120k) are marked on the cells that come closest
to them, so a reader sees which assumptions reproduce them. Everything here is as *modelled* (or
measured) as the engine of the sweep config.

Outputs: ``gain_map.png`` (one heatmap per comparison), ``gain_map.md``, ``gain_map.jsonl``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from layersplit.serving.sweep import SEED_GAIN, run_sweep
from layersplit.serving.sweep_config import SweepConfig

COMPARE = (("redundant", "gain_vs_redundant"), ("redundant-shared-host", None),
           ("upstream-layersplit", "gain_vs_upstream"), ("kv-sharding", "gain_vs_kv_sharding"),
           ("kv-sharding-shipped", None))
LABEL = {"sessions": "concurrent sessions", "host_gb": "host tier per GPU (GB)"}


def _at(cfg: SweepConfig, axis: str, value: float) -> SweepConfig:
    if axis == "sessions":
        return replace(cfg, sessions=int(value))
    return replace(cfg, host_bytes_per_rank=value * 1e9)


def map_rows(cfg: SweepConfig, axis: str, values: list[float], progress=None) -> list[dict]:
    """One row per (axis value, length): layersplit's tokens/s and its gain over each peer (%)."""
    rows = []
    for value in values:
        points = run_sweep(_at(cfg, axis, value))
        for length in cfg.lengths:
            at = {p["mode"]: p for p in points if p["length"] == length}
            ours = at["layersplit"]["request_tokens_per_s"]
            row = {axis: value, "length": length, "kind": at["layersplit"]["kind"], "layersplit_tokens_per_s": ours}
            for peer, _ in COMPARE:
                if peer in at:
                    row[f"gain_vs_{peer}"] = 100 * (ours / at[peer]["request_tokens_per_s"] - 1)
            rows.append(row)
        if progress:
            progress(1)
    return rows


def _grid(rows: list[dict], axis: str, key: str, values: list[float], lengths: tuple[int, ...]) -> list[list[float]]:
    cell = {(r[axis], r["length"]): r.get(key) for r in rows}
    return [[cell[(v, n)] for n in lengths] for v in values]


def _seed_cells(grid: list[list[float]], lengths: tuple[int, ...]) -> list[tuple[int, int, float]]:
    """(row, column, seed gain) of the cell closest to each of the seed's points."""
    out = []
    for length, gain in SEED_GAIN.items():
        if length in lengths:
            col = lengths.index(length)
            row = min(range(len(grid)), key=lambda i: abs(grid[i][col] - gain))
            out.append((row, col, gain))
    return out


def write_table(rows: list[dict], cfg: SweepConfig, axis: str, values: list[float], path: Path) -> None:
    kind = rows[0]["kind"]
    lines = [f"Gain map `{cfg.name}` ({kind}): `layersplit`'s request tokens/s over each peer, by request length "
             f"and {LABEL[axis]}; other settings as in the config ({cfg.sessions} sessions, "
             f"{cfg.host_bytes_per_rank / 1e9:g} GB host per GPU, {100 * (1 - cfg.new_fraction):.0f}% reusable). "
             f"Seed: +{SEED_GAIN[40000]:.0f}% at 40k, +{SEED_GAIN[120000]:.0f}% at 120k; `*` marks the cell closest "
             f"to each.", ""]
    for peer, _ in COMPARE:
        key = f"gain_vs_{peer}"
        if key not in rows[0]:
            continue
        grid = _grid(rows, axis, key, values, cfg.lengths)
        marks = {(r, c) for r, c, _ in _seed_cells(grid, cfg.lengths)} if peer == "redundant" else set()
        lines += [f"**vs {peer}**", "", f"| {LABEL[axis]} | " + " | ".join(f"{n // 1000}k" for n in cfg.lengths) + " |",
                  "|---|" + "---|" * len(cfg.lengths)]
        for i, v in enumerate(values):
            cells = [f"{g:+.1f}%{'*' if (i, j) in marks else ''}" for j, g in enumerate(grid[i])]
            lines.append(f"| {v:g} | " + " | ".join(cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def plot_map(rows: list[dict], cfg: SweepConfig, axis: str, values: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [p for p, _ in COMPARE if f"gain_vs_{p}" in rows[0]]
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
        ax.set_title(f"layersplit vs {peer} ({rows[0]['kind']})", fontsize=9)
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
