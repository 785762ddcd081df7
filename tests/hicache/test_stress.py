"""The read-before-ready stress harness proves itself: 0 corruptions with every wait in place, and
corruption detected when a wait (or the page-reuse fence) is switched off. Short seeded mode; the
long mode is ``layersplit stress hicache --iterations 100000``."""

from __future__ import annotations

import json

import pytest

from hicache.stress import StressConfig, run_stress
from layersplit.cli.app import main
from layersplit.engine.cp_pool import cache_spec
from layersplit.plan.config import load_model

LOADS = 2000  # layer loads per run (8 tiny layers per batch -> 250 batches)


def tiny_run(unsafe: set[str], seed: int = 0, loads: int = LOADS):
    model = load_model("tiny")
    cfg = StressConfig(layer_loads=loads, seed=seed, unsafe_skip=frozenset(unsafe),
                       index_heads=model.index_n_heads, attn_heads=model.num_heads, topk=model.index_topk)
    return run_stress(cache_spec(model), cfg)


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_with_waits_no_corruption():
    r = tiny_run(set())
    assert r.layers_loaded >= LOADS and r.outputs_checked == r.layers_loaded
    assert r.corrupted_outputs == 0 and r.poisoned_reads == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("unsafe", [{"indexer"}, {"kv"}, {"fence"}], ids=["skip-indexer", "skip-kv", "skip-fence"])
@pytest.mark.slow
def test_without_a_safeguard_corruption_is_detected(unsafe):
    r = tiny_run(unsafe)
    print(f"unsafe_skip={sorted(unsafe)}: {r.corrupted_outputs}/{r.outputs_checked} corrupted "
          f"(rate {r.corruption_rate:.4f}), {r.poisoned_reads} poisoned reads")
    assert r.corrupted_outputs > 0


def test_cli_json_and_exit_codes(capsys):
    assert main(["stress", "hicache", "--iterations", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layers_loaded"] == 40 and report["corrupted_outputs"] == 0
    assert report["unsafe_skip"] == [] and report["runtime"] in ("emulated", "cuda")
    assert main(["stress", "hicache", "--unsafe-skip-wait", "everything"]) == 2


def test_staging_is_asynchronous():
    """The batch inputs reach the device as non-blocking copies from pinned (host-memory) staging
    buffers: no host sync in ``stage``, so the host keeps queueing ahead and the race windows stay
    open. The counter is live on the forward stream's worker: it sees the check's blocking D2H."""
    from hicache.runtime.syncs import SyncCounter

    with SyncCounter() as guard:
        r = tiny_run(set(), loads=24)
    assert r.corrupted_outputs == 0
    assert [s for s in guard.sites() if "(stage)" in s[1]] == []
    assert any(what.startswith(".cpu()") and "(_check)" in where for what, where in guard.sites()), guard.sites()
