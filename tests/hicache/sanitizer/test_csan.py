"""CUDA's sanitizer recording every hazard instead of raising at the first (:mod:`hicache.sanitizer.csan`).

CSAN's analysis is device-independent bookkeeping over data pointers and stream ids, so its real
event handler is driven here directly, as its dispatch mode drives it for each CUDA kernel."""

from __future__ import annotations

import pytest
from torch.cuda import _sanitizer as torch_csan

from hicache.sanitizer import csan

WRITE = "dsa_kernels::pack_mla_kv(Tensor kv_c, Tensor k_pe, Tensor(a2!) kv_cache, Tensor slots) -> ()"
READ = "dsa_kernels::sparse_mla_prefill(Tensor q, Tensor kv_cache, Tensor indices, float sm_scale, SymInt kv_lora_rank) -> (Tensor, Tensor)"


def _launch(stream: int, read: set[int], write: set[int], op: str) -> list:
    handler = torch_csan.cuda_sanitizer.dispatch.event_handler
    return handler._handle_kernel_launch(stream, read, write, set(), op, {p: ["kv_cache"] for p in read | write})


def test_unordered_accesses_are_recorded_not_raised():
    assert len(_launch(101, set(), {9001}, WRITE)) == 0
    assert len(_launch(102, {9001}, set(), READ)) == 1  # torch's own handler: an error it would raise
    with csan.collecting() as found:
        assert _launch(103, set(), {9002}, WRITE) == [] and _launch(104, {9002}, set(), READ) == []
        assert _launch(105, set(), {9002}, WRITE) == []  # the run goes on: a second hazard is kept too
    assert len(found) == 2 and all("CSAN detected a possible data race" in h for h in found)
    assert "dsa_kernels::sparse_mla_prefill" in found[0] and "dsa_kernels::pack_mla_kv" in found[0]
    assert len(_launch(106, {9002}, set(), READ)) == 1  # outside: torch's raising behaviour is back


def test_active_only_when_requested(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_SANITIZER", raising=False)
    assert not csan.active()
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")
    assert csan.active() is torch_csan.cuda_sanitizer.enabled


def test_a_rank_under_csan_reports_what_it_recorded(monkeypatch):
    """The CUDA branch of ``launcher._run_rank``: the hazards CSAN recorded become the result's."""
    from contextlib import contextmanager

    from layersplit.engine import launcher
    from layersplit.gpu_check.run import _tiny_scenario

    @contextmanager
    def fake_collecting():
        yield ["CSAN detected a possible data race ... c10d::allgather_"]
    monkeypatch.delenv("LAYERSPLIT_SANITIZE", raising=False)
    monkeypatch.setattr(csan, "active", lambda: True)
    monkeypatch.setattr(csan, "collecting", fake_collecting)
    model, sc = _tiny_scenario(64)
    [result] = launcher._run_rank(model, [sc.__class__(sc.name, sc.requests, sc.cfg.__class__(cp=1, pool_pages=1,
                                                                                               max_batch_tokens=64, max_requests=1))], 0)
    assert result.hazards == ["CSAN detected a possible data race ... c10d::allgather_"]


@pytest.mark.parametrize("ordered", [True, False])
def test_an_event_edge_orders_the_accesses(ordered):
    """The record -> wait edge CSAN reads from CUDA's event API, driven directly: ordered, no hazard."""
    handler = torch_csan.cuda_sanitizer.dispatch.event_handler
    ptr, first, second, event = (9101, 201, 202, 77) if ordered else (9201, 301, 302, 78)  # fresh ids per case
    with csan.collecting() as found:
        _launch(first, set(), {ptr}, WRITE)
        if ordered:
            handler._handle_event_creation(event)
            handler._handle_event_record(event, first)
            handler._handle_event_wait(event, second)
        _launch(second, {ptr}, set(), READ)
    assert len(found) == (0 if ordered else 1)


def test_a_rank_that_fails_after_csan_recorded_says_what_it_saw(monkeypatch):
    from contextlib import contextmanager

    from layersplit.engine import engine as engine_mod
    from layersplit.engine import launcher
    from layersplit.gpu_check.run import _tiny_scenario

    @contextmanager
    def fake_collecting():
        yield ["CSAN detected a possible data race ... c10d::broadcast_ ... dsa_kernels::sparse_mla_prefill"]

    def fail(self, requests):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.delenv("LAYERSPLIT_SANITIZE", raising=False)
    monkeypatch.setattr(csan, "active", lambda: True)
    monkeypatch.setattr(csan, "collecting", fake_collecting)
    monkeypatch.setattr(engine_mod.RankEngine, "prefill", fail)
    model, sc = _tiny_scenario(64)
    with pytest.raises(RuntimeError, match=r"illegal memory access.*recorded 1 hazard\(s\); the first:\n"
                                           r"CSAN detected .*c10d::broadcast_"):
        launcher._run_rank(model, [sc], 0)
