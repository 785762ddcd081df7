"""The GPU check's CP-engine probes: does the engine run on this device's kernels, is the KV broadcast
hidden under the indexer, and do the Triton and torch kernels write the same fp8 key bytes.

* :func:`overlap_probe` runs the tiny model on 2 ranks with both schedules, without and with a stall
  injected before every KV broadcast (``torch.cuda._sleep`` on the comm stream on CUDA), and reports
  per schedule: forward time (slowest rank's compute stream, CUDA events), broadcast waits as a share
  of it, ``exposed_share`` = growth / (stall x non-owned layers), and, from the stream-timed trace,
  per non-owned indexer layer the time from ``complete bcast_kv[l]`` to ``indexer[l]``'s start
  (negative: the broadcast was still landing when the indexer started). The happens-before order of
  the issued program (``RankResult.kv_order``) comes with it.
* :func:`fp8_key_bytes` quantizes the same keys with each backend and counts differing bytes.
"""

from __future__ import annotations

import torch

from layersplit.engine.engine import SCHEDULES, EngineConfig, FaultInjection
from layersplit.engine.launcher import Scenario, run_cp
from layersplit.plan.ownership import plan_ownership
from layersplit.engine.requests import synthetic_requests
from layersplit.plan.config import load_model


def _gaps_ms(rank) -> dict[int, float]:
    """``indexer[l]`` start minus ``complete bcast_kv[l]``, per non-owned indexer layer (ms)."""
    ev = {e["name"]: e for e in rank.trace}
    out = {}
    for layer, order in rank.kv_order.items():
        done, idx = ev.get(f"complete bcast_kv[{layer}]"), ev.get(f"indexer[{layer}]")
        if "indexer" in order and done is not None and idx is not None:
            out[layer] = round((idx["ts"] - done["ts"]) / 1e3, 3)
    return out


def overlap_probe(context: int, timeout_s: float, delay_ms: float | None = None) -> dict:
    """Both schedules without a stall, then with one before every KV broadcast. ``delay_ms`` None:
    half the overlapped schedule's mean layer time (a KV broadcast issued before MLP(l-1) has about one
    layer of work to hide under; half of it must hide, on any device)."""
    model = load_model("tiny")
    reqs = synthetic_requests(1, context, 0.9, model.vocab_size, 0)
    base = dict(mode="layersplit", cp=2, pool_pages=-(-context // 64), max_batch_tokens=context, max_requests=1)

    def runs(delay: float) -> dict:
        scs = [Scenario("warm-up", reqs, EngineConfig(**base))] if delay == 0 else []
        scs += [Scenario(s, reqs, EngineConfig(schedule=s, faults=FaultInjection(bcast_kv_delay_s=delay / 1e3), **base)) for s in SCHEDULES]
        return {r.name: r for r in run_cp(model, scs, 2, timeout_s=timeout_s)}

    plain = runs(0.0)
    if delay_ms is None:
        delay_ms = round(plain["overlapped"].seconds * 1e3 / model.num_layers / 2, 3)
    stalled = runs(delay_ms)
    own = plan_ownership(model.num_layers, 2, "contiguous")
    non_owned = max(model.num_layers - len(own.owned_layers(r)) for r in range(2))
    out = {"delay_ms": delay_ms, "context": context, "non_owned_layers": non_owned}
    for schedule in SCHEDULES:
        p, d = plain[schedule], stalled[schedule]
        orders = [o["indexer"] for r in p.ranks for o in r.kv_order.values() if "indexer" in o]
        out[schedule] = {
            "forward_ms": p.seconds * 1e3, "forward_with_delay_ms": d.seconds * 1e3,
            "bcast_wait_share": max(r.bcast_wait_s / r.seconds for r in p.ranks),
            "exposed_share": (d.seconds - p.seconds) / (delay_ms / 1e3 * non_owned),
            "indexer_after_kv_bcast": f"{sum(orders)} of {len(orders)}",
            "indexer_start_minus_bcast_done_ms": {f"r{r.rank}": _gaps_ms(r) for r in d.ranks},
        }
    return out


def fp8_key_bytes(device: torch.device, rows: int = 777, dim: int = 128) -> dict:
    """Differing bytes between the Triton and torch ``quantize_index_keys`` on the same bf16 keys."""
    from dsa_kernels.dispatch import resolve

    gen = torch.Generator().manual_seed(0)
    keys = (torch.randn(rows, dim, generator=gen) * 3).to(torch.bfloat16).to(device)
    pages = -(-rows // 64) + 1
    slots = (torch.randperm(pages * 64, generator=gen)[:rows]).to(device)
    caches = {}
    for backend in ("torch", "triton"):
        cache = torch.zeros(pages, 64 * (dim + 4), dtype=torch.uint8, device=device)
        resolve("quantize_index_keys", device, backend)[1](keys, cache, slots)
        caches[backend] = cache
    differ = int((caches["torch"] != caches["triton"]).sum())
    return {"rows": rows, "dim": dim, "differing_bytes": differ, "bytes": caches["torch"].numel(),
            "passed": differ == 0}
