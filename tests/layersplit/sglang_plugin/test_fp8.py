"""FP8 KV with layer split: the plug-in pool in SGLang's own fp8 DSA layout (``dsa_kv_cache_store_fp8``:
512 e4m3 + 4 fp32 scales + 64 bf16 rope = 656 B a token), as upstream's layer split also serves it
(test_sglang_upstream_fp8.py); against the real sglang package, on CPU (rank processes over gloo)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import compat  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import (  # noqa: E402
    LAYERS, NEW_PAGES, PAGE, PREFIX_PAGES, SIZE, dsa_pool_kwargs, published)
from tests.layersplit.sglang_plugin.test_plugin import _decode_receives, run_broadcast, write_all  # noqa: E402

FP8 = dsa_pool_kwargs(kv_dtype="fp8")


@pytest.fixture(autouse=True)
def _published():
    with published():
        yield


def _combined_rows(pool, seed: int) -> None:
    """SGLang's other write door, ``set_kv_buffer`` with a combined latent+rope row (upstream's pools
    assert a bf16 pool there; the plug-in quantizes it like ``set_mla_kv_buffer``)."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.arange(3 * PAGE + 5, 3 * PAGE + 40)
    for i in range(LAYERS):
        row = torch.randn(loc.numel(), 1, 576, generator=g).to(torch.bfloat16)
        layer = SimpleNamespace(layer_id=i)
        if isinstance(pool, compat.resolve("layer_split_pool")):
            pool.set_kv_buffer(layer, loc, row, None)
        else:
            pool.set_mla_kv_buffer(layer, loc, row[..., :512], row[..., 512:])


@pytest.mark.slow
def test_fp8_owned_layers_byte_identical_to_sglangs_fp8_pool():
    ref = compat.resolve("dsa_pool")(SIZE, **FP8)
    assert ref.dsa_kv_cache_store_fp8 and ref.kv_buffer[0].shape[-1] == 656
    write_all(ref)
    _combined_rows(ref, seed=5)
    for rank in range(2):
        with published(world=2):
            pool = make_pool_class()(SIZE, **FP8, layer_shard_rank=rank, layer_shard_size=2)
            write_all(pool)
            _combined_rows(pool, seed=5)
        assert pool.dsa_kv_cache_store_fp8 and pool.kv_staging[0].dtype == torch.uint8
        assert pool.kv_staging[0].shape[-1] == 656  # the slots hold fp8 rows: 656 B a token, not 1152
        owned = [i for i in range(LAYERS) if pool._is_layer_owned(i)]
        for i in owned:
            assert torch.equal(pool.kv_buffer[i], ref.kv_buffer[i])
            assert torch.equal(pool.get_index_k_with_scale_buffer(i), ref.get_index_k_with_scale_buffer(i))
        assert ref.kv_buffer[owned[0]][3 * PAGE + 5].any()  # the combined rows were written
        assert all(pool.kv_buffer[i].shape[0] == 0 for i in range(LAYERS) if i not in owned)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_fp8_every_layer_identical_on_every_rank_after_gloo_broadcast():
    """Two CP ranks (processes, gloo), batch landing: every layer each rank reads, owned or broadcast
    as fp8 bytes, equals SGLang's single-process fp8 pool on the batch's pages."""
    batch_pages = len(set(PREFIX_PAGES + NEW_PAGES))
    for rank, same, sent, err in run_broadcast("pages", "batch", "fp8"):
        assert err is None, err
        assert all(same), f"rank {rank}: layers differ from SGLang's fp8 pool: {same}"
        assert sent["kv"] == LAYERS * batch_pages * PAGE * 656  # fp8 rows: 57% of bf16's bytes


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_fp8_pd_transfer_of_owned_layers_equals_redundant_fp8_prefill():
    pages, remap = [0, 2, 5], {0: 3, 2: 4, 5: 7}
    split, who = _decode_receives(2, pages, remap, kv_dtype="fp8")
    redundant, _ = _decode_receives(1, pages, remap, kv_dtype="fp8")
    assert sorted({layer for (_, layer, _) in who}) == list(range(LAYERS))
    for i in range(LAYERS):
        assert torch.equal(split.kv_buffer[i], redundant.kv_buffer[i])
        assert torch.equal(split.get_index_k_with_scale_buffer(i), redundant.get_index_k_with_scale_buffer(i))
    assert split.kv_buffer[0].shape[-1] == 656 and split.kv_buffer[0].any()
