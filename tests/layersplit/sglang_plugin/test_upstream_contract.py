"""What the plug-in relies on in SGLang 0.5.23, read from the installed package: the signatures of every
method it hooks or subclasses, and the lines of upstream source whose order or presence its hooks assume.
One file, so an upgrade shows in one place what moved; the behaviour built on each fact is tested beside
the code that uses it (``test_plugin.py``, ``test_startup.py``, ``test_upstream_fp8.py``, ``spec/test_step.py``)."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap

import pytest

if os.environ.get("CI"):
    import sglang  # noqa: F401 -- the plug-in tests must run in CI
else:
    pytest.importorskip("sglang")

from layersplit.sglang_plugin import batch, budget, compat, hicache, pool, sharing  # noqa: E402
from layersplit.sglang_plugin.stress import dsa_pool_kwargs  # noqa: E402


def test_hooked_and_subclassed_signatures():
    for contract in (pool.UPSTREAM_CONTRACT, hicache.UPSTREAM_CONTRACT):
        for concept, methods in contract.items():
            base = compat.resolve(concept)
            for name, expected in methods.items():
                assert name in dir(base), f"upstream {base.__name__}.{name} disappeared"
                got = str(inspect.signature(getattr(base, name)))
                assert got == expected, f"upstream {base.__name__}.{name} changed signature: {got}"
    backend = compat.resolve("dsa_backend")
    assert str(inspect.signature(getattr(backend, batch.TARGET_METHOD))) == batch.TARGET_SIGNATURE
    from sglang.srt.managers import schedule_batch, schedule_policy

    assert str(inspect.signature(schedule_batch.ScheduleBatch.prepare_for_extend)) == sharing.PREPARE_SIGNATURE
    assert str(inspect.signature(schedule_policy.PrefillAdder.add_one_req)) == sharing.ADMISSION_SIGNATURE


def test_the_pool_is_built_with_the_keywords_the_plugin_accepts():
    """SGLang builds the layer-split pool in ``KVCacheConfigurator._build_dsa_kv_pool`` as
    ``PoolCls(max_total_num_tokens, <keywords>, **pool_kwargs)``: the keywords read from that source are
    exactly the ones the plug-in's tests construct with (plus the layer-shard pair it adds)."""
    configurator = __import__("sglang.srt.mem_cache.kv_cache_configurator", fromlist=["x"]).KVCacheConfigurator
    tree = ast.parse(textwrap.dedent(inspect.getsource(configurator._build_dsa_kv_pool)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "PoolCls"]
    assert len(calls) == 1 and len(calls[0].args) == 1
    passed = {k.arg for k in calls[0].keywords if k.arg is not None}
    extra = {t.slice.value for t in ast.walk(tree) if isinstance(t, ast.Subscript)
             and getattr(t.value, "id", None) == "pool_kwargs" and isinstance(t.slice, ast.Constant)}
    assert {"layer_shard_rank", "layer_shard_size"} <= extra
    assert passed == set(dsa_pool_kwargs()), passed ^ set(dsa_pool_kwargs())


def test_the_budget_hooks_meet_upstreams_pool_sizing():
    from sglang.srt.layers.cp import utils
    from sglang.srt.model_executor import pool_configurator

    assert str(inspect.signature(utils.get_glm_dsa_layer_split_effective_num_layers)) == budget.EFFECTIVE_LAYERS_SIGNATURE
    assert str(inspect.signature(pool_configurator.DefaultPoolConfigurator.__init__)) == budget.CONFIGURATOR_SIGNATURE
    assert "available_bytes - self._fixed_overhead_bytes" in inspect.getsource(
        pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes)


def test_the_kernel_is_chosen_inside_init_forward_metadata():
    """The batch hook runs AFTER ``init_forward_metadata`` because upstream resolves ``flashmla_auto`` there."""
    from sglang.srt.layers.attention import dsa_backend

    src = inspect.getsource(dsa_backend.DeepseekSparseAttnBackend.init_forward_metadata)
    assert "self.set_dsa_prefill_impl(forward_batch)" in src


def test_upstreams_only_fp8_refusal_is_a_door_the_dsa_backend_does_not_use():
    from sglang.srt.layers.attention import dsa_backend

    cls = compat.resolve("layer_split_pool")
    assert "assert not self.dsa_kv_cache_store_fp8" in inspect.getsource(cls.set_kv_buffer)
    assert "dsa_kv_cache_store_fp8" not in inspect.getsource(cls.set_mla_kv_buffer)
    backend_src = inspect.getsource(dsa_backend)
    assert "set_mla_kv_buffer" in backend_src and ".set_kv_buffer(" not in backend_src


def test_the_per_step_speculative_path():
    """What the per-step monitor relies on: the per-step method, called after the counters move and before
    the step's finish check; the finish check honours ``to_finish``; FINISH_ABORT's signature."""
    assert compat.spec_step_target() == "sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram"
    schedule_batch = sys.modules[compat.resolve("finish_abort").__module__]
    assert str(inspect.signature(schedule_batch.Req.update_spec_correct_drafts_histogram)) == \
        "(self, num_correct_drafts: 'int')"
    assert str(inspect.signature(schedule_batch.FINISH_ABORT)) == "(message=None, status_code=None, err_type=None)"
    processor = __import__("sglang.srt.managers.scheduler_components.batch_result_processor",
                           fromlist=["x"]).SchedulerBatchResultProcessor
    resolve = inspect.getsource(processor._resolve_spec_v2_tokens)
    order = ["req.spec_verify_ct += 1", "req.spec_num_correct_drafts += num_correct_drafts",
             "req.update_spec_correct_drafts_histogram(num_correct_drafts)"]
    assert [resolve.index(s) for s in order] == sorted(resolve.index(s) for s in order)
    decode = inspect.getsource(processor.process_batch_result_decode)
    order = ["self._normalize_decode_outputs(", "req.output_ids.extend(next_token_id)",
             "req.update_finish_state(new_accept_len)", "self.output_streamer.stream_output("]
    assert [decode.index(s) for s in order] == sorted(decode.index(s) for s in order)
    assert "self.finished_reason = self.to_finish" in inspect.getsource(schedule_batch.Req.update_finish_state)
