"""The ``stream_sanitizer`` section's verdict as it would be read on a GPU, built on a CPU: a clean
engine run under CUDA's sanitizer has 0 hazards (not None), an engine tooth counts only when a hazard
names the ops its missing edge leaves unordered (the slot release's tooth also drops the issue-time
wait, whose hazards alone must not pass for it), the reload path has its clean control, and the
stress's whole-buffer fence keeps the clean run clean and the reuse fence's tooth biting."""

from __future__ import annotations

import pytest

from layersplit.gpu_check import sanitize

CLEAN = {"hazards": 0, "hazard_list": [], "max_rel_deviation": 0.0, "tol": 1e-4, "backend": "gloo"}


def _out(**teeth_texts) -> dict:
    engine_teeth = {name: {"hazards": len(texts), "hazard_list": texts} for name, texts in teeth_texts.items()}
    return {"stress": {"hazards": 0}, "engine_cp2": dict(CLEAN), "engine_cp2_host": dict(CLEAN),
            "stress_teeth": {"fence": {"hazards": 2}, "indexer": {"hazards": 1}}, "engine_teeth": engine_teeth}


GOOD = {"compute_wait": ["... c10d::allgather_(...) ..."],
        "slot_release": ["... c10d::allgather_ ...", "... c10d::broadcast_ ... dsa_kernels::sparse_mla_prefill ..."],
        "poison_fence": ["... aten::copy_ ... in fill_pages ..."]}


def test_every_tooth_named_passes():
    v = sanitize.verdict(_out(**GOOD))
    assert v["passed"] and v["clean"] and all(v["teeth_reported"].values())


def test_slot_release_tooth_is_not_the_issue_time_wait():
    """Both edges removed: the all-gather's hazards (the compute_wait tooth's) are not the slot's."""
    v = sanitize.verdict(_out(**GOOD | {"slot_release": ["... c10d::allgather_ ..."] * 3}))
    assert not v["passed"] and v["teeth_reported"]["engine:slot_release"] is False


@pytest.mark.parametrize("run", ["engine_cp2", "engine_cp2_host"])
def test_clean_runs_must_be_clean_and_close(run):
    out = _out(**GOOD)
    out[run] = CLEAN | {"hazards": 1}
    assert not sanitize.verdict(out)["passed"]
    out[run] = CLEAN | {"max_rel_deviation": 1e-3}
    assert not sanitize.verdict(out)["passed"]
    out[run] = CLEAN | {"hazards": None}  # no sanitizer ran: never a pass
    assert not sanitize.verdict(out)["passed"]


def test_clean_engine_under_csan_counts_zero(monkeypatch):
    """Under CUDA's sanitizer a rank's result carries the hazards CSAN recorded (a list, maybe empty):
    the clean run reads 0, not None (the first review's false failure)."""
    from types import SimpleNamespace

    import torch

    from layersplit.engine import launcher

    res = SimpleNamespace(hidden=torch.ones(3, 4), ranks=[SimpleNamespace(hazards=[]), SimpleNamespace(hazards=[])])
    monkeypatch.setattr(launcher, "run_cp", lambda *a, **k: [res])
    monkeypatch.setattr(launcher, "run_reference", lambda *a, **k: SimpleNamespace(hidden=torch.ones(3, 4)))
    got = sanitize._engine(64, frozenset(), 30.0, 1e-4)
    assert got["hazards"] == 0 and got["max_rel_deviation"] == 0.0


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_stress_whole_buffer_fence_clean_and_the_fence_tooth_still_bites():
    """``fence_previous_forward`` (the CSAN run's setting) adds an ordering, never a hazard; with the
    reuse fences removed (which removes it too) the emulated sanitizer still reports the reuse."""
    from hicache.stress import StressConfig, run_stress
    from layersplit.engine.cp_pool import cache_spec
    from layersplit.plan.config import load_model

    model = load_model("tiny")
    base = dict(layer_loads=48, runtime="emulated", sanitize=True, max_delay_s=0.0, max_forward_delay_s=0.0,
                index_heads=model.index_n_heads, attn_heads=model.num_heads, topk=model.index_topk,
                fence_previous_forward=True)
    clean = run_stress(cache_spec(model), StressConfig(**base))
    assert clean.sanitizer_hazards == 0 and clean.corrupted_outputs == 0
    unsafe = run_stress(cache_spec(model), StressConfig(**base, unsafe_skip=frozenset({"fence"})))
    assert unsafe.sanitizer_hazards > 0


def test_vendor_warm_up_failure_fails_the_environment(monkeypatch):
    import torch

    from dsa_kernels import vendor
    from layersplit.gpu_check import run as gpu_run

    def broken(*args, **kwargs):
        raise RuntimeError("JIT build failed: nvcc not found")
    monkeypatch.setattr(vendor, "available", lambda: {"topk_indices": broken})
    assert gpu_run.warm_vendor(torch.device("cpu"))["topk_indices"].startswith("raised RuntimeError: JIT build failed")


def test_csan_hazards_kept_in_brief_with_both_kernels():
    from hicache.sanitizer import csan
    from torch.cuda import _sanitizer as torch_csan

    handler = torch_csan.cuda_sanitizer.dispatch.event_handler
    with csan.collecting() as found:
        handler._handle_kernel_launch(401, set(), {9301}, set(), "c10d::broadcast_(Tensor[] tensors) -> ()", {9301: ["tensors"]})
        handler._handle_kernel_launch(402, {9301}, set(), set(), "dsa_kernels::sparse_mla_prefill(Tensor kv_cache) -> ()", {9301: ["kv_cache"]})
    text = sanitize.brief(found[0])
    assert "c10d::broadcast_" in text and "dsa_kernels::sparse_mla_prefill" in text and len(text) < 600
    assert sanitize._names({"hazard_list": found}, ("broadcast_", "sparse_mla_prefill"))


def test_a_tooth_run_that_crashed_after_csan_saw_the_race_counts(monkeypatch):
    """A removed edge lets poison reach a kernel, which may then fail: the rank's error carries CSAN's
    first hazard, so the tooth is still reported (and matched by its ops)."""
    from layersplit.engine import launcher

    err = RuntimeError("rank 1 failed: ... after CUDA's sanitizer recorded 3 hazard(s); the first:\n"
                       "CSAN detected a possible data race ... c10d::broadcast_ ... dsa_kernels::sparse_mla_prefill")
    monkeypatch.setattr(launcher, "run_cp", lambda *a, **k: (_ for _ in ()).throw(err))
    got = sanitize._engine(64, frozenset({"slot_release", "compute_wait"}), 30.0, 1e-4)
    assert got["hazards"] == 1 and sanitize._names(got, ("broadcast_", "sparse_mla_prefill"))
