"""Cost model of one prefill batch on N GPUs (default GLM-5 on 8 x H200). Everything it returns is
MODELLED, not measured.

Compute per layer is :class:`layersplit.serving.roofline.Roofline`'s (the same in every mode). On top,
where the cache lives decides what each rank waits for:

* host-tier reload: each rank copies the prefix pages of its held layers (KV sharding: its stripe,
  1/N, of every layer) from host memory, layer by layer on a load stream that runs ahead of compute;
  the CP ranks reload at once, so a rank gets ``HardwareConfig.reload_bandwidth(cp)``: its PCIe link,
  its share of its PCIe switch uplink and of host DRAM (with a shared host copy every rank reloads
  every layer from it);
* row broadcasts (``layersplit``, ``sglang-plugin``): the owner broadcasts the batch's prefix rows of
  layer ``l`` once its load of ``l`` is done and layer ``l-1``'s attention ended (issued before
  ``l-1``'s MLP); the indexer waits for the index part, attention for the KV part;
* upstream layer split (``upstream-layersplit``): the whole pool-sized landing layer is broadcast on
  each read; its indexer part synchronously when the indexer reads it, its KV part one layer ahead;
* page-level KV sharding (``kv-sharding*``, :mod:`layersplit.plan.kv_sharding`): every rank's stripe of
  the batch's prefix pages (each block padded to ``sum_i ceil(K_i / N)`` pages) is all-gathered on one
  FIFO gather stream; layer ``l``'s gather is kicked when layer ``l-1``'s slot is read (its indexer) and
  starts once every rank's load of ``l`` is done; layer 0's is kicked with the batch;
* query-moving (``query-moving``, :mod:`layersplit.plan.query_moving`): no history moves; after the
  projections the layer's owner takes the other ranks' queries (one source rank at a time, its own
  first), runs the indexer and attention for each, and returns each output as it is done
  (:func:`attention_phase`); every rank waits for its last output. The owner's attention for the others
  (``(N - 1)`` x a rank's) is ``owner_wait_s``, a part of compute: nothing overlaps it, as the MoE's
  expert-parallel exchange keeps every rank on the same layer;
* every mode all-gathers the new tokens' cache rows before attention (not overlapped);
* recompute of misses: the share of a batch's compute spent on prefixes it recomputes, taken as
  their share of the batch's prefill tokens (an approximation: attention grows faster than linear).

The breakdown is the slowest rank's: its time = compute + recompute + exposed reload + exposed
broadcast, each wait counted once. A non-owner's wait for a broadcast that could not start because
the owner was still loading that layer is exposed *reload* (its share of the wait); the rest of the
wait is exposed *broadcast*.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsa_kernels.layout import PAGE_SIZE
from layersplit.plan import kv_sharding, query_moving
from layersplit.plan.capacity import ModeBytes
from layersplit.plan.config import HardwareConfig, ModelConfig
from layersplit.serving.roofline import Efficiency, LayerTime, Roofline
from layersplit.serving.serving import Batch

__all__ = ["BatchCost", "CostModel", "Efficiency", "attention_phase", "pages_rows"]


@dataclass
class BatchCost:
    seconds: float
    exposed_comm_s: float  # waiting for broadcasts / gathers (the slowest rank)
    reload_bytes_per_rank: int  # max over ranks
    bcast_bytes: int  # summed over layers (what each receiving rank receives)
    exposed_reload_s: float = 0.0  # waiting for host-tier loads (the slowest rank)
    recompute_s: float = 0.0  # compute spent recomputing missed prefixes
    reload_ahead_bytes: int = 0  # most bytes any rank must reload ahead of an even pace (see CostModel)
    owner_wait_s: float = 0.0  # query-moving: the owner attending for the other ranks while they idle (in compute)

    @property
    def compute_s(self) -> float:
        """Compute that is not recomputing misses (what any mode must do for the new tokens)."""
        return max(0.0, self.seconds - self.exposed_comm_s - self.exposed_reload_s - self.recompute_s)


def pages_rows(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def attention_phase(c: float, q: float, o: float, cp: int) -> float:
    """Seconds of one query-moving layer from the queries' send to the last output's return: the owner
    attends to its own share (``c`` s) while the first other rank's queries arrive (``q`` s each, one
    after another over its NVLink), then to each share as it arrives, and sends each output back (``o``
    s each, one after another). ``cp`` shares in all; ``c`` alone at ``cp == 1``."""
    if cp == 1:
        return c
    step = max(c, q)
    return max(c + (cp - 1) * step + o, c + step + (cp - 1) * o)


def _split_wait(t: float, ready: float, load_gate: float, other_gate: float) -> tuple[float, float]:
    """(reload, comm) parts of waiting from ``t`` to ``ready`` for a transfer that could start only
    after ``load_gate`` (a host load) and ``other_gate`` (its issue)."""
    wait = max(0.0, ready - t)
    reload = min(wait, max(0.0, load_gate - max(t, other_gate)))
    return reload, wait - reload


_MEMOS: dict[tuple, dict[tuple, BatchCost]] = {}


class CostModel:
    def __init__(self, model: ModelConfig, hw: HardwareConfig, cp: int, kv_dtype: str, mb: ModeBytes,
                 eff: Efficiency = Efficiency(), pool_tokens: int = 0) -> None:
        """``pool_tokens``: the device pool's tokens per rank (upstream's landing layer is that large).
        ``kv_dtype`` is overridden by the mode's own (KV sharding as shipped runs fp8)."""
        self.m, self.hw, self.cp, self.mb, self.eff = model, hw, cp, mb, eff
        self.roof = Roofline(model, hw, mb.kv_dtype or kv_dtype, eff)
        self.per_layer, self.kv_bytes, self.indexer = self.roof.per_layer, self.roof.kv_bytes, self.roof.indexer
        rows_modes = mb.broadcast in ("rows", "pool", "queries")
        self.striped = frozenset(mb.striped)  # page-striped layers of an owned layout: gathered like KV sharding
        self.owner = ({layer: r for r, held in enumerate(mb.held_layers) for layer in held if layer not in self.striped}
                      if rows_modes else {})
        self.pool_rows = pages_rows(pool_tokens)
        self.reload_bw = hw.reload_bandwidth(cp)
        if mb.broadcast == "queries":  # per new token: queries to the owner, outputs back
            self.q_bytes = [query_moving.query_bytes_per_token(model, layer) for layer in range(model.num_layers)]
            self.o_bytes = [query_moving.output_bytes_per_token(model, layer) for layer in range(model.num_layers)]
        # a batch's cost depends only on its (prefix, tokens, tier) list and on these: cost models built
        # with the same ones (the sweeps of a gain map) share their memo
        self._memo = _MEMOS.setdefault((model, hw, cp, mb, eff, self.pool_rows), {})

    # host tier -------------------------------------------------------------------------------------
    def _layer_rows(self, reload_rows: int, striped_rows: int) -> list[int]:
        """Rows each layer reloads on a rank that holds it (striped layers: the rank's stripe)."""
        return [striped_rows if layer in self.striped else reload_rows for layer in range(self.m.num_layers)]

    def _loads(self, reload_rows: int, striped_rows: int = 0) -> dict[tuple[int, int], float]:
        """When each rank's load stream finishes each held layer (from t = 0)."""
        loads, rows = {}, self._layer_rows(reload_rows, striped_rows)
        for r, held in enumerate(self.mb.held_layers):
            t = 0.0
            for layer in held:
                t += rows[layer] * self.per_layer[layer] / self.reload_bw
                loads[(r, layer)] = t
        return loads

    def reload_ahead(self, reload_rows: int, striped_rows: int = 0) -> int:
        """Bytes a rank must have reloaded before layer ``l``'s turn beyond the even pace ``(l + 1) / L``
        of its total, maximised over ranks and layers: 0 when every rank reloads a share of every layer
        (redundant, KV sharding), a layer's rows or less with round-robin ownership, ~``L/N - 1`` layers
        with contiguous ownership (rank 0 must reload its whole range before the forward passes it)."""
        worst, layers, rows = 0.0, self.m.num_layers, self._layer_rows(reload_rows, striped_rows)
        for held in self.mb.held_layers:
            sizes = [self.per_layer[layer] * rows[layer] for layer in held]
            total, done = sum(sizes), 0
            for layer, size in zip(held, sizes):
                done += size
                worst = max(worst, done - total * (layer + 1) / layers)
        return int(worst)

    # one rank's timeline ---------------------------------------------------------------------------
    def _rank(self, r: int, layer_s: list[LayerTime], loads: dict, rows: int,
              gather_rows: int = 0) -> tuple[float, float, float]:
        """(end, exposed broadcast, exposed reload) of rank ``r`` (owned-layer and replicated layouts).

        A non-owner's row broadcast of layer ``l`` starts once it is issued (before layer ``l-1``'s
        MLP) and the owner's load of ``l`` is done, index part first; upstream's index part is
        issued at the indexer itself. The indexer waits for the index part, attention for the KV."""
        nv, pool = self.roof.nvlink, self.mb.broadcast == "pool"
        t = bcast = reload = issue = stream = 0.0
        for layer, ts in enumerate(layer_s):
            t += ts.pre
            if layer in self.striped:  # all-gathered like KV sharding once every rank loaded its stripe
                loaded = max(loads.get((q, layer), 0.0) for q in range(self.cp))
                queued = max(issue, stream)
                stream = ready = max(queued, loaded) + gather_rows * self.per_layer[layer] * (self.cp - 1) / self.cp / nv
                x, y = _split_wait(t, ready, loaded, queued)
                reload, bcast, t = reload + x, bcast + y, max(t, ready) + ts.indexer + ts.attention
                issue = t
                t += ts.mlp
                continue
            owner = self.owner.get(layer, r)
            loaded = loads.get((owner, layer), 0.0)
            if owner == r or not rows:  # own rows: wait for this rank's load only
                if loaded > t:
                    reload, t = reload + loaded - t, loaded
                t += ts.indexer  # (0 on layers without one)
                t += ts.attention
            else:
                index_s = rows * (self.per_layer[layer] - self.kv_bytes) / nv
                kv_s = rows * self.kv_bytes / nv
                if self.indexer[layer]:
                    gate = t if pool else issue
                    idx_ready = (gate if gate > loaded else loaded) + index_s
                    if idx_ready > t:  # _split_wait, inlined (the hot loop of the sweep)
                        x = min(idx_ready - t, max(0.0, loaded - (t if t > gate else gate)))
                        reload, bcast, t = reload + x, bcast + idx_ready - t - x, idx_ready
                    t += ts.indexer
                    kv_ready = (issue if issue > loaded else loaded) + kv_s if pool else idx_ready + kv_s
                else:
                    kv_ready = (issue if issue > loaded else loaded) + kv_s
                if kv_ready > t:
                    x = min(kv_ready - t, max(0.0, loaded - (t if t > issue else issue)))
                    reload, bcast, t = reload + x, bcast + kv_ready - t - x, kv_ready
                t += ts.attention
            issue = t  # layer l+1's broadcast is issued before this layer's MLP
            t += ts.mlp
        return t, bcast, reload

    def _gathered(self, layer_s: list[LayerTime], loads: dict, rows: int) -> tuple[float, float, float]:
        """KV sharding (every rank alike): (end, exposed gather, exposed reload)."""
        t, comm, reload, issue, stream = 0.0, 0.0, 0.0, 0.0, 0.0
        for layer, ts in enumerate(layer_s):
            t += ts.pre
            loaded = max(loads.get((r, layer), 0.0) for r in range(self.cp))  # a collective: every stripe
            queued = max(issue, stream)  # the gather stream is FIFO: after the previous layer's gather
            stream = ready = max(queued, loaded) + rows * self.per_layer[layer] * (self.cp - 1) / self.cp / self.roof.nvlink
            x, y = _split_wait(t, ready, loaded, queued)
            reload, comm = reload + x, comm + y
            t = max(t, ready)
            issue = t  # reading this layer's slot kicks the next layer's gather
            t += ts.indexer + ts.attention + ts.mlp
        return t, comm, reload

    def _query_moving(self, layer_s: list[LayerTime], loads: dict,
                      new_tokens: int) -> tuple[float, float, float, float]:
        """Query-moving (every rank waits for the layer's owner): (end, exposed transfer, exposed reload,
        owner wait). The owner first waits for its host load of the layer; the transfers add what
        :func:`attention_phase` takes beyond the owner's ``N`` shares of indexer + attention."""
        cp, share = self.cp, new_tokens / self.cp / self.roof.nvlink  # s per (byte a token) of one rank's share
        t = comm = reload = wait = 0.0
        for layer, ts in enumerate(layer_s):
            t += ts.pre
            loaded = loads.get((self.owner[layer], layer), 0.0)
            if loaded > t:
                reload, t = reload + loaded - t, loaded
            c = ts.indexer + ts.attention
            phase = attention_phase(c, share * self.q_bytes[layer], share * self.o_bytes[layer], cp)
            comm, wait = comm + phase - cp * c, wait + (cp - 1) * c
            t += phase + ts.mlp
        return t, comm, reload, wait

    # one batch -------------------------------------------------------------------------------------
    def batch(self, batch: Batch) -> BatchCost:
        """The batch's cost; batches with the same (prefix, tokens, tier) list share one (memoised)."""
        key = tuple((s.req.prefix, s.prefill_tokens, s.tier) for s in batch.served)
        if key not in self._memo:
            self._memo[key] = self._batch(batch)
        return replace(self._memo[key])

    def _rows(self, reqs: list[tuple[int, int, str]]) -> int:
        """Rows each receiving rank gets per layer (the gathered span for KV sharding)."""
        if self.cp == 1 or self.mb.broadcast in (None, "queries"):
            return 0
        if self.mb.broadcast == "pool":
            return self.pool_rows
        if self.mb.broadcast == "gather":
            return kv_sharding.gathered_pages([-(-p // PAGE_SIZE) for p, _, _ in reqs], self.cp) * PAGE_SIZE
        return sum(pages_rows(p) for p, _, _ in reqs)

    def _batch(self, batch: Batch) -> BatchCost:
        cp, mb = self.cp, self.mb
        reqs = [(s.req.prefix if s.tier != "miss" else 0, s.prefill_tokens, s.tier) for s in batch.served]
        reload_rows = sum(pages_rows(p) for p, _, tier in reqs if tier == "L2")
        if mb.stripe > 1:  # a rank loads back only its own pages of each layer
            reload_rows = -(-reload_rows // (PAGE_SIZE * mb.stripe)) * PAGE_SIZE
        striped_rows = -(-reload_rows // (PAGE_SIZE * cp)) * PAGE_SIZE if self.striped else 0
        rows = self._rows(reqs)
        gather_rows = (kv_sharding.gathered_pages([-(-p // PAGE_SIZE) for p, _, _ in reqs], cp) * PAGE_SIZE
                       if self.striped else 0)
        layer_s = self.roof.layers([(p, n) for p, n, _ in reqs], cp)
        loads = self._loads(reload_rows, striped_rows)
        owner_wait = 0.0
        if mb.broadcast == "gather":
            end, comm, reload_s = self._gathered(layer_s, loads, rows)
        elif mb.broadcast == "queries":
            end, comm, reload_s, owner_wait = self._query_moving(layer_s, loads, batch.new_tokens)
        else:
            ranks = range(cp) if self.owner else range(1)  # replicated layouts: every rank alike
            end, comm, reload_s = max((self._rank(r, layer_s, loads, rows, gather_rows) for r in ranks),
                                      key=lambda x: x[0])
        layer_rows = self._layer_rows(reload_rows, striped_rows)
        reload = max(sum(self.per_layer[layer] * layer_rows[layer] for layer in held) for held in mb.held_layers)
        received = rows * (cp - 1) // cp if mb.broadcast == "gather" else rows
        received_bytes = sum(self.per_layer[layer] * (gather_rows * (cp - 1) // cp if layer in self.striped else received)
                             for layer in range(self.m.num_layers))
        if mb.broadcast == "queries" and cp > 1:  # through the owner's links: queries in, outputs out
            received_bytes = sum(sum(query_moving.layer_bytes(self.m, cp, batch.new_tokens, layer))
                                 for layer in range(self.m.num_layers))
        missed = sum(s.req.prefix for s in batch.served if s.tier == "miss")
        recompute = (end - comm - reload_s) * missed / batch.new_tokens if batch.new_tokens else 0.0
        return BatchCost(end, comm, reload, received_bytes, reload_s, recompute,
                         self.reload_ahead(reload_rows, striped_rows), owner_wait)
