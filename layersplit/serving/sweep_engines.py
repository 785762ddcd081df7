"""The sweep's two engines: both take the serving loop's batches and return one cost per batch.

* ``RealEngine`` runs every batch on the CP prefill engine (spawned ranks, gloo on CPU / NCCL on
  CUDA): L1 prefixes sit in the device pools, L2 prefixes are reloaded by the HiCache load pipeline
  from each rank's host tier (its held layers), misses recompute the prefix. Times are measured.
* ``ModelEngine`` prices the same batches with :class:`layersplit.serving.cost_model.CostModel` (modelled).
"""

from __future__ import annotations

from dsa_kernels.layout import PAGE_SIZE
from layersplit.plan.config import ModelConfig
from layersplit.serving.cost_model import BatchCost, CostModel
from layersplit.serving.serving import Batch


class RealEngine:
    measured = True

    def __init__(self, model: ModelConfig, cp: int, kv_dtype: str, seed: int, ownership: str = "contiguous") -> None:
        self.model, self.cp, self.kv_dtype, self.seed, self.ownership = model, cp, kv_dtype, seed, ownership

    def _scenario(self, i: int, batch: Batch, mode: str, name: str = ""):
        import torch  # the real engine's imports are heavy: the model engine does not need them

        from layersplit.engine.batch_plan import Request
        from layersplit.engine.engine import EngineConfig
        from layersplit.engine.launcher import Scenario

        g = torch.Generator().manual_seed(self.seed * 7919 + i)
        reqs = []
        for s in batch.served:
            prefix = 0 if s.tier == "miss" else s.req.prefix
            tokens = tuple(torch.randint(0, self.model.vocab_size, (s.prefill_tokens,), generator=g).tolist())
            reqs.append(Request(prefix, tokens, from_host=s.tier == "L2"))
        pages = sum(-(-(r.prefix_len + len(r.new_tokens)) // PAGE_SIZE) for r in reqs)
        cfg = EngineConfig(mode=mode, cp=self.cp, pool_pages=pages, max_batch_tokens=pages * PAGE_SIZE,
                           max_requests=len(reqs), kv_dtype=self.kv_dtype, trace=True, ownership=self.ownership)
        return Scenario(name or f"batch{i}", reqs, cfg)

    def run(self, batches: list[Batch], mode: str, repeats: int = 1) -> list[list[BatchCost]]:
        """Each repeat of every batch, in one spawn of the rank processes (repeat-major)."""
        from layersplit.engine.launcher import run_cp

        scenarios = [self._scenario(i, b, mode) for i, b in enumerate(batches)]
        results = run_cp(self.model, scenarios * repeats, self.cp)
        costs = [self._cost(r) for r in results]
        return [costs[k * len(batches):(k + 1) * len(batches)] for k in range(repeats)]

    @staticmethod
    def _cost(r) -> BatchCost:
        return BatchCost(r.seconds, max(x.bcast_wait_s for x in r.ranks), max(x.reload_bytes for x in r.ranks),
                         sum(r.ranks[0].bcast_bytes.values()))

    def run_paired(self, batches: dict[str, list[Batch]], repeats: int) -> dict[str, list[list[BatchCost]]]:
        """Every mode's batches ``repeats`` times in one spawn after one discarded warm-up batch of each:
        per mode, one list of costs per repeat. Within repeat k the modes' batches interleave (a0 b0 a1 b1
        ..., each batch a fresh engine on its requests), so a change of load longer than a batch hits both
        modes of the pair alike; the lead alternates per repeat (A B, B A, ...: an even ``repeats`` leads
        with each mode equally often)."""
        from layersplit.engine.launcher import run_cp
        from layersplit.serving.paired import alternating

        modes = tuple(batches)
        lead = alternating(modes, repeats)  # per repeat, the order the modes' batches interleave in
        slots = []  # (mode, repeat, batch), in run order
        for k in range(repeats):
            order = lead[k * len(modes):(k + 1) * len(modes)]
            for i in range(max(len(b) for b in batches.values())):
                slots += [(m, k, i) for m in order if i < len(batches[m])]
        warm = [self._scenario(0, batches[m][0], m, f"warmup-{m}") for m in modes]
        scenarios = warm + [self._scenario(i, batches[m][i], m, f"{m}-{k}-{i}") for m, k, i in slots]
        # the hang guard grows with the repeats: 10 s a batch (a 120k batch of the CPU job took ~2.1 s at a
        # load average near 8); run_cp's 600 s default alone stopped 12 repeats at 120k on a loaded machine
        results = run_cp(self.model, scenarios, self.cp, timeout_s=max(600.0, 10.0 * len(scenarios)))
        out: dict[str, list[list[BatchCost]]] = {m: [[] for _ in range(repeats)] for m in modes}
        for (m, k, i), r in zip(slots, results[len(warm):]):
            assert len(out[m][k]) == i, f"expected batch {len(out[m][k])} of {m} repeat {k}, got {i}"
            out[m][k].append(self._cost(r))
        return out


class ModelEngine:
    measured = False

    def __init__(self, cost: dict[str, CostModel]) -> None:
        self.cost = cost

    def run(self, batches: list[Batch], mode: str, repeats: int = 1) -> list[list[BatchCost]]:
        """The model is deterministic: one repeat whatever is asked."""
        return [[self.cost[mode].batch(b) for b in batches]]

