"""CP pools in-process: allocated bytes for GLM-5 dims match ``layersplit plan``; batch plan layout."""

from __future__ import annotations

import pytest
import torch

from layersplit.engine.batch_plan import Request, plan_batch
from layersplit.plan.capacity import PlanRequest, capacity_plan, scratch_pages_for
from layersplit.engine.cp_pool import cache_spec
from layersplit.plan.config import load_hardware, load_model
from layersplit.engine.cp_pool import CPPool
from layersplit.plan.ownership import plan_ownership


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_glm5_scaled_down_pool_matches_plan(kv_dtype):
    model, pages, tokens, reqs = load_model("glm-5"), 4, 2048, 2
    spec = cache_spec(model, kv_dtype)
    own = plan_ownership(model.num_layers, 8)
    plan = capacity_plan(model, load_hardware("h200"), PlanRequest(cp=8, kv_dtype=kv_dtype, max_batch_tokens=tokens,
                                                                   max_requests=reqs))
    scratch = scratch_pages_for(tokens, reqs)
    layersplit = CPPool("layersplit", spec, pages, rank=0, ownership=own, scratch_pages=scratch).kv_bytes()
    assert layersplit["owned"] == pages * 64 * plan["bytes_per_token_layersplit"]
    assert layersplit["scratch"] == plan["scratch_bytes"]
    redundant = CPPool("redundant", spec, pages, rank=0, ownership=own).kv_bytes()
    assert redundant["total"] == pages * 64 * plan["bytes_per_token_redundant"]
    print(f"glm-5 {kv_dtype}, {pages} pages/layer: redundant {redundant['total']:,} B, "
          f"layersplit owned {layersplit['owned']:,} + scratch {layersplit['scratch']:,} B")


def test_batch_plan_layout():
    reqs = [Request(100, (1,) * 30), Request(0, (2,) * 5), Request(64, (3,) * 64)]
    free = iter(range(100))
    plan = plan_batch(reqs, lambda n: [next(free) for _ in range(n)], cp=3, split="zigzag")
    assert plan.pool_pages == [[0, 1, 2], [3], [4, 5]]
    assert plan.bcast_pages.tolist() == [0, 1, 4]  # pages holding prefix rows, first in scratch
    assert plan.scratch_table.tolist() == [[0, 1, 3], [4, 0, 0], [2, 5, 0]]
    assert plan.rows_read == 3 * 64 and plan.max_ctx == 130
    assert sorted(torch.cat(plan.local).tolist()) == list(range(99))
    assert plan.new_pool_slots[0] == 100 and plan.new_scratch_slots[30] == 4 * 64


def test_errors():
    spec = cache_spec(load_model("tiny"))
    own = plan_ownership(8, 2)
    with pytest.raises(ValueError, match="mode: expected one of"):
        CPPool("sharded", spec, 4, 0, own)
    with pytest.raises(ValueError, match="scratch_pages: expected >= 1 for layersplit"):
        CPPool("layersplit", spec, 4, 0, own)
    pool = CPPool("layersplit", spec, 8, 0, own, scratch_pages=2)
    plan = plan_batch([Request(200, (1,) * 5)], pool.pool.allocator.alloc, 2)
    with pytest.raises(ValueError, match="batch: expected <= 2 scratch pages"):
        pool.check_fits(plan)
    with pytest.raises(ValueError, match=r"requests\[0\]: expected prefix_len >= 0 and >= 1 new token"):
        plan_batch([Request(5, ())], pool.pool.allocator.alloc, 2)
    with pytest.raises(ValueError, match="split: expected one of"):
        plan_batch([Request(5, (1,))], pool.pool.allocator.alloc, 2, split="random")


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("mode,cp,ownership", [("layersplit", 2, "contiguous"), ("layersplit", 3, "round-robin"),
                                               ("layersplit", 8, "contiguous"), ("layersplit", 1, "contiguous"),
                                               ("redundant", 2, "contiguous")])
def test_rank_cache_bytes_is_what_the_pools_allocate(mode, cp, ownership, kv_dtype):
    """The memory check's arithmetic (``rank_cache_bytes``, computed before anything is allocated) equals
    the largest rank's allocation, pool and scratch slots."""
    from layersplit.engine.prefill import rank_cache_bytes

    model, pages, scratch = load_model("tiny"), 7, scratch_pages_for(448, 2)
    own = plan_ownership(model.num_layers, cp, ownership)
    pools = [CPPool(mode, cache_spec(model, kv_dtype), pages, r, own, scratch) for r in range(cp)]
    assert max(p.kv_bytes()["total"] for p in pools) == rank_cache_bytes(
        model, cp=cp, mode=mode, ownership=ownership, pool_pages=pages, scratch_pages=scratch, kv_dtype=kv_dtype)
