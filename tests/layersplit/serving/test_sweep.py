"""``layersplit sweep``: both engines end to end on small configs, outputs and labels, config errors."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from layersplit.cli.app import main
from layersplit.plan.config import ConfigError, configs_root
from layersplit.serving.sweep_config import load_sweep


def small(tmp_path, name: str, **changes):
    data = yaml.safe_load((configs_root() / "sweeps" / f"{name}.yaml").read_text())
    data.update(changes)
    path = tmp_path / f"{name}-small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(tmp_path, capsys, config, *extra) -> list[dict]:
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(config), "--out", str(out), *extra]) == 0
    text = capsys.readouterr().out
    assert "| length | mode |" in text
    assert (out / "throughput.png").stat().st_size > 10_000 and (out / "table.md").is_file()
    return [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]


def test_model_engine_gain_grows_with_length(tmp_path, capsys):
    points = run(tmp_path, capsys, small(tmp_path, "glm5-h200", lengths=[40000, 120000], requests=128, sessions=32,
                                         kv_dtype="bf16"))
    assert {p["kind"] for p in points} == {"modelled"} and {p["kv_dtype"] for p in points} == {"bf16"}
    gain = {p["length"]: p["gain_pct"] for p in points if p["mode"] == "layersplit"}
    assert gain[120000] > gain[40000]
    red = {p["length"]: p for p in points if p["mode"] == "redundant"}
    assert red[120000]["hit_L1"] < red[40000]["hit_L1"]  # fewer long sessions stay resident
    assert "modelled" in (tmp_path / "out" / "table.md").read_text()


@pytest.mark.timeout(900)  # eight paired repeats on 2 shared cores
@pytest.mark.slow
def test_real_engine_default_config_shape(tmp_path, capsys):
    from layersplit.serving.paired import median_interval

    points = run(tmp_path, capsys, small(tmp_path, "cpu", lengths=[40000], requests=6, sessions=3))
    assert {p["kind"] for p in points} == {"measured"} and len(points) == 2
    ls = [p for p in points if p["mode"] == "layersplit"][0]
    assert ls["bcast_bytes_per_rank"] > 0 and ls["request_tokens_per_s"] > 0
    assert sum(ls["batch_sizes"]) == 6
    for p in points:  # each mode's own median over its repeats (an even count: both orders equally often)
        n = p["repeats"]
        assert n % 2 == 0 and len(p["seconds_runs"]) == n
        assert 1 / p["seconds"] == pytest.approx(statistics.median(1 / t for t in p["seconds_runs"]))
    red = points[0]
    ratios = [100 * (r / s - 1) for r, s in zip(red["seconds_runs"], ls["seconds_runs"])]  # same tokens
    assert ls["paired_gain"]["ratios"] == pytest.approx(ratios)
    g = median_interval(ratios)  # the median of the paired ratios, with its order-statistic interval
    assert ls["gain_vs_redundant"] == pytest.approx(g["median"])
    assert (ls["paired_gain"]["low"], ls["paired_gain"]["high"]) == pytest.approx((g["low"], g["high"]))
    assert ls["gain_within_noise"] == (g["low"] <= 0 <= g["high"])
    table = (tmp_path / "out" / "table.md").read_text()
    assert "**Counted** columns first" in table and f"median of {n} paired ratios [" in table
    assert "kv-sharding" in (tmp_path / "out" / "model" / "table.md").read_text()  # the modelled table beside it


def test_paired_order_and_gains():
    """Modes alternate per repeat (A B, B A, A B); a gain is the median of per-repeat ratios."""
    from layersplit.serving.paired import alternating, paired_gains

    assert alternating(("redundant", "layersplit"), 3) == ["redundant", "layersplit", "layersplit", "redundant",
                                                           "redundant", "layersplit"]
    g = paired_gains({"redundant": [10.0, 20.0, 12.0], "layersplit": [5.0, 25.0, 8.0]},
                     {"redundant": 100, "layersplit": 100}, "redundant")
    assert g["layersplit"]["ratios"] == pytest.approx([100.0, -20.0, 50.0])
    assert (g["layersplit"]["median"], g["layersplit"]["low"], g["layersplit"]["high"]) == pytest.approx((50, -20, 100))
    assert g["redundant"]["ratios"] == [0.0, 0.0, 0.0]


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="field 'engine': expected one of"):
        load_sweep(small(tmp_path, "cpu", engine="simulated"))
    with pytest.raises(ConfigError, match="field 'lengths': expected a non-empty list"):
        load_sweep(small(tmp_path, "cpu", lengths=[]))
    with pytest.raises(ConfigError, match="sweep 'nope': expected one of"):
        load_sweep("nope")
    # the CP engine has no page striping: that ownership is the model's only
    with pytest.raises(ConfigError, match=r"field 'ownership': expected one of \('contiguous', 'round-robin'\)"):
        load_sweep(small(tmp_path, "cpu", ownership="round-robin-striped"))
    assert load_sweep(small(tmp_path, "glm5-h200", ownership="round-robin-striped")).ownership == "round-robin-striped"
    with pytest.raises(ConfigError, match=r"field 'context_len': expected >= the longest length \(120000\)"):
        load_sweep(small(tmp_path, "glm5-h200", context_len=65536))


def test_model_sweep_every_peer_breakdown_and_labels(tmp_path, capsys):
    """All eight modes at fp8 and the seven with a bf16 layout at bf16 (KV sharding as shipped is fp8
    only), each dtype against itself; gains over redundant, upstream's layer split and KV sharding per
    point; the breakdown adds up to the batch time; the shared host pools the ranks' host budgets;
    upstream broadcasts the whole pool-sized layer, the row modes only the batch's rows, KV sharding
    gathers (N - 1) / N of its padded span; the sensitivity and calibration tables are printed."""
    points = run(tmp_path, capsys, small(tmp_path, "glm5-h200", lengths=[40000, 120000], requests=96, sessions=24))
    modes = ["redundant", "redundant-shared-host", "upstream-layersplit", "kv-sharding", "kv-sharding-shipped",
             "query-moving", "sglang-plugin", "layersplit"]
    groups = [(p["length"], p["kv_dtype"]) for p in points]  # length by length, each with both dtypes
    assert sorted(set(groups), key=groups.index) == [(40000, "fp8"), (40000, "bf16"), (120000, "fp8"), (120000, "bf16")]
    for length, dtype in ((40000, "fp8"), (40000, "bf16"), (120000, "fp8"), (120000, "bf16")):
        at = {p["mode"]: p for p in points if p["length"] == length and p["kv_dtype"] == dtype}
        assert list(at) == [m for m in modes if dtype == "fp8" or m != "kv-sharding-shipped"]
        for p in at.values():
            assert p["kind"] == "modelled" and p["reusable_fraction"] == pytest.approx(0.9)
            assert p["gain_vs_redundant"] == pytest.approx(
                100 * (p["request_tokens_per_s"] / at["redundant"]["request_tokens_per_s"] - 1))
            assert p["gain_vs_upstream"] == pytest.approx(
                100 * (p["request_tokens_per_s"] / at["upstream-layersplit"]["request_tokens_per_s"] - 1))
            parts = p["compute_s"] + p["recompute_s"] + p["exposed_reload_s"] + p["exposed_comm_s"]
            assert parts == pytest.approx(p["seconds"], rel=1e-9)
            assert abs(p["hit_L1"] + p["hit_L2"] + p["miss"] - 1) < 1e-9
        assert at["redundant-shared-host"]["l2_tokens_per_rank"] // 8 == at["redundant"]["l2_tokens_per_rank"]  # one copy per node
        assert at["upstream-layersplit"]["bcast_bytes_per_rank"] > 5 * at["layersplit"]["bcast_bytes_per_rank"] > 0
        assert at["redundant"]["bcast_bytes_per_rank"] == 0
        assert at["layersplit"]["gain_vs_kv_sharding"] == pytest.approx(
            100 * (at["layersplit"]["request_tokens_per_s"] / at["kv-sharding"]["request_tokens_per_s"] - 1))
        assert at["kv-sharding"]["l1_tokens_per_rank"] > at["layersplit"]["l1_tokens_per_rank"]
        assert at["layersplit"]["l1_tokens_per_rank"] > at["upstream-layersplit"]["l1_tokens_per_rank"]
        # query-moving: owned layers, no history moved, the owner attends for all 8 ranks
        qm = at["query-moving"]
        assert qm["l1_tokens_per_rank"] < at["layersplit"]["l1_tokens_per_rank"]  # its receive slots
        assert qm["owner_wait_s"] > 0 and qm["request_tokens_per_s"] < at["layersplit"]["request_tokens_per_s"]
        assert qm["bcast_bytes_per_rank"] > 10 * at["layersplit"]["bcast_bytes_per_rank"]  # 9 cached tokens per new one
        for p in at.values():  # one deterministic modelled run: no repeats, no spread, no noise to be within
            assert not {"repeats", "seconds_runs", "spread_pct", "gain_within_noise"} & set(p), p
    table = (tmp_path / "out" / "table.md").read_text()
    assert "vs upstream split" in table and "exposed reload" in table and "modelled" in table
    header = next(line for line in table.splitlines() if line.startswith("| length | mode |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "request tokens/s (modelled)" in columns and "spread" not in header and "0% of 1" not in table
    assert "req tok/s" not in table and "tok/s" not in header.replace("request tokens/s", "")
    counts = [c for c in columns if c.endswith(("(GB)", "tokens", "tokens/rank")) or c.startswith("batches")]
    assert len(counts) == 5 and all("/rank" in c or "/run" in c for c in counts), counts  # per rank or per run
    assert all("modelled" in c for c in columns if "(s" in c or "/s" in c)  # every rate and time says modelled
    assert "vs kv-sharding" in table and "Sensitivity (**modelled**)" in table and "Calibration (**model**" in table
    assert table.count("- 40k: vs redundant") == 1 and "- 120k: vs redundant" in table
    assert "**KV fp8**" in table and "**KV bf16**" in table and "so it has no bf16 row" in table
    assert "Query-moving peer per layer (**modelled**" in table and "Where it would win (**modelled**)" in table


def test_points_written_as_lengths_finish(tmp_path, capsys, monkeypatch):
    """An interrupted sweep keeps the lengths it finished: points.jsonl grows length by length."""
    from layersplit.serving import sweep

    seen = []
    real = sweep.run_sweep

    def spy(cfg, progress=None, on_length=None, **other):
        if on_length is None:  # the sensitivity's own runs
            return real(cfg, progress, **other)

        def hook(points):
            on_length(points)
            seen.append(len((tmp_path / "out" / "points.jsonl").read_text().splitlines()))
        return real(cfg, progress, hook, **other)

    monkeypatch.setattr(sweep, "run_sweep", spy)
    run(tmp_path, capsys, small(tmp_path, "glm5-h200", lengths=[40000, 80000], requests=32, sessions=8))
    assert seen == [15, 30]  # 8 fp8 rows + 7 bf16 rows a length


def test_progress_counts_every_point_of_every_kv_dtype(tmp_path, capsys, monkeypatch):
    """The bar is sized by the points the sweep yields: per length 8 fp8 rows and 7 bf16 rows (KV sharding as
    shipped runs fp8 only), not modes x lengths; the measured engine runs its two modes at one dtype."""
    import tqdm

    from layersplit.serving.sweep import point_count

    bars = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.n = total, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.n += n

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    config = small(tmp_path, "glm5-h200", lengths=[40000, 80000, 120000], requests=24, sessions=6)
    points = run(tmp_path, capsys, config)
    assert {p["kv_dtype"] for p in points} == {"fp8", "bf16"}
    (bar,) = bars
    assert bar.total == bar.n == len(points) == 3 * (8 + 7) == point_count(load_sweep(config))
    assert point_count(load_sweep(small(tmp_path, "cpu", lengths=[40000, 80000, 120000]))) == 3 * 2


def test_gain_map(tmp_path, capsys):
    cfg = small(tmp_path, "glm5-h200", lengths=[40000, 120000], requests=64, sessions=16)
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(cfg), "--out", str(out), "--map", "sessions=8,32"]) == 0
    rows = [json.loads(line) for line in (out / "gain_map.jsonl").read_text().splitlines()]
    assert [(r["sessions"], r["kv_dtype"], r["length"]) for r in rows] == [
        (v, d, n) for v in (8, 32) for d in ("fp8", "bf16") for n in (40000, 120000)]
    assert all({"gain_vs_redundant", "gain_vs_upstream-layersplit", "gain_vs_redundant-shared-host",
                "gain_vs_query-moving", "gain_vs_best_available_peer"} <= set(r) for r in rows)
    assert {r["best_available_peer"] for r in rows} <= {"redundant", "redundant-shared-host", "upstream-layersplit"}
    assert all(r["layersplit_request_tokens_per_s"] > 0 for r in rows)  # the project's name for the rate
    for r in rows:
        assert ("gain_vs_kv-sharding-shipped" in r) == (r["kv_dtype"] == "fp8")
    text = (out / "gain_map.md").read_text()
    assert "vs upstream-layersplit" in text and text.count("*") >= 2 and "(modelled)" in text
    assert "### KV fp8" in text and "### KV bf16" in text
    assert "**vs kv-sharding-shipped -- NOT AVAILABLE on h200 (SM 9): a design bar, never the peer to beat**" in text
    assert text.count("**vs the best available peer") == 2 and "(upstream-layersplit)" in text
    assert (out / "gain_map.png").stat().st_size > 20_000
    capsys.readouterr()
    assert main(["sweep", "--config", str(cfg), "--out", str(out), "--map", "tokens=1"]) == 2
    assert "--map: expected 'sessions=N,N,...' or 'host_gb=G,G,...', got 'tokens=1'" in capsys.readouterr().err
