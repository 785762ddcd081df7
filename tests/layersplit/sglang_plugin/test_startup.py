"""The plug-in decides at start-up (landing, refusals, staging) and charges every byte to SGLang's KV
budget; prefix pages shared by a batch's requests are staged once; the kernel decision is read
after upstream makes it. Against the real sglang package, on CPU."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import batch as batch_hook  # noqa: E402
from layersplit.sglang_plugin import budget, sharing, startup  # noqa: E402
from layersplit.sglang_plugin.pool import make_pool_class  # noqa: E402
from layersplit.sglang_plugin.stress import PAGE, SIZE, dsa_pool_kwargs, published  # noqa: E402

ROW, INDEX_PAGE = 576 * 2, PAGE * 132  # GLM-5 bf16 latent row, indexer page


@pytest.fixture(autouse=True)
def _clean():
    startup.forget()
    sharing.forget()
    yield
    startup.forget()
    sharing.forget()


def plan(landing: str = "batch", slot_pages: int = 4) -> startup.Plan:
    return startup.Plan(landing=landing, reasons=(), slot_pages=slot_pages, page_size=PAGE, kv_row_bytes=ROW,
                        index_page_bytes=INDEX_PAGE)


def make_pool(p: startup.Plan | None):
    if p is not None:
        startup.publish(p)
    with published(world=2):
        return make_pool_class()(SIZE, **dsa_pool_kwargs(), layer_shard_rank=0, layer_shard_size=2)


# -- the start-up decision ------------------------------------------------------------------------
@pytest.mark.parametrize("settings,landing,flag", [
    (dict(prefill_impl="flashmla_sparse"), "batch", None),
    (dict(prefill_impl="flashmla_auto"), "batch", None),  # resolves per batch to flashmla_sparse / _kv
    (dict(prefill_impl="trtllm"), "pool", "--dsa-prefill-backend trtllm"),  # Blackwell fp8 default
    (dict(prefill_impl="aiter"), "pool", "--dsa-prefill-backend aiter"),
    (dict(prefill_impl="flashmla_kv", index_kpool=2), "pool", "index k-pool 2"),
    (dict(prefill_impl="flashmla_kv", graphs=True), "pool", "--cuda-graph-backend-prefill"),
], ids=["flashmla_sparse", "flashmla_auto", "trtllm", "aiter", "kpool2", "cuda-graphs"])
def test_startup_landing_per_trigger(settings, landing, flag):
    got, reasons = startup.decide(**{"graphs": False, "hisparse": False, "index_kpool": 1, **settings})
    assert got == landing
    assert (flag is None and reasons == ()) or any(flag in r for r in reasons), reasons


def test_hisparse_is_refused_at_startup_with_one_line_naming_the_flag():
    with pytest.raises(startup.StartupRefused, match="--enable-hisparse is refused") as info:
        startup.decide(prefill_impl="flashmla_kv", graphs=False, hisparse=True, index_kpool=1)
    assert "\n" not in str(info.value)


def test_graph_config_reading():
    off = SimpleNamespace(backend=SimpleNamespace(value="disabled"))
    on = SimpleNamespace(backend=SimpleNamespace(value="piecewise"))
    assert not startup.graphs_enabled(SimpleNamespace(prefill=off, decode=off))
    assert startup.graphs_enabled(SimpleNamespace(prefill=on, decode=off))


def test_slot_holds_a_whole_context():
    assert startup.slot_pages(131072, 202752, PAGE) == 202752 // PAGE + 1  # GLM-5: 200k context > the env default
    assert startup.slot_pages(300000, 202752, PAGE) == -(-300000 // PAGE)


# -- the budget -----------------------------------------------------------------------------------
def test_budget_charges_what_the_pool_allocates(monkeypatch):
    """The AFTER hook on SGLang's pool configurator adds both slots to the fixed overhead SGLang takes
    off the available memory, and the remap table to the cell; the pool built next allocates exactly
    those bytes (its own check), owned layers only, all at start-up."""
    p = plan(slot_pages=3)
    monkeypatch.setattr(budget, "_layer_split_on", lambda kvc: True)
    monkeypatch.setattr(budget, "plan_for", lambda kvc: p)
    configurator = SimpleNamespace(_fixed_overhead_bytes=0, _cell_size=10_000)
    budget.after_configurator_init(None, configurator, SimpleNamespace(is_draft_worker=False))
    assert configurator._fixed_overhead_bytes == p.staging_bytes == 2 * 3 * (PAGE * ROW + INDEX_PAGE)
    assert configurator._cell_size == 10_000 + budget.REMAP_CELL_BYTES and startup.current() is p
    pool = make_pool(None)  # takes the published plan
    assert pool.staging_bytes() == p.staging_bytes + p.remap_bytes(SIZE)
    assert p.remap_bytes(SIZE) <= budget.REMAP_CELL_BYTES * SIZE + 16  # the 1 B a token covers it
    assert pool.remote_kv_buffer is None and pool.index_key_cache.remote_buffer is None


def test_pool_landing_plan_allocates_and_counts_upstreams_layer_at_startup(monkeypatch):
    monkeypatch.setattr(budget, "_layer_split_on", lambda kvc: True)
    monkeypatch.setattr(budget, "plan_for", lambda kvc: plan("pool"))
    upstream = lambda runner, layers: -(-layers // 8) + 1  # noqa: E731 (upstream's count at CP8)
    assert budget.around_effective_num_layers(upstream, None, 78) == 11  # its landing layer stays counted
    monkeypatch.setattr(budget, "plan_for", lambda kvc: plan("batch"))
    assert budget.around_effective_num_layers(upstream, None, 78) == 10
    assert budget.around_effective_num_layers(lambda runner, layers: layers, None, 78) == 78  # split off
    pool = make_pool(plan("pool"))
    assert pool.remote_kv_buffer.shape[0] == SIZE + PAGE and pool.index_key_cache.remote_buffer is not None


# -- the kernel decision, read after upstream makes it --------------------------------------------
def _forward_batch(rtp):
    t = rtp.req_to_token
    t[0, :3 * PAGE] = torch.arange(PAGE, 4 * PAGE)
    return SimpleNamespace(req_pool_indices=torch.tensor([0]), seq_lens_cpu=None, extend_prefix_lens_cpu=[2 * PAGE],
                           extend_seq_lens_cpu=[PAGE - 10], rids=["a"], forward_mode=None)


def test_kernel_decision_is_read_after_upstream_resolves_flashmla_auto():
    """Upstream resolves ``flashmla_auto`` inside ``init_forward_metadata`` (``set_dsa_prefill_impl``):
    a hook running before it sees ``flashmla_auto``, which is no kernel; the plug-in's hook runs after."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = make_pool(plan())
    rtp = ReqToTokenPool(size=2, max_context_len=400, device="cpu", enable_memory_saver=False)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=rtp, dsa_prefill_impl="flashmla_auto")
    fb = _forward_batch(rtp)
    with published(world=2), pytest.raises(RuntimeError, match="did not allocate"):
        batch_hook.give_batch_pages(backend, fb)  # the stale (before) order: 'flashmla_auto' is uncovered
    backend.dsa_prefill_impl = "flashmla_sparse"  # what set_dsa_prefill_impl leaves for a bf16 pool
    with published(world=2):
        assert batch_hook.after_init_forward_metadata(None, backend, fb) is None
    assert pool.landing_now == "batch" and pool.forward_pages.tolist() == [1, 2, 3]  # no seq_lens_cpu needed
    assert pool._new_pages.tolist() == [3]


def test_plugin_registers_the_metadata_hook_after():
    import sys

    from layersplit.sglang_plugin import _state, register, unregister

    os.environ["LAYERSPLIT_SGLANG_PLUGIN"] = "1"
    argv, sys.argv = sys.argv, ["x"]
    try:
        assert register()
        kinds = {t.rsplit(".", 1)[-1]: k.value for t, _, k, _ in _state["hooks"]}
        assert kinds["init_forward_metadata"] == "after" and kinds["prepare_for_extend"] == "after"
        assert kinds["add_one_req"] == "around" and kinds["__init__"] == "after"
    finally:
        unregister()
        sys.argv = argv
        os.environ.pop("LAYERSPLIT_SGLANG_PLUGIN", None)


# -- shared prefixes: once per batch --------------------------------------------------------------
class Node:
    def __init__(self, parent, tokens: int):
        self.parent, self.key = parent, [0] * tokens


def _agents(n: int, prefix_pages: int, own_pages: int, new_tokens: int):
    """``n`` requests under one radix path of ``prefix_pages`` pages (the shared repository context),
    each with ``own_pages`` cached pages of its own and ``new_tokens`` to prefill."""
    root = Node(None, 0)
    shared = Node(root, prefix_pages * PAGE)
    reqs = []
    for i in range(n):
        own = Node(shared, own_pages * PAGE) if own_pages else shared
        prefix = (prefix_pages + own_pages) * PAGE
        reqs.append(SimpleNamespace(rid=f"r{i}", last_node=own, prefix_len=prefix,
                                    full_untruncated_fill_ids=[0] * (prefix + new_tokens), extend_end=prefix + new_tokens))
    return reqs


def test_shared_prefix_measured_on_the_host():
    reqs = _agents(3, prefix_pages=5, own_pages=2, new_tokens=70)
    assert sharing.shared_prefix_tokens(reqs, PAGE) == [0, 5 * PAGE, 5 * PAGE]
    lone = SimpleNamespace(rid="x", last_node=Node(Node(None, 0), 3 * PAGE), prefix_len=3 * PAGE)
    assert sharing.shared_prefix_tokens(reqs[:1] + [lone], PAGE) == [0, 0]  # another branch: nothing shared
    short = SimpleNamespace(rid="y", last_node=reqs[0].last_node, prefix_len=3 * PAGE + 10)
    assert sharing.shared_prefix_tokens(reqs[:1] + [short], PAGE) == [0, 3 * PAGE]  # at most its own prefix


def test_eight_agents_sharing_a_100k_prefix_broadcast_it_once(capsys):
    """8 requests sharing a 100k-token cached prefix (1562 whole pages; the radix cache holds whole
    pages), 2048 new tokens each: the prefix pages the batch stages and broadcasts per layer."""
    n, prefix_pages, new = 8, 100_000 // PAGE, 2048
    reqs = _agents(n, prefix_pages, 0, new)
    seq = [r.extend_end for r in reqs]
    prefix = [r.prefix_len for r in reqs]
    (before_p, _), (before_n, _) = batch_hook.page_columns(seq, prefix, PAGE)
    sharing.record(reqs, PAGE)
    shared = sharing.lookup([r.rid for r in reqs], prefix)
    (after_p, _), (after_n, _) = batch_hook.page_columns(seq, prefix, PAGE, shared)
    assert len(before_p) == n * prefix_pages and len(after_p) == prefix_pages
    assert len(before_n) == len(after_n) == n * new // PAGE
    per_layer = {k: (len(p) + len(q)) * (PAGE * ROW + INDEX_PAGE)
                 for k, (p, q) in {"before": (before_p, before_n), "after": (after_p, after_n)}.items()}
    print(f"8 x 100k shared prefix, bytes per layer (KV bf16 + index keys): {per_layer}")
    assert per_layer["after"] * 5 < per_layer["before"]
    assert batch_hook.page_columns(seq, prefix, PAGE, None) == batch_hook.page_columns(seq, prefix, PAGE, [0] * n)
    assert sharing.lookup(["r0", "r1"], [0, 0]) == [0, 0]  # a recorded prefix that does not match: no skip


def test_admission_keeps_the_batch_within_a_slot(monkeypatch):
    """Requests sharing the prefix join the batch (their own pages are few); one that would outgrow
    the slot waits for the next batch; a request alone is SGLang's admission unchanged."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    startup.publish(plan(slot_pages=20))
    reqs = _agents(3, prefix_pages=10, own_pages=0, new_tokens=2 * PAGE)  # 10 + 3 x (2 + 1) = 19 pages
    admitted, calls = [], []

    def original(adder, req, *a):
        calls.append(req.rid)
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    adder = SimpleNamespace(can_run_list=admitted)
    for r in reqs:
        assert sharing.around_add_one_req(original, adder, r, False, None) == AddReqResult.CONTINUE
    other = _agents(1, prefix_pages=2, own_pages=0, new_tokens=PAGE)[0]  # another branch: 2 + 1 + 1 pages
    assert sharing.around_add_one_req(original, adder, other, False, None) == AddReqResult.OTHER
    assert calls == ["r0", "r1", "r2"]
    assert sharing.around_add_one_req(original, SimpleNamespace(can_run_list=[]), other, False, None) \
        == AddReqResult.CONTINUE


def test_batch_beyond_the_slot_is_an_error_not_an_allocation():
    pool = make_pool(plan(slot_pages=2))
    before = pool.staging_bytes()
    with pytest.raises(RuntimeError, match="exceeds the staging slot"):
        pool.set_batch_pages(torch.tensor([0, 1]), torch.tensor([2]))
    assert pool.staging_bytes() == before


# -- no allocation after start-up, every trigger ---------------------------------------------------
class BufferAllocations:
    """Counts factory allocations (``empty``/``zeros``/``full`` and their ``_like``/``new_`` forms) of at
    least ``min_bytes`` while active: the pool allocates its buffers so; a forward's temporaries are
    smaller or made by other ops."""

    FACTORIES = ("empty", "empty_strided", "zeros", "full", "empty_like", "zeros_like", "new_empty", "new_zeros")

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes, self.seen = min_bytes, []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ in counter.FACTORIES and isinstance(out, torch.Tensor) \
                        and out.numel() * out.element_size() >= counter.min_bytes:
                    counter.seen.append((func.overloadpacket.__name__, tuple(out.shape)))
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _backend_and_batch(pool, impl: str):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    rtp = ReqToTokenPool(size=2, max_context_len=400, device="cpu", enable_memory_saver=False)
    rtp.req_to_token[0, :4 * PAGE] = torch.arange(PAGE, 5 * PAGE)  # pages 1..4 (prefix 1, 2; new 3, 4)
    fb = SimpleNamespace(req_pool_indices=torch.tensor([0]), seq_lens_cpu=torch.tensor([4 * PAGE - 5]),
                         extend_prefix_lens_cpu=[2 * PAGE], extend_seq_lens_cpu=[2 * PAGE - 5], rids=["a"],
                         forward_mode=None)
    return SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=rtp, dsa_prefill_impl=impl), fb


def _forward(pool) -> None:
    """Every layer in the model's order (index store + read, KV write + read, prefetch), the
    broadcast left out (one process stands for both ranks)."""
    from layersplit.sglang_plugin.stress import forward_layers

    pool._broadcast_tensor_from_owner = lambda tensor, *a, **k: tensor
    forward_layers(pool, seed=1)


@pytest.mark.parametrize("landing", ["batch", "pool"])
def test_no_allocation_after_startup_on_any_trigger(landing):
    """Built at start-up, the pool then serves (or refuses with a clear error) every trigger that
    used to allocate at run time: the kernel decision (``flashmla_auto``), a batch without
    ``seq_lens_cpu``, an uncovered kernel (``trtllm``), a CUDA-graph replay, a batch beyond the
    slot. No buffer of a page's rows or more is allocated after start-up."""
    with published(world=2):
        pool = make_pool(plan(landing, slot_pages=4))
    backend, fb = _backend_and_batch(pool, "flashmla_sparse")
    outcomes = {}
    with published(world=2), BufferAllocations(min_bytes=PAGE * ROW // 2) as allocs:
        for trigger in ("resolved-kernel", "no-seq_lens_cpu", "trtllm", "graph-replay", "over-slot"):
            try:
                if trigger == "no-seq_lens_cpu":
                    fb.seq_lens_cpu = None
                if trigger == "trtllm":
                    backend.dsa_prefill_impl = "trtllm"
                if trigger == "graph-replay":
                    batch_hook.before_out_graph_metadata(backend, fb, in_capture=False)
                elif trigger == "over-slot":
                    pool.set_batch_pages(torch.arange(1, 5), torch.tensor([5]))
                else:
                    batch_hook.after_init_forward_metadata(None, backend, fb)
                _forward(pool)
                outcomes[trigger] = "served"
            except RuntimeError as e:
                outcomes[trigger] = "refused: " + str(e).split(":")[1].strip()[:40]
    assert allocs.seen == [], allocs.seen
    assert outcomes["resolved-kernel"] == outcomes["no-seq_lens_cpu"] == "served"
    assert outcomes["over-slot"].startswith("refused")
    expect = "served" if landing == "pool" else "refused"
    assert outcomes["trtllm"].startswith(expect) and outcomes["graph-replay"].startswith(expect), outcomes
    with BufferAllocations(min_bytes=PAGE * ROW // 2) as teeth:  # what the run-time fallback used to do
        torch.empty((SIZE + PAGE, 1, 576), dtype=torch.bfloat16)
    assert teeth.seen == [("empty", (SIZE + PAGE, 1, 576))]
