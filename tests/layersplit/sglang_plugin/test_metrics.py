"""The plug-in pool's operator metrics, read from the Prometheus exposition text (real sglang, CPU)."""

from __future__ import annotations

import os
import re

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import hicache  # noqa: E402
from layersplit.sglang_plugin.metrics import PoolMetrics  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import (  # noqa: E402
    LAYERS, NEW_PAGES, PAGE, PREFIX_PAGES, SIZE, dsa_pool_kwargs, forward_layers, published, write_prefix)


def value(text: str, name: str, label: str) -> float:
    match = re.search(rf'^{name}{{\w+="{label}"}} (\S+)$', text, re.M)
    assert match, f"{name}{{{label}}} missing from:\n{text}"
    return float(match.group(1))


def test_exposition_counts_what_the_pool_did(monkeypatch):
    """One forward on rank 1 of 2 (the collective left out: one process stands for both ranks), with
    SGLang's load counter replaced by ours: bytes by part, waits by kind, an admission deferral, and
    the tokens held against upstream's layout."""
    from layersplit.sglang_plugin import metrics

    monkeypatch.setenv("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "256")  # the batch's four pages, not the whole pool
    fresh = PoolMetrics()
    monkeypatch.setattr(metrics, "_shared", fresh)
    with published(world=2):
        pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=1, layer_shard_size=2)
        write_prefix(pool)
        pool._broadcast_tensor_from_owner = lambda tensor, *a, **k: tensor
        counter = hicache.make_counter_class()(LAYERS)
        counter.set_consumer(0)
        pool.register_layer_transfer_counter(counter)
        pool.set_forward_pages(torch.tensor(PREFIX_PAGES + NEW_PAGES), new_pages=torch.tensor(NEW_PAGES))
        forward_layers(pool, seed=1)
    from sglang.srt.managers.schedule_policy import AddReqResult
    from types import SimpleNamespace as NS

    from layersplit.sglang_plugin import sharing, startup

    startup.publish(startup.Plan("batch", (), 2, PAGE, 576 * 2, PAGE * 132))
    try:  # a second request of 2 pages beside one of 2 outgrows a 2-page slot: held for the next batch
        req = NS(rid="b", last_node=None, prefix_len=0, full_untruncated_fill_ids=[0] * PAGE)
        adder = NS(can_run_list=[NS(rid="a", last_node=None, prefix_len=0, full_untruncated_fill_ids=[0] * PAGE)])
        assert sharing.around_add_one_req(None, adder, req, False, None) == AddReqResult.OTHER
    finally:
        startup.forget()
    text = fresh.to_prometheus()
    pages = len(set(PREFIX_PAGES + NEW_PAGES))
    assert value(text, "layersplit_broadcast_bytes_total", "kv") == LAYERS * pages * PAGE * 576 * 2
    assert value(text, "layersplit_broadcast_bytes_total", "index_prefix") == LAYERS * 2 * PAGE * 132
    assert value(text, "layersplit_broadcast_bytes_total", "index_new") == LAYERS * 2 * PAGE * 132
    assert value(text, "layersplit_admission_deferrals_total", "slot") == 1
    assert value(text, "layersplit_forward_waits_total", "kv_ready") >= LAYERS  # attention: whole layer
    assert value(text, "layersplit_forward_waits_total", "index_ready") >= LAYERS  # indexer: its keys
    assert value(text, "layersplit_forward_wait_seconds_total", "kv_ready") >= 0
    assert "# TYPE layersplit_kv_pool_tokens gauge" in text
    assert value(text, "layersplit_kv_pool_tokens", "plugin") == SIZE
    assert 0 < value(text, "layersplit_kv_pool_tokens", "upstream") < SIZE  # its landing layer costs tokens
