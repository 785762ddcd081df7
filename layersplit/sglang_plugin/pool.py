"""LayerSplit pool for SGLang: a subclass of SGLang's ``LayerSplitDSATokenToKVPool`` that

* takes ownership from :mod:`layersplit.ownership` (``contiguous`` — upstream's split — or
  ``round-robin``, env ``LAYERSPLIT_SGLANG_OWNERSHIP``);
* keeps **two** remote KV scratch slots (double buffer): layer l uses slot l % 2, so the model's
  one-layer-ahead ``prefetch_kv_buffer(l + 1)`` never overwrites the slot layer l is still reading
  (upstream has one slot, so a prefetch must wait for the current layer). Every rank, owner
  included, tracks which layer each slot holds, so all ranks decide identically when to broadcast
  (a collective must be entered by every rank, in the same order);
* lets the owner broadcast straight from its own layer buffer and read it in place (upstream first
  copies the owned layer into the scratch buffer);
* always honours HiCache's ``layer_transfer_counter`` before broadcasting a layer (upstream's
  prefetch waits only when the caller passes a counter), so rows still loading from host are never
  sent.

Everything else — indexer-key broadcast, PD buffer reporting of owned layers, HiCache CPU copies —
is upstream's, driven by the ownership overrides below.
"""

from __future__ import annotations

from layersplit.ownership import plan_ownership
from layersplit.sglang_plugin import compat


def make_pool_class(base: type | None = None) -> type:
    """Build the subclass of ``base`` (default: the installed ``LayerSplitDSATokenToKVPool``)."""
    base = base or compat.resolve("layer_split_pool")

    class LayerSplitPlusDSATokenToKVPool(base):
        def __init__(self, *args, layer_shard_rank: int, layer_shard_size: int, ownership: str | None = None, **kwargs):
            from dsa_kernels import envs

            layer_num = kwargs.get("layer_num", args[5] if len(args) > 5 else None)
            if layer_num is None:
                raise TypeError("layer_num: expected the keyword SGLang passes, got none")
            self._plan = plan_ownership(layer_num, layer_shard_size, ownership or envs.sglang_ownership(),
                                        world_size=layer_shard_size)
            self._slot_layer = [None, None]  # layer held by each remote slot
            self._events: dict = {}  # slot -> event guarding an in-flight broadcast
            super().__init__(*args, layer_shard_rank=layer_shard_rank, layer_shard_size=layer_shard_size, **kwargs)

        # ownership ------------------------------------------------------------------------------
        def _is_layer_owned(self, layer_id: int) -> bool:
            return self._plan.owner[layer_id - self.start_layer] == self.layer_shard_rank

        def _get_layer_owner_rank(self, layer_id: int) -> int:
            return self._plan.owner[layer_id - self.start_layer]

        def _owned_local_layer_range(self) -> tuple[int, int]:
            owned = self._plan.owned_layers(self.layer_shard_rank)
            return owned[0], owned[-1] + 1  # a label for logs and PD; round-robin is not contiguous

        # double-buffered scratch ----------------------------------------------------------------
        def _create_buffers(self):
            super()._create_buffers()
            import torch

            self.remote_kv_buffers = [self.remote_kv_buffer, torch.empty_like(self.remote_kv_buffer)]

        def _clear_buffers(self):
            del self.remote_kv_buffers
            super()._clear_buffers()

        def _fetch(self, layer_id: int, counter=None, counter_idx: int | None = None) -> None:
            """Broadcast ``layer_id`` from its owner into slot ``layer_id % 2`` (every rank calls this).

            CUDA: the broadcast runs on the pool's side stream after the current stream's work, and
            an event per slot guards the result. CPU (gloo): the call completes before it returns.
            """
            counter = counter or self.layer_transfer_counter
            if counter is not None:  # hazard: the owner's rows of this layer may still be loading
                counter.wait_until(layer_id - self.start_layer if counter_idx is None else counter_idx)
            slot = layer_id % 2
            owned = self._is_layer_owned(layer_id)
            own_buf = self.kv_buffer[layer_id - self.start_layer] if owned else None
            # the owner sends its own buffer in place; receivers land in the layer's slot
            target = own_buf if owned else self.remote_kv_buffers[slot]
            if str(self.device).startswith("cuda"):
                dm = self.device_module
                self.kv_broadcast_stream.wait_stream(dm.current_stream())
                with dm.stream(self.kv_broadcast_stream):
                    self._broadcast_tensor_from_owner(target, layer_id, src_tensor=own_buf, use_layer_broadcast_comm=True)
                    event = dm.Event()
                    event.record(self.kv_broadcast_stream)
                self._events[slot] = event
            else:
                self._broadcast_tensor_from_owner(target, layer_id, src_tensor=own_buf, use_layer_broadcast_comm=True)
            self._slot_layer[slot] = layer_id

        def _ready(self, slot: int) -> None:
            event = self._events.pop(slot, None)
            if event is not None:  # hazard: read (or overwrite) only after the broadcast completed
                self.device_module.current_stream().wait_event(event)

        def prefetch_kv_buffer(self, layer_id: int, layer_transfer_counter=None, layer_transfer_idx=None) -> None:
            if self._slot_layer[layer_id % 2] != layer_id:
                self._fetch(layer_id, layer_transfer_counter, layer_transfer_idx)

        def _get_broadcastable_kv_buffer(self, layer_id: int):
            slot = layer_id % 2
            if self._slot_layer[slot] != layer_id:
                self._fetch(layer_id)
            self._ready(slot)
            if self._is_layer_owned(layer_id):
                return self.kv_buffer[layer_id - self.start_layer]
            return self.remote_kv_buffers[slot]

        def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope):
            from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

            loc, _, _ = unwrap_write_loc(loc_info)
            layer_id, slot = layer.layer_id, layer.layer_id % 2
            if self._is_layer_owned(layer_id):
                self._ready(slot)  # never write under an in-flight send of this buffer
                self._write_mla_kv_buffer(self.kv_buffer[layer_id - self.start_layer], loc, cache_k_nope, cache_k_rope)
            elif self._slot_layer[slot] == layer_id:
                self._ready(slot)  # the slot's copy stays current: new rows land there too
                self._write_mla_kv_buffer(self.remote_kv_buffers[slot], loc, cache_k_nope, cache_k_rope)

        def kv_scratch_bytes(self) -> int:
            return sum(b.numel() * b.element_size() for b in self.remote_kv_buffers)

    return LayerSplitPlusDSATokenToKVPool


# The upstream methods this adapter overrides or calls, with the signatures it was written against.
# tests/layersplit/test_sglang_plugin.py fails if any of them disappears or changes signature.
UPSTREAM_CONTRACT = {
    "_is_layer_owned": "(self, layer_id: 'int') -> 'bool'",
    "_get_layer_owner_rank": "(self, layer_id: 'int') -> 'int'",
    "_owned_local_layer_range": "(self) -> 'tuple[int, int]'",
    "_create_buffers": "(self)",
    "_clear_buffers": "(self)",
    "prefetch_kv_buffer": "(self, layer_id: 'int', layer_transfer_counter: 'Optional[LayerDoneCounter]' = None, "
                          "layer_transfer_idx: 'Optional[int]' = None) -> 'None'",
    "_get_broadcastable_kv_buffer": "(self, layer_id: 'int') -> 'torch.Tensor'",
    "set_mla_kv_buffer": "(self, layer: 'RadixAttention', loc_info, cache_k_nope: 'torch.Tensor', "
                         "cache_k_rope: 'torch.Tensor')",
    "_broadcast_tensor_from_owner": "(self, tensor: 'torch.Tensor', layer_id: 'int', src_tensor: "
                                    "'Optional[torch.Tensor]' = None, use_layer_broadcast_comm: 'bool' = False) "
                                    "-> 'torch.Tensor'",
    "_write_mla_kv_buffer": "(self, dst_buffer: 'torch.Tensor', loc: 'torch.Tensor', cache_k_nope: 'torch.Tensor', "
                            "cache_k_rope: 'torch.Tensor') -> 'None'",
    "get_contiguous_buf_infos": "(self)",
}
