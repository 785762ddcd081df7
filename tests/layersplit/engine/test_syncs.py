"""One rank's prefill issues no host synchronization inside the forward (:class:`hicache.runtime.syncs.SyncCounter`).

A synchronization cannot be observed on CPU, so the counter flags what would synchronize on a GPU:
``.item()`` and friends, ``.tolist()`` / ``.numpy()``, ``nonzero`` / ``unique`` / boolean masks,
blocking or unpinned copies between device and host, and host tensors handed to device ops.

What counts as a *device* tensor here: everything the rank engine holds when ``prefill`` starts
(weights, the device pool, scratch), every tensor a factory makes inside the forward (device code
passes ``device=``) and every result computed from one. *Host*: the batch plan as
``plan_batch`` builds it (host metadata; moving it to the device is counted), tensors made from
Python data (``torch.tensor(list)``), module-level constants, and host memory (the host-tier pool).
The cached-prefix fill (``fill_prefix``) is paused: it stands for a cache that already holds the
prefix, which a real forward finds, not makes. Work on the emulated load and comm streams is counted
too (a GPU host runs a stream op's Python when it submits it).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hicache.runtime.streams import EmulatedRuntime
from hicache.runtime.syncs import SyncCounter
from layersplit.engine import engine as engine_mod
from layersplit.engine.batch_plan import Request
from layersplit.engine.engine import EngineConfig, RankEngine
from layersplit.plan.config import load_model

TINY = load_model("tiny")


def toks(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


# one batch with both tiers: a prefix reloaded from the host tier and one already in the device pool
REQUESTS = [Request(70, toks(10, 11), from_host=True), Request(65, toks(7, 12))]


def forward_syncs(requests: list[Request], monkeypatch) -> list[tuple[str, str]]:
    """``(what, file:line (function))`` for every host sync of one cp=1 rank's ``prefill``."""
    rt = EmulatedRuntime()
    guard = SyncCounter(factories_on_device=True)
    plan_batch, fill_prefix = engine_mod.plan_batch, engine_mod.fill_prefix

    def host_plan(*args, **kwargs):  # built on the host before the forward
        with guard.paused():
            plan = plan_batch(*args, **kwargs)
        guard.device_reachable(plan)  # (walk it) ...
        for t in _tensors(plan):
            guard.host(t)  # ... then declare it host metadata: moving it to the device is counted
        return plan

    def cached_prefix(*args, **kwargs):
        with guard.paused():
            return fill_prefix(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "plan_batch", host_plan)
    monkeypatch.setattr(engine_mod, "fill_prefix", cached_prefix)
    try:
        eng = RankEngine(TINY, EngineConfig(cp=1, pool_pages=32, max_batch_tokens=1024, max_requests=4), 0, rt)
        with guard:
            assert guard.device_reachable(eng) > 0
            eng.prefill(requests)
    finally:
        rt.close()
    return guard.sites()


def _tensors(obj, depth: int = 4) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if hasattr(obj, "__dict__") else ()
    return [t for v in items for t in _tensors(v, depth - 1)]


def _site(what: str, where: str) -> tuple[str, str]:
    """``(what, innermost file (function))``: line numbers left out, so edits elsewhere in a file do
    not change the expected list."""
    first = where.split(" < ")[0]
    path, _, rest = first.partition(":")
    return what, f"{path} {rest.partition(' ')[2]}"


# The engine's own syncs are gone (the plan and the poisoned page ids are copied non_blocking from
# pinned host memory, results are copied back by the launcher after the forward): on the Triton
# backend, the path a GPU takes, one forward has none. What remains is in the torch reference, the
# CPU fallback only: each entry is (what, site): count per forward.
TORCH_REFERENCE_REMAINING = {  # dsa_kernels/reference/indexer.py indexer_scores, per indexer layer x request
    ("aten._unique2.default", "dsa_kernels/reference/indexer.py (indexer_scores)"): 5,
    ("tolist", "dsa_kernels/reference/indexer.py (indexer_scores)"): 5,
    ("aten.nonzero.default", "dsa_kernels/reference/indexer.py (indexer_scores)"): 10,
    ("aten._local_scalar_dense.default", "dsa_kernels/reference/indexer.py (indexer_scores)"): 10,
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.slow
def test_one_rank_prefill_syncs(backend, monkeypatch):
    """Every host sync of one forward, per site; the Triton backend is the path a GPU takes (the
    interpreter's own emulation of loads and stores is not counted), torch the CPU fallback."""
    monkeypatch.setenv("LAYERSPLIT_KERNEL_BACKEND", backend)
    sites = forward_syncs(REQUESTS, monkeypatch)
    for what, where in sites:
        print(f"{where}: {what}")
    want = TORCH_REFERENCE_REMAINING if backend == "torch" else {}
    assert dict(Counter(_site(*s) for s in sites)) == want


def test_the_counter_sees_each_kind_of_sync():
    """Teeth: each kind the engine test relies on is flagged on a device tensor, and none on host
    metadata or with the non-blocking forms."""
    dev, host = torch.arange(6.0), torch.arange(6.0)
    with SyncCounter(factories_on_device=True) as guard:
        guard.device(dev)
        guard.host(host)
        made = torch.zeros(3)  # a factory inside the forward: device
        dev.tolist(), dev.numpy(), dev.sum().item(), bool(dev[0]), dev.cpu()
        dev.nonzero(), dev[dev > 2], host.to(dev.device), dev.add(host)
        made.copy_(host[:3])
        host.tolist(), host.sum().item(), host.to(dev.device, non_blocking=True), made.copy_(host[:3], non_blocking=True)
        dev.add(torch.tensor(1.0))  # a 0-dim host scalar is passed by value
    kinds = [what.split(" ")[0] for what in guard.syncs]
    assert kinds == ["tolist", "numpy", "aten._local_scalar_dense.default", "aten._local_scalar_dense.default",
                     ".cpu()", "aten.nonzero.default", "aten.index.Tensor", ".to(device)", "aten.add.Tensor",
                     "copy_"], guard.sites()
    assert all("test_syncs.py" in where for where in guard.where)
