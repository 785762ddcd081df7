"""Batch-sized landing: non-owned layers are read from the staging slots through page tables
remapped per forward (:mod:`layersplit.sglang_plugin.landing`); against the real sglang package, on
CPU, two CP rank processes over gloo."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import batch as batch_hook  # noqa: E402
from layersplit.sglang_plugin import compat, landing
from layersplit.plan import sizing  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import LAYERS, PAGE, SIZE, dsa_pool_kwargs, published, write_prefix  # noqa: E402

SEQ_LENS = (202, 70)  # padding entries of the tables (beyond a request's length) are never read
NEW = torch.cat([torch.arange(5 * PAGE + 40, 6 * PAGE), torch.arange(6 * PAGE, 6 * PAGE + 10)])  # 34 new tokens


@dataclasses.dataclass
class Metadata:
    """The page-table fields of SGLang's ``DSAMetadata`` (the remap copies it with ``dataclasses.replace``)."""

    page_table_1: torch.Tensor
    page_table_1_flattened: torch.Tensor
    real_page_table: torch.Tensor
    indexer_logical_page_table: torch.Tensor | None = None


def _batch():
    """Request 0: cached pages 1, 2 and 40 tokens of 5, then 34 new tokens (rest of 5, 10 of 6);
    request 2: the same cached page 1 (radix cache), then 6 new tokens in page 7."""
    rtp = __import__("sglang.srt.mem_cache.memory_pool", fromlist=["x"]).ReqToTokenPool(
        size=4, max_context_len=300, device="cpu", enable_memory_saver=False)
    t = rtp.req_to_token
    t[0, :202] = torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in (1, 2, 5, 6)])[:202]
    t[2, :PAGE], t[2, PAGE:70] = torch.arange(PAGE, 2 * PAGE), torch.arange(7 * PAGE, 7 * PAGE + 6)
    fb = SimpleNamespace(req_pool_indices=torch.tensor([0, 2]), seq_lens=torch.tensor([202, 70]),
                         seq_lens_cpu=torch.tensor([202, 70]), extend_prefix_lens_cpu=[168, 64],
                         out_cache_loc=torch.cat([NEW, torch.arange(7 * PAGE, 7 * PAGE + 6)]))
    table = t[fb.req_pool_indices, :202]  # what the backend's init_forward_metadata builds (page size 1)
    md = Metadata(page_table_1=table, page_table_1_flattened=torch.cat([table[0, :202], table[1, :70]]),
                  real_page_table=table[:, ::PAGE] // PAGE)
    return rtp, fb, md


def _model_forward(pool, backend, fb, seed: int) -> list:
    """One forward in the model's order through the plug-in's hooks: per layer the indexer stores its
    new keys and reads keys by ``real_page_table`` (its metadata from ``get_indexer_metadata``); attention
    writes the new latent rows and gathers the KV by ``page_table_1_flattened`` and ``page_table_1`` (what
    the flashmla-sparse ragged path and the paged path read); then the next layer is prefetched."""
    g = torch.Generator().manual_seed(seed)
    reads = []

    def attention(backend, q, k, v, layer, forward_batch, save_kv_cache=True, k_rope=None):
        pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
        kv, md = pool.get_key_buffer(layer.layer_id).view(torch.uint8), backend.forward_metadata
        paged = torch.cat([kv[md.page_table_1[r, :n].long()] for r, n in enumerate(SEQ_LENS)])  # no padding
        return kv[md.page_table_1_flattened.long()].clone(), paged

    for i in range(LAYERS):
        n = fb.out_cache_loc.numel()
        keys = torch.randint(0, 255, (n, 128), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        pool.set_index_k_scale_buffer(i, fb.out_cache_loc, keys, torch.rand(n, 1, generator=g))
        md = landing.around_get_indexer_metadata(lambda b, layer_id, f: b.forward_metadata, backend, i, fb)
        read_index = getattr(pool, "get_broadcastable_index_k_with_scale_buffer", pool.get_index_k_with_scale_buffer)
        index = torch.cat([read_index(i)[md.real_page_table[r, :-(-n // PAGE)].long()] for r, n in enumerate(SEQ_LENS)])
        k, k_rope = (torch.randn(n, 1, d, generator=g).to(torch.bfloat16) for d in (512, 64))
        ragged, paged = landing.around_forward(attention, backend, None, k, None, SimpleNamespace(layer_id=i), fb,
                                               k_rope=k_rope)
        reads.append((index, ragged, paged))
        if i + 1 < LAYERS and hasattr(pool, "prefetch_kv_buffer"):
            pool.prefetch_kv_buffer(i + 1)
    return reads


def _worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        rtp, fb, md = _batch()
        out = {}
        with published():
            ref = compat.resolve("dsa_pool")(SIZE, **dsa_pool_kwargs())  # single process, every layer
            write_prefix(ref)
            out["reference"] = _model_forward(ref, SimpleNamespace(forward_metadata=md), fb, seed=9)
        for mode in ("batch", "pool"):
            os.environ["LAYERSPLIT_SGLANG_LANDING"] = mode
            with published(world=2, group=dist.group.WORLD):
                pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=rank, layer_shard_size=2)
                write_prefix(pool)
                backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=rtp, forward_metadata=md,
                                          dsa_prefill_impl="flashmla_sparse")
                batch_hook.after_init_forward_metadata(None, backend, fb)
                out[mode] = _model_forward(pool, backend, fb, seed=9)
                assert backend.forward_metadata is md  # every swap put the pool-address tables back
            out[mode + "_scratch"] = pool.kv_scratch_bytes()
            out[mode + "_remote"] = pool.remote_kv_buffer is not None
            if mode == "batch":  # the control: a slot read through the pool-address tables
                out["unremapped"] = [bool(torch.equal(pool._kv.buffers[i % 2].view(torch.uint8)[
                    md.page_table_1_flattened.long()], r[1])) for i, r in enumerate(out["reference"])
                    if not pool._is_layer_owned(i)]
                out["non_owned"] = [i for i in range(LAYERS) if not pool._is_layer_owned(i)]
        same = {mode: [all(torch.equal(a, b) for a, b in zip(got, want))
                       for got, want in zip(out[mode], out["reference"])] for mode in ("batch", "pool")}
        queue.put((rank, same, {k: v for k, v in out.items() if k not in ("batch", "pool", "reference")}, None))
    except Exception:
        import traceback

        queue.put((rank, None, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_remapped_path_hands_attention_and_indexer_the_same_rows():
    """Both ranks, every layer: the rows attention gathers (ragged and paged tables) and the keys the
    indexer reads are byte-identical with batch landing (slots, remapped tables), with upstream's
    pool-sized landing buffer, and in SGLang's single-process pool; the batch landing allocates no
    pool-sized buffer, and reading a slot through the unremapped tables gives other rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for rank, same, info, err in results:
        assert err is None, err
        assert all(same["batch"]) and all(same["pool"]), (rank, same)
        assert info["non_owned"] and not any(info["unremapped"]), info
        assert not info["batch_remote"] and info["pool_remote"]
        assert info["batch_scratch"] < info["pool_scratch"] - SIZE * 1152  # no pool-sized landing layer


def test_pool_allocates_what_the_plan_counts(monkeypatch):
    """``layersplit plan`` counts the plug-in's staging with :mod:`layersplit.plan.sizing`; the
    pool allocates exactly that (two slots of KV rows and index pages, the remap table), and its owned
    layers only."""
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "130")
    with published(world=2):
        pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)
    pages = sizing.slot_pages(130, SIZE, PAGE)
    assert pages == 3
    assert pool.staging_bytes() == (sizing.staging_bytes(pages, PAGE, 576 * 2, PAGE * 132)
                                    + sizing.REMAP_BYTES_PER_PAGE * sizing.remap_pages(SIZE, PAGE))
    assert pool.kv_scratch_bytes() == pool.staging_bytes()  # batch landing: no pool-sized buffer
    owned = sum(pool._is_layer_owned(i) for i in range(LAYERS))
    assert pool.get_kv_size_bytes() == owned * (SIZE + PAGE) * (576 * 2 + 132)


def test_uncovered_kernel_never_allocates_in_a_forward(monkeypatch):
    """A forward on a kernel the remap does not cover: a ``batch`` pool refuses it (the start-up plan
    would have chosen ``pool`` landing for that flag) without allocating; a ``pool`` pool, whose
    landing layer was allocated at start-up, serves it."""
    rtp, fb, md = _batch()
    with published(world=2):
        pool = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)
        backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=rtp, forward_metadata=md,
                                  dsa_prefill_impl="trtllm")
        with pytest.raises(RuntimeError, match="'trtllm' is not covered.*did not allocate"):
            batch_hook.after_init_forward_metadata(None, backend, fb)
        assert pool.remote_kv_buffer is None and pool.index_key_cache.remote_buffer is None
        backend.dsa_prefill_impl = "flashmla_kv"  # SGLang's Hopper default with fp8 KV: covered
        batch_hook.after_init_forward_metadata(None, backend, fb)
        assert pool.landing_now == "batch" and pool.reads_remapped(4) and not pool.reads_remapped(0)
        monkeypatch.setenv("LAYERSPLIT_SGLANG_LANDING", "pool")
        pooled = make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)
        landing_layer = pooled.remote_kv_buffer
        backend.token_to_kv_pool, backend.dsa_prefill_impl = pooled, "trtllm"
        batch_hook.after_init_forward_metadata(None, backend, fb)
        assert pooled.landing_now == "pool" and pooled.remote_kv_buffer is landing_layer
        assert not pooled.reads_remapped(4)  # attention keeps the pool-address tables
    backend.dsa_prefill_impl, backend.hisparse_coordinator = "flashmla_kv", object()
    assert "HiSparse" in landing.unsupported_reason(backend, fb)
