"""Does SGLang 0.5.23's own layer split work with ``--kv-cache-dtype fp8_e4m3``? On the CPU contract
path: upstream's ``LayerSplitDSATokenToKVPool`` in the fp8 DSA layout, two CP ranks over gloo, written
through ``set_mla_kv_buffer`` (the door the DSA backend writes through) and read in the model's order.
Its only fp8 refusal is the assertion in ``set_kv_buffer``, which the DSA backend does not call."""

from __future__ import annotations

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

from layersplit.sglang_plugin import compat  # noqa: E402
from layersplit.sglang_plugin.stress import SIZE, dsa_pool_kwargs, forward_layers, published, write_prefix  # noqa: E402

LAYERS = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        fp8 = dsa_pool_kwargs(layers=LAYERS, kv_dtype="fp8")  # each rank owns one layer, reads the other's
        with published():
            ref = compat.resolve("dsa_pool")(SIZE, **fp8)
            write_prefix(ref, layers=LAYERS)
            want = forward_layers(ref, seed=7, layers=LAYERS)
        with published(world=2, group=dist.group.WORLD):
            pool = compat.resolve("layer_split_pool")(SIZE, **fp8, layer_shard_rank=rank, layer_shard_size=2)
            write_prefix(pool, layers=LAYERS)
            got = forward_layers(pool, seed=7, layers=LAYERS)
        same = [bool(torch.equal(g.view(torch.uint8), w.view(torch.uint8))) for gw in zip(got, want)
                for g, w in zip(*gw)]
        queue.put((rank, same, pool.dsa_kv_cache_store_fp8, tuple(pool.kv_buffer[rank].shape), None))
    except Exception:
        import traceback

        queue.put((rank, None, None, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_upstream_layer_split_serves_fp8_on_the_contract_path():
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for rank, same, store_fp8, shape, err in results:
        assert err is None, err
        assert store_fp8 and shape[-1] == 656  # SGLang's fp8 DSA row: 512 e4m3 + 4 fp32 scales + 64 bf16
        assert same and all(same), f"rank {rank}: upstream fp8 reads differ from the plain fp8 pool: {same}"


def test_upstreams_only_fp8_refusal_is_the_door_the_dsa_backend_does_not_use():
    cls = compat.resolve("layer_split_pool")  # the source-text half: test_upstream_contract.py
    with published(world=2):
        pool = cls(SIZE, **dsa_pool_kwargs(kv_dtype="fp8"), layer_shard_rank=0, layer_shard_size=2)
    with pytest.raises(AssertionError):
        pool.set_kv_buffer(SimpleNamespace(layer_id=0), torch.arange(4), torch.zeros(4, 1, 576, dtype=torch.bfloat16),
                           None)
