"""The CP engine under the stream-ordering sanitizer (``LAYERSPLIT_SANITIZE=1`` in the rank processes).

Clean: CP 1, 2 and 4, both modes, with and without prefixes reloaded from the host tier, bf16 and fp8
KV, report no hazard and match the single-process reference of the same KV dtype (``agreement``: 1e-4
of the scale here, where a row's projection and so its fp8 bytes do not depend on the batch; the
measured floor where they do). The new rows' all-gather moves each rank's rows as the caches store
them: its bytes per layer follow :mod:`dsa_kernels.layout` exactly, smaller at fp8 by the ratio the
layout gives (the KV part by ``mla_row_bytes`` fp8 / bf16, the indexer keys the same). Teeth: each stream
edge of the engine, removed alone (``FaultInjection.unsafe_skip_edges``), is reported on every run,
with no stall and no timing:
the comm stream not waiting for compute, collective buffers without ``record_stream``, a scratch
slot refilled before its reader finished (its release event and the issue-time wait both removed:
either orders it), the host-tier reload racing the poison fill, and the new rows landed from the
all-gather's buffer before compute waited for the all-gather (CUDA's own sanitizer cannot see that
one: gloo writes the buffer from its worker thread, NCCL outside aten).
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from dsa_kernels.layout import PAGE_SIZE, index_page_bytes, mla_row_bytes
from layersplit.engine.batch_plan import Request, plan_batch
from layersplit.plan.config import load_model
from layersplit.engine.engine import EngineConfig, FaultInjection
from layersplit.engine.launcher import Scenario, run_cp, run_reference
from tests.layersplit.engine.agreement import assert_matches_reference

TINY = load_model("tiny")
ROW = {d: mla_row_bytes(TINY.kv_lora_rank, TINY.qk_rope_head_dim, d) for d in ("bf16", "fp8")}


def toks(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


DEVICE_PREFIX = [Request(130, toks(21, 3)), Request(0, toks(9, 4))]  # prefix pages end mid-page
HOST_PREFIX = [Request(300, toks(40, 11), from_host=True), Request(150, toks(25, 12))]


def _cfg(cp: int, mode: str = "layersplit", skip: frozenset[str] = frozenset(), kv_dtype: str = "bf16") -> EngineConfig:
    return EngineConfig(mode=mode, cp=cp, pool_pages=32, max_batch_tokens=1024, max_requests=4, kv_dtype=kv_dtype,
                        faults=FaultInjection(unsafe_skip_edges=skip))


def clean_scenarios(cp: int, kv_dtype: str) -> list[Scenario]:
    return [Scenario(f"{mode}/{name}/{kv_dtype}", reqs, _cfg(cp, mode, kv_dtype=kv_dtype))
            for mode in ("redundant", "layersplit") for name, reqs in (("device", DEVICE_PREFIX), ("host", HOST_PREFIX))]


TEETH = {  # name: (edges removed, requests, what the report must name)
    "compute_wait": ({"compute_wait"}, DEVICE_PREFIX, ("stream comm", "stream compute", "c10d::allgather_")),
    "record_stream": ({"record_stream"}, DEVICE_PREFIX, ("allocator-reuse", "stream comm", "comm.py")),
    "slot_release": ({"slot_release", "compute_wait"}, DEVICE_PREFIX,
                     ("c10d::broadcast_", "stream compute", "sparse_mla_prefill")),
    "poison_fence": ({"poison_fence"}, HOST_PREFIX, ("stream load", "fill_pages", "copy_layer_part")),
    "allgather_wait": ({"allgather_wait"}, DEVICE_PREFIX, ("stream comm", "stream compute", "new_rows.py")),
}


@lru_cache(maxsize=None)
def run(cp: int, teeth: bool = False, kv_dtype: str = "bf16"):
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERSPLIT_SANITIZE", "1")  # read by the spawned rank processes
    try:
        scs = clean_scenarios(cp, kv_dtype) if not teeth else [
            Scenario(f"{name}/{rep}", reqs, _cfg(cp, skip=frozenset(skip)))
            for name, (skip, reqs, _) in TEETH.items() for rep in range(2)]
        return {sc.name: (sc, res) for sc, res in zip(scs, run_cp(TINY, scs, cp))}
    finally:
        mp.undo()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.slow
def test_engine_clean_under_the_sanitizer(cp, kv_dtype):
    for name, (sc, res) in run(cp, kv_dtype=kv_dtype).items():
        hazards = sorted({h for r in res.ranks for h in r.hazards})
        assert hazards == [], f"{name}:\n" + "\n".join(hazards)
        assert_matches_reference(TINY, sc, res, run_reference(TINY, sc), name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(TEETH))
@pytest.mark.slow
def test_teeth_engine_edge_removed_is_reported(name):
    runs = run(2, teeth=True)
    must = TEETH[name][2]
    found = []
    for rep in range(2):
        hazards = {h for r in runs[f"{name}/{rep}"][1].ranks for h in r.hazards}
        hit = [h for h in hazards if all(word in h for word in must)]
        assert hit, f"{name} (run {rep}): expected a hazard naming {must}, got:\n" + "\n".join(sorted(hazards))
        found.append(sorted(hit))
    assert found[0] == found[1], "the same missing edge must give the same report on every run"


def allgather_bytes(sc: Scenario, layer: int) -> tuple[int, int]:
    """(all, KV part) bytes a rank receives in ``layer``'s all-gather, from the layout: every other rank's
    send buffer, sized for the largest rank's rows (KV rows, then indexer keys in whole pages)."""
    plan = plan_batch(sc.requests, lambda n: list(range(n)), sc.cfg.cp, sc.cfg.split)
    rows = max(len(idx) for idx in plan.local)
    kv = rows * mla_row_bytes(TINY.kv_lora_rank, TINY.qk_rope_head_dim, sc.cfg.kv_dtype)
    keys = -(-rows // PAGE_SIZE) * index_page_bytes(TINY.index_head_dim) if TINY.has_indexer(layer) else 0
    return (sc.cfg.cp - 1) * (kv + keys), (sc.cfg.cp - 1) * kv


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.slow
def test_fp8_allgather_moves_fewer_bytes_by_the_layout_ratio(cp):
    runs = {d: run(cp, kv_dtype=d) for d in ("bf16", "fp8")}
    for name, (sc, res) in runs["fp8"].items():
        bf16_sc, bf16 = runs["bf16"][name.replace("fp8", "bf16")]
        for f, b in zip(res.ranks, bf16.ranks):
            if cp == 1:  # one rank: nothing gathered
                assert f.allgather_bytes == b.allgather_bytes == {}, name
                continue
            for layer in range(TINY.num_layers):
                want_f, want_b = allgather_bytes(sc, layer), allgather_bytes(bf16_sc, layer)
                assert (f.allgather_bytes[layer], f.allgather_kv_bytes[layer]) == want_f, (name, layer)
                assert (b.allgather_bytes[layer], b.allgather_kv_bytes[layer]) == want_b, (name, layer)
                # fp8 / bf16 is the layout's ratio, below 1; the KV part's is the MLA rows' (656 / 1152 at GLM-5)
                assert want_f[0] < want_b[0]
                assert f.allgather_bytes[layer] * want_b[0] == b.allgather_bytes[layer] * want_f[0]
                assert f.allgather_kv_bytes[layer] * ROW["bf16"] == b.allgather_kv_bytes[layer] * ROW["fp8"]
