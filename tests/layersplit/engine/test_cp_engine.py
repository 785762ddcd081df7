"""CP prefill engine on real rank processes (gloo) against the single-process reference.

One spawn per CP size runs every scenario (both modes) in order, to keep process start-up cost low.
Tolerance: the CP ranks run the same fp32 ops as the reference on row subsets of the same inputs, and
every cache row travels as the bytes its own rank stored (new rows all-gathered in cache precision,
prefixes broadcast as raw bytes). On a CPU the GEMMs give a row the same values whatever the batch (to
fp32's last bits where BLAS blocks differently), so we allow 1e-4 of the activations' scale (fp32 has
~1e-7) and require no NaN; beyond that the device's measured row-split floor decides (``agreement``:
what a GPU, whose GEMMs depend on the row count, is held to).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch

from layersplit.engine.batch_plan import Request
from layersplit.plan.config import ALL_LAYERS, load_model
from layersplit.engine.engine import EngineConfig, FaultInjection
from layersplit.engine.launcher import Scenario, run_cp, run_reference
from layersplit.plan.ownership import plan_ownership
from tests.layersplit.engine.agreement import assert_matches_reference

TINY = load_model("tiny")  # indexer on layers 0, 1, 3, 5, 7 only: GLM-5.2-style
TINY_ALL_INDEXER = dataclasses.replace(TINY, name="tiny-all-indexer", indexer_layers=ALL_LAYERS)


def toks(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


CASES = {
    "prefix-0": ([Request(0, toks(50, 1))], {}),
    "prefix-unaligned": ([Request(100, toks(37, 2))], {}),
    "several-requests": ([Request(130, toks(21, 3)), Request(0, toks(9, 4)), Request(64, toks(70, 5))], {}),
    "topk-above-context": ([Request(10, toks(20, 6))], {}),  # context 30 < top-k 64
    "round-robin": ([Request(129, toks(40, 7)), Request(63, toks(11, 8))], {"ownership": "round-robin"}),
    "interleave-split": ([Request(200, toks(33, 9))], {"split": "interleave"}),
    "all-layers-indexer": ([Request(90, toks(45, 10))], {"model": TINY_ALL_INDEXER}),
}


def scenarios(cp: int) -> list[Scenario]:
    out = []
    for mode in ("redundant", "layersplit"):
        for name, (reqs, extra) in CASES.items():
            extra = dict(extra)
            model = extra.pop("model", None)
            cfg = EngineConfig(mode=mode, cp=cp, pool_pages=32, max_batch_tokens=1024, max_requests=4, **extra)
            out.append(Scenario(f"{mode}/{name}", reqs, cfg, model))
    # same batch, 4x the pool: broadcast bytes must not change
    big = EngineConfig(mode="layersplit", cp=cp, pool_pages=128, max_batch_tokens=1024, max_requests=4)
    out.append(Scenario("layersplit/several-requests/big-pool", CASES["several-requests"][0], big))
    # the old single-FIFO schedule: the overlap test's teeth
    legacy = dataclasses.replace(big, pool_pages=32, schedule="legacy")
    out.append(Scenario("legacy/several-requests", CASES["several-requests"][0], legacy))
    return out


@lru_cache(maxsize=None)
def run(cp: int) -> dict[str, tuple]:
    scs = scenarios(cp)
    results = run_cp(TINY, scs, cp)
    return {sc.name: (sc, res, run_reference(TINY, sc)) for sc, res in zip(scs, results)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", ["redundant", "layersplit"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_matches_single_process_reference(cp, mode, case):
    sc, res, ref = run(cp)[f"{mode}/{case}"]
    assert res.hidden.shape == (sum(len(r.new_tokens) for r in sc.requests), TINY.hidden_size)
    assert_matches_reference(sc.model or TINY, sc, res, ref, sc.name)


@pytest.mark.parametrize("cp", [2, 4])
def test_broadcast_bytes_are_rows_read_times_row_bytes(cp):
    runs = run(cp)
    sc, res, _ = runs["layersplit/several-requests"]
    _, big, _ = runs["layersplit/several-requests/big-pool"]
    prefix_pages = sum(-(-r.prefix_len // 64) for r in sc.requests)
    rows = prefix_pages * 64  # rows the batch reads from the cache, at page granularity
    model = sc.model or TINY
    kv_row, index_row = 2 * (model.kv_lora_rank + model.qk_rope_head_dim), model.index_head_dim + 4
    for rank in res.ranks:
        expected = {layer: rows * (kv_row + (index_row if model.has_indexer(layer) else 0))
                    for layer in range(model.num_layers)}
        assert rank.bcast_bytes == expected
    assert [r.bcast_bytes for r in big.ranks] == [r.bcast_bytes for r in res.ranks], "must not depend on pool size"
    _, red, _ = runs["redundant/several-requests"]
    assert all(r.bcast_bytes == {} for r in red.ranks)


@pytest.mark.parametrize("cp", [2, 4])
def test_layersplit_allocates_fewer_kv_bytes(cp):
    runs = run(cp)
    red = [r.kv_bytes["total"] for r in runs["redundant/prefix-0"][1].ranks]
    ls = runs["layersplit/prefix-0"][1].ranks
    page = {layer: 64 * 2 * 144 + (64 * 36 if TINY.has_indexer(layer) else 0) for layer in range(8)}
    own = plan_ownership(TINY.num_layers, cp, "contiguous")
    for r in ls:
        assert r.kv_bytes["owned"] == 32 * sum(page[layer] for layer in own.owned_layers(r.rank))
        assert r.kv_bytes["total"] < red[r.rank]
        assert r.kv_bytes["scratch"] == 2 * (1024 // 64 + 4) * max(page.values())
    assert red[0] == 32 * sum(page.values())
    print(f"CP{cp} per-rank KV bytes (pool of 32 pages): redundant {red}, "
          f"layersplit {[r.kv_bytes for r in ls]}")


def _events(trace: list[dict], rank: int) -> dict[str, dict]:
    return {e["name"]: e for e in trace if e["pid"] == rank}


@pytest.mark.parametrize("cp", [2, 4])
def test_trace_schedule(cp):
    """For each non-owner rank and indexer layer: the KV broadcast was issued before the indexer
    started and waited on only after it ended; layer l+1's index broadcast was issued before
    layer l's MLP."""
    sc, res, _ = run(cp)["layersplit/several-requests"]
    own = plan_ownership(TINY.num_layers, cp, sc.cfg.ownership)
    checked = 0
    for rank in res.ranks:
        ev = _events(rank.trace, rank.rank)
        for layer in range(TINY.num_layers):
            if layer + 1 < TINY.num_layers:
                nxt = "index" if TINY.has_indexer(layer + 1) else "kv"
                assert ev[f"issue bcast_{nxt}[{layer + 1}]"]["ts"] < ev[f"mlp[{layer}]"]["ts"]
            if own.owner[layer] == rank.rank or not TINY.has_indexer(layer):
                continue
            indexer, wait_kv = ev[f"indexer[{layer}]"], ev[f"wait bcast_kv[{layer}]"]
            assert ev[f"issue bcast_kv[{layer}]"]["ts"] < indexer["ts"]
            assert wait_kv["ts"] >= indexer["ts"] + indexer["dur"]
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("cp", [2, 4])
def test_kv_broadcast_overlaps_indexer(cp):
    """In the issued program's happens-before order, on every non-owned layer the indexer does not
    wait for the layer's KV broadcast and sparse attention does (whatever the machine's timing)."""
    sc, res, ref = run(cp)["layersplit/several-requests"]
    own = plan_ownership(TINY.num_layers, cp, sc.cfg.ownership)
    for rank in res.ranks:
        non_owned = [layer for layer in range(TINY.num_layers) if own.owner[layer] != rank.rank]
        assert sorted(rank.kv_order) == non_owned
        for layer in non_owned:
            want = {"indexer": False, "attention": True} if TINY.has_indexer(layer) else {"attention": True}
            assert rank.kv_order[layer] == want, (rank.rank, layer)
    assert_matches_reference(TINY, sc, res, ref, sc.name)


@pytest.mark.parametrize("cp", [2, 4])
def test_legacy_fifo_schedule_fails_the_overlap_check(cp):
    """Teeth: on one FIFO comm stream the all-gather the indexer waits for queues behind the KV
    broadcast, so every non-owned indexer layer's indexer happens after the broadcast."""
    sc, res, ref = run(cp)["legacy/several-requests"]
    indexed = [order for rank in res.ranks for layer, order in rank.kv_order.items() if TINY.has_indexer(layer)]
    assert indexed and all(order["indexer"] and order["attention"] for order in indexed)
    assert_matches_reference(TINY, sc, res, ref, sc.name)


@lru_cache(maxsize=None)
def coherence_run(unsafe: bool):
    reqs = [Request(300, toks(40, 11)), Request(150, toks(25, 12))]
    cfg = EngineConfig(mode="layersplit", cp=2, pool_pages=32, max_batch_tokens=1024, max_requests=4,
                       faults=FaultInjection(hicache_delay_s=0.02, unsafe_skip_coherence=unsafe))
    sc = Scenario("coherence", reqs, cfg)
    return sc, run_cp(TINY, [sc], 2)[0], run_reference(TINY, sc)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_reload_bytes_per_layer_follow_ownership():
    """Each rank reloads exactly its owned layers' prefix rows, per layer (the counters the sweep's
    reload-spread columns read): contiguous ownership puts all of a rank's reload in its first block."""
    _, res, _ = coherence_run(unsafe=False)
    own = plan_ownership(TINY.num_layers, 2, "contiguous")
    for rank in res.ranks:
        assert sorted(rank.reload_bytes_by_layer) == list(own.owned_layers(rank.rank))
        assert sum(rank.reload_bytes_by_layer.values()) == rank.reload_bytes > 0
        with_index = [b for layer, b in rank.reload_bytes_by_layer.items() if TINY.has_indexer(layer)]
        without = [b for layer, b in rank.reload_bytes_by_layer.items() if not TINY.has_indexer(layer)]
        assert all(b > max(without, default=0) for b in with_index)  # index keys travel too


@pytest.mark.timeout(300)
def test_hicache_coherence_wait_keeps_poison_away():
    sc, res, ref = coherence_run(unsafe=False)
    assert_matches_reference(TINY, sc, res, ref, sc.name)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_hicache_coherence_unsafe_flag_detected():
    _, res, ref = coherence_run(unsafe=True)
    bad = torch.isnan(res.hidden).any() or (res.hidden - ref.hidden).abs().max() > 1e-4 * ref.hidden.abs().max()
    assert bad, "broadcasting rows still loading from host must corrupt a non-owner's output"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_prefill_cli(tmp_path, capsys):
    from layersplit.cli.app import main
    import json

    trace = tmp_path / "trace.json"
    assert main(["prefill", "--cp", "2", "--mode", "layersplit", "--context-len", "300", "--hit", "0.5",
                 "--requests", "2", "--trace", str(trace), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["new_tokens"] == 300 and report["max_abs_deviation_vs_reference"] <= 1e-3
    assert report["new_tokens_per_s"] > 0 and len(report["kv_bytes_per_rank"]) == 2
    assert report["request_tokens_per_s"] == pytest.approx(report["new_tokens_per_s"] * 600 / 300)  # 2 x 300 context
    assert set(report["bcast_bytes_per_layer"]) == {str(x) for x in range(8)}
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e["name"] == "indexer[0]" for e in events)
    assert main(["prefill", "--cp", "2", "--mode", "layersplit", "--hit", "1.0"]) == 2
    assert "--hit: expected a number in [0, 1), got 1.0" in capsys.readouterr().err
