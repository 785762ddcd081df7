"""The CP engine under the stream-ordering sanitizer (``LAYERSPLIT_SANITIZE=1`` in the rank processes).

Clean: CP 1, 2 and 4, both modes, with and without prefixes reloaded from the host tier, bf16 and fp8
KV, report no hazard and match the single-process reference of the same KV dtype (fp8: every rank
and the reference quantize a row to the same bytes, so the bf16 tolerance holds). Teeth: each stream
edge of the engine, removed alone (``FaultInjection.unsafe_skip_edges``), is reported on every run,
with no stall and no timing:
the comm stream not waiting for compute, collective buffers without ``record_stream``, a scratch
slot refilled before its reader finished (its release event and the issue-time wait both removed:
either orders it), and the host-tier reload racing the poison fill.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from layersplit.engine.batch_plan import Request
from layersplit.plan.config import load_model
from layersplit.engine.engine import EngineConfig, FaultInjection
from layersplit.engine.launcher import Scenario, run_cp, run_reference

TINY = load_model("tiny")


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
        ref = run_reference(TINY, sc)
        assert not torch.isnan(res.hidden).any()
        assert float((res.hidden - ref.hidden).abs().max()) <= 1e-4 * float(ref.hidden.abs().max()), name


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
