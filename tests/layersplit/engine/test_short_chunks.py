"""Short chunks on wide CP groups: fewer new tokens than ranks leaves some ranks with none, which is
ordinary traffic in a prefill cluster. Every split of new tokens over ranks (zero included) runs and
matches the single-process reference (same tolerance as ``test_cp_engine``)."""

from __future__ import annotations

from functools import lru_cache

import pytest

from layersplit.engine.batch_plan import Request
from layersplit.engine.engine import EngineConfig
from layersplit.engine.launcher import Scenario, run_cp, run_reference
from layersplit.plan.config import load_model
from tests.layersplit.engine.agreement import assert_matches_reference

TINY = load_model("tiny")
COUNTS = {2: (1, 2, 3, 4), 4: (1, 3, 5, 8), 8: (1, 7, 9, 16)}  # new tokens: < cp, = cp - 1, > cp, 2 cp


def scenarios(cp: int) -> list[Scenario]:
    cfg = dict(cp=cp, pool_pages=8, max_batch_tokens=256, max_requests=2)
    return [Scenario(f"{mode}/{n}", [Request(70, tuple(range(1, n + 1)))], EngineConfig(mode=mode, **cfg))
            for n in COUNTS[cp] for mode in ("layersplit", "redundant")]


@lru_cache(maxsize=None)
def run(cp: int) -> dict:
    scs = scenarios(cp)
    return {sc.name: (sc, res, run_reference(TINY, sc)) for sc, res in zip(scs, run_cp(TINY, scs, cp))}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cp", sorted(COUNTS))
@pytest.mark.slow
def test_ranks_without_new_tokens(cp):
    for name, (sc, res, ref) in run(cp).items():
        n = int(name.split("/")[1])
        assert res.hidden.shape == (n, TINY.hidden_size), name
        assert sum(len(r.local) for r in res.ranks) == n, name
        assert sum(len(r.local) == 0 for r in res.ranks) >= cp - n, name  # ranks with no new token
        assert_matches_reference(TINY, sc, res, ref, name)
