"""Contract tests of the SGLang plug-in against the real sglang package, on CPU.

In CI (``CI`` set) a missing sglang fails the run instead of skipping these tests.
"""

from __future__ import annotations

import inspect
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

if os.environ.get("CI"):
    import sglang  # noqa: F401 -- the plug-in tests must run in CI
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import compat, register, unregister  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402

from layersplit.sglang_plugin.stress import (  # noqa: E402
    LAYERS, NEW_PAGES, PAGE, PREFIX_PAGES, SIZE, dsa_pool_kwargs, forward_layers, published, write_prefix)

forward, prefix, parallel = forward_layers, write_prefix, published


def pool_kwargs() -> dict:
    return dsa_pool_kwargs()


@pytest.fixture(autouse=True)
def _published():
    with parallel():
        yield


def layer(i: int):
    return SimpleNamespace(layer_id=i)


def write_all(pool, seed: int = 0) -> None:
    """Same writes on every pool: latent + rope rows (quantized by SGLang on an fp8 pool) and
    quantized index keys, every layer."""
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(SIZE, generator=g)[:200]
    for i in range(LAYERS):
        pool.set_mla_kv_buffer(layer(i), loc, torch.randn(200, 1, 512, generator=g).to(torch.bfloat16),
                               torch.randn(200, 1, 64, generator=g).to(torch.bfloat16))
        keys = torch.randint(0, 255, (200, 128), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        scales = torch.rand(200, 1, generator=g)
        pool.set_index_k_scale_buffer(i, loc, keys, scales)


def reference_pool():
    ref = compat.resolve("dsa_pool")(SIZE, **pool_kwargs())
    write_all(ref)
    return ref


def make_pool(rank: int, world: int = 2):
    with parallel(world=world):
        return make_pool_class()(SIZE, **pool_kwargs(), layer_shard_rank=rank, layer_shard_size=world)


@pytest.mark.slow
def test_owned_layers_byte_identical_to_upstream_pool():
    ref = reference_pool()
    shard_range = __import__("sglang.srt.layers.cp.utils", fromlist=["x"]).get_layer_shard_range
    for rank in range(2):
        pool = make_pool(rank)
        write_all(pool)
        owned = [i for i in range(LAYERS) if pool._is_layer_owned(i)]
        start, end = shard_range(rank, 2, LAYERS)
        assert owned == list(range(start, end)) == [[0, 1, 2], [3, 4]][rank]  # upstream's contiguous split
        for i in owned:
            assert torch.equal(pool.kv_buffer[i].view(torch.uint8), ref.kv_buffer[i].view(torch.uint8))
            assert torch.equal(pool.get_index_k_with_scale_buffer(i), ref.get_index_k_with_scale_buffer(i))
        assert all(pool.kv_buffer[i].shape[0] == 0 for i in range(LAYERS) if i not in owned)


def test_staging_is_batch_sized_and_double_buffered(monkeypatch):
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "100")
    pool = make_pool(0)
    assert [s.shape[0] for s in pool.kv_staging] == [128, 128]  # 100 tokens rounded up to whole pages
    assert pool.remote_kv_buffer is None and pool.index_key_cache.remote_buffer is None  # batch landing
    assert [s.shape[0] for s in pool._index.buffers] == [2, 2]  # index pages of 128 tokens
    monkeypatch.setenv("LAYERSPLIT_SGLANG_LANDING", "pool")
    assert make_pool(0).remote_kv_buffer.shape[0] == SIZE + PAGE  # upstream's landing buffer, unchanged
    with pytest.raises(RuntimeError, match="exceeds the staging slot"):  # sized at start-up, never grown
        pool.set_forward_pages(torch.tensor([7, 1, 3, 1]))
    assert [s.shape[0] for s in pool.kv_staging] == [128, 128]
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "192")
    pool = make_pool(0)
    pool.set_forward_pages(torch.tensor([7, 1, 3, 1]))
    assert pool.forward_pages.tolist() == [1, 3, 7]
    with pytest.raises(ValueError, match=r"set_forward_pages: pages: expected page ids in \[0, 9\), got \[1, 9\]"):
        pool.set_forward_pages(torch.tensor([1, 9]))
    with pytest.raises(ValueError, match=r"expected new_pages to be a subset of pages, got \[4\] outside it"):
        pool.set_forward_pages(torch.tensor([1, 3]), new_pages=torch.tensor([3, 4]))
    pool.set_forward_pages(torch.tensor([1, 3, 7]), new_pages=torch.tensor([7]))
    assert pool._prefix_pages.tolist() == [1, 3] and pool._new_pages.tolist() == [7]
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SCRATCH_TOKENS", "lots")
    with pytest.raises(ValueError, match="LAYERSPLIT_SGLANG_SCRATCH_TOKENS: expected a positive integer, got 'lots'"):
        make_pool(0)


def test_constructed_with_the_keywords_sglang_passes():
    """The keywords SGLang builds the layer-split pool with (read from its source in
    ``test_upstream_contract.py``) construct our class."""
    make_pool(1)


def test_answers_what_sglang_calls():
    pool = make_pool(0)
    for name in ("get_key_buffer", "get_value_buffer", "set_mla_kv_buffer", "set_kv_buffer",
                 "get_index_k_with_scale_buffer", "get_broadcastable_index_k_with_scale_buffer",
                 "set_index_k_scale_buffer", "prefetch_kv_buffer", "get_contiguous_buf_infos", "get_kv_size_bytes",
                 "move_kv_cache", "get_cpu_copy", "load_cpu_copy", "set_forward_pages"):
        assert callable(getattr(pool, name)), name


@pytest.mark.slow
def test_pd_transfer_union_equals_redundant():
    """Each rank reports only its owned layers; the union covers every layer exactly once, with the
    same bytes a redundant pool would send."""
    ref = reference_pool()
    reported = {}
    for rank in range(2):
        pool = make_pool(rank)
        write_all(pool)
        ptrs, lens, _ = pool.get_contiguous_buf_infos()
        for j, (ptr, n) in enumerate(zip(ptrs, lens)):
            layer_id = pool.layer_shard_start + j  # how SGLang's PD prefill labels a rank's buffers
            assert ptr == pool.kv_buffer[layer_id].data_ptr()
            reported[layer_id] = pool.kv_buffer[layer_id].view(torch.uint8).flatten()[:n].clone()
    assert sorted(reported) == list(range(LAYERS))
    for i in range(LAYERS):
        assert torch.equal(reported[i], ref.kv_buffer[i].view(torch.uint8).flatten())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank: int, port: int, mode: str, queue, landing: str = "batch", kv_dtype: str = "bf16") -> None:
    import torch.distributed as dist

    os.environ["LAYERSPLIT_SGLANG_LANDING"] = landing
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        kwargs = dsa_pool_kwargs(kv_dtype=kv_dtype)
        with parallel():
            ref = compat.resolve("dsa_pool")(SIZE, **kwargs)
            prefix(ref)
            want = forward(ref, seed=2)
        with parallel(world=2, group=dist.group.WORLD):
            pool = make_pool_class()(SIZE, **kwargs, layer_shard_rank=rank, layer_shard_size=2)
            prefix(pool)
            if mode == "pages":
                pool.set_forward_pages(torch.tensor(PREFIX_PAGES + NEW_PAGES), new_pages=torch.tensor(NEW_PAGES))
            got = forward(pool, seed=2)
        pages = torch.tensor(sorted(set(PREFIX_PAGES + NEW_PAGES)))
        rows = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        same = []
        for layer_id, ((index, kv), (ref_index, ref_kv)) in enumerate(zip(got, want)):
            # a non-owned layer read from the batch slots: its rows where the remapped tables point
            remapped = mode == "pages" and pool.reads_remapped(layer_id)
            at_pages, at_rows = (pool.remap_pages(pages), pool.remap_locs(rows)) if remapped else (pages, rows)
            same.append(bool(torch.equal(index[at_pages], ref_index[pages])))
            same.append(bool(torch.equal(kv[at_rows].view(torch.uint8), ref_kv[rows].view(torch.uint8))))
        queue.put((rank, same, dict(pool.broadcast_bytes), None))
    except Exception:
        import traceback

        queue.put((rank, None, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_broadcast(mode: str, landing: str = "batch", kv_dtype: str = "bf16") -> list:
    """Two CP rank processes (gloo) run :func:`_broadcast_worker`; their results by rank."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_broadcast_worker, args=(r, port, mode, queue, landing, kv_dtype)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,landing", [("pages", "batch"), ("pages", "pool"), ("whole", "pool")])
@pytest.mark.slow
def test_non_owned_layers_after_gloo_broadcast(mode, landing):
    """Two CP ranks (processes, gloo): every layer each rank reads, owned or broadcast, equals a
    single-process upstream pool on the batch's pages (batch landing: where the remapped tables
    point); with the batch's pages only those are sent."""
    results = run_broadcast(mode, landing)
    batch_pages = len(set(PREFIX_PAGES + NEW_PAGES))
    for rank, same, sent, err in results:
        assert err is None, err
        assert all(same), f"rank {rank}: layers differ from the upstream pool: {same}"
        if mode == "pages":  # every layer once, batch pages only: 4 pages x 64 rows x 576 bf16
            assert sent["kv"] == LAYERS * batch_pages * PAGE * 576 * 2
            # indexer keys (64 x 132 B a page): prefix-only pages 1, 2 staged ahead; 5, 6 at read time
            assert sent["index_prefix"] == LAYERS * 2 * (PAGE * 132)
            assert sent["index_new"] == LAYERS * 2 * (PAGE * 132)
        else:
            assert sent == {"kv": 0, "index_prefix": 0, "index_new": 0}  # upstream's whole-buffer path


@pytest.mark.parametrize("how", ["env", "flag"])
def test_entry_point_registers_and_unregisters(monkeypatch, how):
    import argparse
    import importlib
    import sys

    registry = compat.resolve("hook_registry")
    classes = {c: compat.resolve(c) for c in ("layer_split_pool", "layer_done_counter", "l2_transfer_engine")}
    modules = {c: importlib.import_module(compat.resolve_path(c).rpartition(".")[0]) for c in classes}
    controller = importlib.import_module("sglang.srt.managers.cache_controller")  # imports two of them by name
    backend = compat.resolve("dsa_backend")
    init_md = backend.__dict__["init_forward_metadata"]
    from sglang.srt.layers.cp import utils as cp_utils

    landing_targets = {(backend, name): backend.__dict__[name] for name in
                       ("forward_extend", "forward_decode", "get_indexer_metadata", "init_forward_metadata_out_graph")}
    landing_targets[(cp_utils, "get_glm_dsa_layer_split_effective_num_layers")] = \
        cp_utils.get_glm_dsa_layer_split_effective_num_layers
    index_cache = compat.resolve("index_key_cache")
    local_read = index_cache.__dict__["get_local_buffer"]
    server_args = importlib.import_module("sglang.srt.server_args").ServerArgs
    add_cli_args = server_args.add_cli_args
    monkeypatch.delenv("LAYERSPLIT_SGLANG_PLUGIN", raising=False)
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server"])
    assert register() is False and not any(compat.resolve_path(c) in registry._hooks for c in classes)
    assert backend.__dict__["init_forward_metadata"] is init_md  # disabled: changes nothing
    unregister()
    if how == "env":
        monkeypatch.setenv("LAYERSPLIT_SGLANG_PLUGIN", "1")
    else:
        monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--layersplit", "--model-path", "m"])
    try:
        assert register() is True
        registry.apply_hooks()
        for concept, original in classes.items():
            now = getattr(modules[concept], original.__name__)
            assert now is not original and issubclass(now, original), concept
        assert controller.LayerDoneCounter is getattr(modules["layer_done_counter"], "LayerDoneCounter")
        assert controller.L2TransferEngine is not classes["l2_transfer_engine"]
        assert backend.__dict__["init_forward_metadata"] is not init_md
        for (owner, name), original in landing_targets.items():
            assert vars(owner)[name] is not original, name
        assert index_cache.__dict__["get_local_buffer"] is not local_read
        parser = argparse.ArgumentParser()
        server_args.add_cli_args(parser)
        # the README's prefill-worker command line parses with SGLang's own parser
        ns = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill", "--enable-prefill-cp",
                                "--attn-cp-size", "8", "--enable-dsa-cache-layer-split",
                                "--enable-hierarchical-cache", "--layersplit"])
        assert ns.layersplit_plugin and ns.enable_dsa_cache_layer_split and ns.attn_cp_size == 8
    finally:
        unregister()
    for concept, original in classes.items():
        assert getattr(modules[concept], original.__name__) is original
        assert compat.resolve_path(concept) not in registry._hooks
    assert controller.LayerDoneCounter is classes["layer_done_counter"]
    assert controller.L2TransferEngine is classes["l2_transfer_engine"]
    assert backend.__dict__["init_forward_metadata"] is init_md
    for (owner, name), original in landing_targets.items():
        assert vars(owner)[name] is original, name
    assert index_cache.__dict__["get_local_buffer"] is local_read
    assert server_args.add_cli_args is add_cli_args


def test_forward_pages_hook_reads_the_batch_like_the_backend():
    """The AFTER hook on the DSA backend's init_forward_metadata hands the pool the pages of
    tokens [0, seq_len) of each request in the batch (SGLang's own ReqToTokenPool), split at each
    request's cached prefix, sized from the host lists SGLang keeps (seq_lens_cpu, or prefix +
    extend lengths; extend_prefix_lens_cpu), a prefix page shared with an earlier request once."""
    from layersplit.sglang_plugin import sharing
    from layersplit.sglang_plugin.batch import after_init_forward_metadata

    req_to_token_pool = __import__("sglang.srt.mem_cache.memory_pool", fromlist=["x"]).ReqToTokenPool(
        size=4, max_context_len=300, device="cpu", enable_memory_saver=False)
    table = req_to_token_pool.req_to_token
    table[2, :130] = torch.arange(3 * PAGE, 3 * PAGE + 130)  # pages 3, 4, 5
    table[2, 130:] = 8 * PAGE  # beyond seq_len: not part of the batch
    table[0, :PAGE] = torch.arange(3 * PAGE, 4 * PAGE)  # the same cached page 3 (radix cache)
    table[0, PAGE:70] = torch.arange(7 * PAGE, 7 * PAGE + 6)  # then page 7
    pool = make_pool(0)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_to_token_pool,
                              dsa_prefill_impl="flashmla_sparse")
    batch = SimpleNamespace(req_pool_indices=torch.tensor([2, 0]), seq_lens=torch.tensor([130, 70]),
                            seq_lens_cpu=torch.tensor([130, 70]), rids=["r2", "r0"])
    assert after_init_forward_metadata(None, backend, batch) is None
    assert pool.forward_pages.tolist() == [3, 4, 5, 3, 7]  # no prefix lengths: every page counts as new
    assert pool._prefix_pages.tolist() == []
    batch.extend_prefix_lens_cpu = [120, 64]  # request 2 continues inside page 4
    after_init_forward_metadata(None, backend, batch)
    assert pool._prefix_pages.tolist() == [3, 3] and pool._new_pages.tolist() == [4, 5, 7]
    assert pool.forward_pages.tolist() == [3, 3, 4, 5, 7]  # nothing recorded: the shared page twice
    root = SimpleNamespace(parent=None, key=[])
    page3 = SimpleNamespace(parent=root, key=[0] * PAGE)  # the radix node both requests matched
    own = SimpleNamespace(parent=page3, key=[0] * PAGE)
    sharing.record([SimpleNamespace(rid="r2", last_node=own, prefix_len=120),
                    SimpleNamespace(rid="r0", last_node=page3, prefix_len=64)], PAGE)
    try:
        after_init_forward_metadata(None, backend, batch)
    finally:
        sharing.forget()
    assert pool._prefix_pages.tolist() == [3] and pool.forward_pages.tolist() == [3, 4, 5, 7]  # page 3 once
    batch.seq_lens_cpu, batch.extend_seq_lens_cpu = None, [10, 6]  # seq_len = prefix + extend, on the host
    after_init_forward_metadata(None, backend, batch)
    assert pool.forward_pages.tolist() == [3, 3, 4, 5, 7]
    batch.extend_seq_lens_cpu = None  # no host lengths at all (not an extend batch): upstream's path
    after_init_forward_metadata(None, backend, batch)
    assert pool.forward_pages is None
    other = SimpleNamespace(token_to_kv_pool=compat.resolve("dsa_pool")(SIZE, **pool_kwargs()),
                            req_to_token_pool=req_to_token_pool)
    assert after_init_forward_metadata(None, other, batch) is None  # any other pool: left alone


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "layersplit"]
    assert eps and eps[0].value == "layersplit.sglang_plugin:register"


def test_monitor_hook_on_real_tokenizer_manager(monkeypatch):
    """The AFTER hook runs on SGLang's own metric computation and turns an anomaly into a retryable abort.
    It is the fallback for releases without the per-step method (tests/layersplit/sglang_plugin/spec/test_step.py)."""
    from layersplit import sglang_plugin
    from layersplit.sglang_plugin.spec.completion import TARGET, TARGET_SIGNATURE

    monkeypatch.setattr(compat, "SPEC_STEP_METHODS", ())  # a release without per-step counters

    manager_cls = __import__("sglang.srt.managers.tokenizer_manager", fromlist=["TokenizerManager"]).TokenizerManager
    original = manager_cls.__dict__["_calculate_spec_decoding_metrics"]
    assert str(inspect.signature(original)) == TARGET_SIGNATURE, "upstream metric method changed signature"
    monkeypatch.setenv("LAYERSPLIT_SGLANG_PLUGIN", "1")
    monkeypatch.setenv("LAYERSPLIT_SGLANG_SPEC_MONITOR", "1")
    # what the server would have published: 4 draft tokens per verify step
    monkeypatch.setattr(inspect.getmodule(original), "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=4))
    try:
        assert register()
        compat.resolve("hook_registry").apply_hooks()
        fn = manager_cls._calculate_spec_decoding_metrics
        for completion, verify, correct, expect in [(300, 250, 50, "garbled"), (400, 160, 240, "healthy"),
                                                    (1000, 251, 749, "repetition")]:
            recv = SimpleNamespace(spec_verify_ct=[verify], spec_num_correct_drafts=[correct],
                                   completion_tokens=[completion], spec_correct_drafts_histogram=None)
            meta = {"completion_tokens": completion}
            fn(SimpleNamespace(), meta, recv, 0)
            assert meta["spec_accept_length"] == completion / verify  # computed by SGLang itself
            assert meta["layersplit_spec_verdict"]["verdict"] == expect
            aborted = meta.get("finish_reason", {}).get("type") == "abort"
            assert aborted == (expect != "healthy")
        text = sglang_plugin.spec_monitor().counters.to_prometheus()
        assert 'pd_spec_monitor_verdicts_total{verdict="garbled"} 1' in text
    finally:
        unregister()
    assert manager_cls.__dict__["_calculate_spec_decoding_metrics"] is original
    assert TARGET not in compat.resolve("hook_registry")._hooks


def _prefill_rank_worker(rank: int, world: int, pages: list[int], queue, kv_dtype: str = "bf16") -> None:
    """One prefill CP rank: build the pool, apply the writes, and read out exactly the buffers it
    registers for PD transfer (``get_contiguous_buf_infos`` / ``get_state_buf_infos``), page by page,
    as the transfer engine would from (ptr + page * item_len). Each buffer is labelled the way
    SGLang's PD prefill labels it: layer ``prefill_start_layer + position`` in the reported list."""
    try:
        with parallel(world=world):
            kwargs = dsa_pool_kwargs(kv_dtype=kv_dtype)
            pool = (make_pool_class()(SIZE, **kwargs, layer_shard_rank=rank, layer_shard_size=world)
                    if world > 1 else compat.resolve("dsa_pool")(SIZE, **kwargs))
            write_all(pool)
            start = pool.layer_shard_start if world > 1 else pool.start_layer
            sends = []
            for kind, infos in (("kv", pool.get_contiguous_buf_infos()), ("index", pool.get_state_buf_infos())):
                by_layer = {}
                for i in range(LAYERS):
                    t = pool.kv_buffer[i] if kind == "kv" else pool.get_index_k_with_scale_buffer(i)
                    if t.numel():
                        by_layer[t.data_ptr()] = (i, t)
                for position, (ptr, length, item_len) in enumerate(zip(*infos)):
                    layer_id, tensor = by_layer[ptr]
                    assert layer_id == start + position, f"{kind} buffer {position} is layer {layer_id}, labelled {start + position}"
                    flat = tensor.view(torch.uint8).flatten()[:length]
                    for p in pages:
                        # plain bytes: tensors sent through a queue as shared memory die with this process
                        sends.append((kind, start + position, p, flat[p * item_len:(p + 1) * item_len].numpy().tobytes()))
        queue.put((rank, sends, None))
    except Exception:
        import traceback

        queue.put((rank, None, traceback.format_exc()))


def _decode_receives(world: int, pages: list[int], remap: dict[int, int], kv_dtype: str = "bf16"):
    """Spawn ``world`` prefill ranks; post their page writes through the pd transfer-engine model
    into one decode-side SGLang pool (all layers)."""
    import random

    from layersplit.pd.abort.sim import EventLoop
    from layersplit.pd.abort.transfer_engine import EngineFaults, TransferEngine, WriteTag

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_prefill_rank_worker, args=(r, world, pages, queue, kv_dtype)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    decode = compat.resolve("dsa_pool")(SIZE, **dsa_pool_kwargs(kv_dtype=kv_dtype))
    loop = EventLoop()

    def land(page_key, tag, payload):
        kind, layer_id, page = page_key
        buf = decode.kv_buffer[layer_id] if kind == "kv" else decode.get_index_k_with_scale_buffer(layer_id)
        item = len(payload)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buf.view(torch.uint8).flatten()[remap[page] * item:(remap[page] + 1) * item] = data

    engine = TransferEngine(loop, random.Random(0), land, EngineFaults())
    sent = {}
    for rank, sends, err in results:
        assert err is None, err
        for kind, layer_id, page, payload in sends:
            assert (kind, layer_id, page) not in sent, "two ranks sent the same layer"
            sent[(kind, layer_id, page)] = rank
            engine.post([(kind, layer_id, page)], [WriteTag(0, 0)], [payload], lambda b, s: None, lambda b: None)
    loop.run()
    return decode, sent


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_pd_transfer_of_layer_split_prefill_equals_redundant():
    """Two layer-split prefill ranks (processes) each send only their owned layers into one decode
    pool; the decode pool ends up byte-identical to what one redundant prefill sends."""
    pages, remap = [0, 2, 5], {0: 3, 2: 4, 5: 7}  # decode places the request in its own pages
    split, who = _decode_receives(2, pages, remap)
    redundant, _ = _decode_receives(1, pages, remap)
    assert sorted({layer for (_, layer, _) in who}) == list(range(LAYERS))
    assert {r for (kind, layer, _), r in who.items() if kind == "kv"} == {0, 1}  # both ranks sent
    for i in range(LAYERS):
        assert torch.equal(split.kv_buffer[i].view(torch.uint8), redundant.kv_buffer[i].view(torch.uint8))
        assert torch.equal(split.get_index_k_with_scale_buffer(i), redundant.get_index_k_with_scale_buffer(i))
    assert split.kv_buffer[0].view(torch.uint8).any()  # something was actually transferred


def test_hicache_stress_indexer_reads_never_race_the_load():
    """SGLang's own load path (real DSAIndexerPoolHost, our counter and engine subclasses) on the
    emulated streams: the indexer reads each layer's keys as soon as they land, before the KV rows,
    and never reads them early."""
    from layersplit.sglang_plugin import stress

    safe = stress.run(iterations=30, seed=3)
    assert safe.index_reads == safe.kv_reads == 30 * 4
    assert safe.stale_index_reads == 0 and safe.stale_kv_reads == 0
    assert safe.early_index_reads > 0  # the indexer started before the layer's KV rows landed
    upstream = stress.run(iterations=10, seed=3, upstream=True)
    assert upstream.stale_index_reads == 0 and upstream.early_index_reads == 0  # one event per layer


def test_hicache_stress_detects_a_missing_indexer_wait():
    """The same stress with the indexer's wait switched off (documented unsafe flag) must catch reads
    of keys that have not landed yet; otherwise the detector proves nothing."""
    from layersplit.sglang_plugin import stress

    unsafe = stress.run(iterations=30, seed=3, unsafe_skip=("index_wait",))
    assert unsafe.stale_index_reads > 0
    assert unsafe.stale_kv_reads == 0  # attention still waits the whole layer


def test_engine_defers_to_upstream_without_indexer_transfers():
    """No DSA indexer host pool in the transfer (or upstream's counter): upstream's loop runs as is."""
    from layersplit.sglang_plugin import hicache

    engine_cls = hicache.make_engine_class()
    calls = []
    base = compat.resolve("l2_transfer_engine")
    original = base.submit_host_to_device
    try:
        base.submit_host_to_device = lambda self, transfers, **kw: calls.append(len(transfers)) or "upstream"
        engine = engine_cls.__new__(engine_cls)
        plain = SimpleNamespace(host_pool=object())
        assert engine.submit_host_to_device([plain], transfer_layer_id_max=1, on_layer_done=print) == "upstream"
        counter = compat.resolve("layer_done_counter")(2)  # upstream counter: no indexer-ready events
        assert engine.submit_host_to_device([plain], transfer_layer_id_max=1,
                                            on_layer_done=counter.events[0].complete) == "upstream"
    finally:
        base.submit_host_to_device = original
    assert calls == [1, 1]


def test_plugin_indexer_reads_wait_only_for_indexer_keys(monkeypatch):
    """The plug-in pool's indexer-key read waits the indexer-ready event of its layer, not the whole
    layer; a latent-KV read waits the whole layer."""
    monkeypatch.setenv("LAYERSPLIT_SGLANG_LANDING", "pool")  # the whole-buffer read needs the landing layer
    waits = []
    counter = SimpleNamespace(wait_until=lambda i: waits.append(("layer", i)),
                              wait_index_until=lambda i: waits.append(("index", i)))
    pool = make_pool(0)
    pool.register_layer_transfer_counter(counter)
    pool.index_key_cache.remote_layer_id = 1  # already broadcast: no collective needed here
    pool.get_broadcastable_index_k_with_scale_buffer(1)
    assert waits == [("index", 1)]


def test_indexer_key_path_waits_only_for_indexer_keys():
    """The AROUND hook on IndexKeyCache.get_local_buffer (how the indexer stores and, on plain DSA
    pools, reads its keys) waits the indexer-ready event and returns upstream's own buffer; with
    upstream's counter it is upstream's method unchanged."""
    from layersplit.sglang_plugin.hicache import around_get_local_buffer

    plain = compat.resolve("dsa_pool")(SIZE, **pool_kwargs())
    original = compat.resolve("index_key_cache").get_local_buffer
    waits = []
    plain.register_layer_transfer_counter(SimpleNamespace(wait_until=lambda i: waits.append(("layer", i)),
                                                          wait_index_until=lambda i: waits.append(("index", i))))
    got = around_get_local_buffer(original, plain.index_key_cache, 3)
    assert waits == [("index", 3)]
    want = original(plain.index_key_cache, 3)
    assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
    waits.clear()
    plain.register_layer_transfer_counter(SimpleNamespace(wait_until=lambda i: waits.append(("layer", i))))
    around_get_local_buffer(original, plain.index_key_cache, 2)
    assert waits == [("layer", 2)]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_staging_slot_events_under_real_asynchrony():
    """The pool's side-stream broadcasts (gloo, on an emulated stream with random stalls, while the
    owners' prefix pages reload from host on an emulated load stream): every layer read equals the
    single-process upstream pool; with the slot wait or the load wait switched off (documented unsafe
    flags) the same run reads rows that have not arrived."""
    from layersplit.sglang_plugin.stress import run_pool

    safe = run_pool(iterations=6)
    assert safe.layer_reads == 2 * 6 * LAYERS and safe.stale_reads == 0, safe
    unsafe = run_pool(iterations=6, unsafe_skip=("slot_wait",))
    assert unsafe.stale_reads > 0, unsafe
    # the broadcast's wait for the owner's HiCache load, switched off: whether a receiver then reads
    # rows still loading depends on the random stalls (seed 0 reads none since the batch-sized landing);
    # test_pool_clean_under_the_sanitizer reports that missing order deterministically


def test_stress_command_line(capsys, monkeypatch):
    """``layersplit stress sglang-hicache``: JSON report, exit 0 when safe and when the unsafe run is
    caught; a clear error without sglang."""
    import importlib.util
    import json

    from layersplit.cli.app import main

    assert main(["stress", "sglang-hicache", "--iterations", "10"]) == 0
    safe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert safe["stale_index_reads"] == 0 and safe["index_reads"] == 40
    assert main(["stress", "sglang-hicache", "--iterations", "10", "--unsafe-skip-wait"]) == 0
    unsafe = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert unsafe["stale_index_reads"] > 0 and unsafe["unsafe_skip"] == ["index_wait"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(SystemExit, match="expected sglang to be installed"):
        main(["stress", "sglang-pool", "--iterations", "1"])


def test_hicache_adapter_clean_under_the_sanitizer():
    """SGLang's load path with our counter, under the stream-ordering sanitizer, no stalls: the
    indexer-first engine and the fallback to upstream's loop (our counter, upstream's engine) leave no
    unordered access; the fallback without its indexer-ready record, or the indexer without its wait,
    is reported (the fallback's wait on a never-recorded event returned at once)."""
    from layersplit.sglang_plugin import stress

    for kw in ({}, {"fallback": True}):
        clean = stress.run(iterations=6, seed=3, max_stall_s=0.0, sanitize=True, **kw)
        assert clean.sanitizer_hazards == 0, (kw, clean.sanitizer_hazard_list)
        assert clean.stale_index_reads == clean.stale_kv_reads == 0
    for kw, skip in (({"fallback": True}, "index_fallback"), ({}, "index_wait")):
        caught = stress.run(iterations=6, seed=3, max_stall_s=0.0, sanitize=True, unsafe_skip=(skip,), **kw)
        assert caught.sanitizer_hazards > 0 and all("read_index" in h for h in caught.sanitizer_hazard_list), skip


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_pool_clean_under_the_sanitizer():
    """The plug-in pool's staged broadcasts on two gloo ranks with HiCache reloads, sanitized, no stalls:
    no unordered access; each unsafe wait is reported even when no stale row happens to be read."""
    from layersplit.sglang_plugin.stress import run_pool

    safe = run_pool(iterations=3, max_stall_s=0.0, sanitize=True)
    assert safe.sanitizer_hazards == 0 and safe.stale_reads == 0, safe.sanitizer_hazard_list
    slot = run_pool(iterations=3, max_stall_s=0.0, sanitize=True, unsafe_skip=("slot_wait",))
    assert any("c10d::broadcast_" in h and "stream forward" in h for h in slot.sanitizer_hazard_list), slot
    load = run_pool(iterations=3, max_stall_s=0.0, sanitize=True, unsafe_skip=("load_wait",))
    assert any("send" in h and "_HostLoader" not in h and "index_copy_" in h for h in load.sanitizer_hazard_list), load
