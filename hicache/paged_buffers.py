"""Per-layer paged DSA cache buffers (MLA latent + indexer keys) shared by the device and host pools.

Layouts come from :mod:`dsa_kernels.layout`. Per layer ``l`` held by the pool:

* ``kv[l]``    — ``[num_pages * 64, L + R]`` bf16, or ``[num_pages * 64, L + 4L/128 + 2R]`` uint8 (fp8);
* ``index[l]`` — ``[num_pages, 64 * (D + 4)]`` uint8, only on layers that run the indexer.

The page view of either (``kv_pages(l)``, ``index_pages(l)``) is ``[num_pages, page_bytes]`` uint8,
which is what page copies move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_kernels import dequantize_index_keys, pack_mla_kv, quantize_index_keys, unpack_mla_kv
from dsa_kernels.layout import PAGE_SIZE, as_pages, index_page_bytes, mla_row_bytes


@dataclass(frozen=True)
class DSACacheSpec:
    """Cache geometry of one model (built from a model config by the layersplit package)."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    index_head_dim: int
    indexer_layers: tuple[int, ...]
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        mla_row_bytes(self.kv_lora_rank, self.rope_dim, self.kv_dtype)  # validates kv_dtype / tile
        bad = [layer for layer in self.indexer_layers if not 0 <= layer < self.num_layers]
        if bad:
            raise ValueError(f"indexer_layers: expected layers in [0, {self.num_layers}), got {bad}")

    @property
    def kv_row_bytes(self) -> int:
        return mla_row_bytes(self.kv_lora_rank, self.rope_dim, self.kv_dtype)

    @property
    def index_page_bytes(self) -> int:
        return index_page_bytes(self.index_head_dim)

    def has_indexer(self, layer: int) -> bool:
        return layer in self.indexer_layers

    def page_bytes(self, layer: int) -> int:
        """Bytes of one page of ``layer`` (KV + indexer keys)."""
        return PAGE_SIZE * self.kv_row_bytes + (self.index_page_bytes if self.has_indexer(layer) else 0)


class PagedDSABuffers:
    host_tier = False  # host memory (the host pool): copies to or from it are DMA, page runs at a time

    def __init__(self, spec: DSACacheSpec, num_pages: int, device: torch.device | str,
                 layers: tuple[int, ...] | None = None, pin_memory: bool = False) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.layers = tuple(range(spec.num_layers)) if layers is None else tuple(layers)
        bad = [layer for layer in self.layers if not 0 <= layer < spec.num_layers]
        if bad:
            raise ValueError(f"layers: expected layers in [0, {spec.num_layers}), got {bad}")
        bf16 = spec.kv_dtype == "bf16"
        kv_shape = (num_pages * PAGE_SIZE, spec.kv_row_bytes // 2 if bf16 else spec.kv_row_bytes)

        def buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # allocated pinned, not pinned after: ``.pin_memory()`` copies, so for a moment the host
            # holds the buffer twice (a GLM-5 host tier is hundreds of GB). Hazard: on a device the zero
            # fill is a kernel on the current (compute) stream; a side stream that writes or reads the
            # pool first waits for it (``LayerwiseLoader`` does, from its constructor)
            return torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)

        self.kv = {layer: buffer(kv_shape, torch.bfloat16 if bf16 else torch.uint8) for layer in self.layers}
        self.index = {layer: buffer((num_pages, spec.index_page_bytes), torch.uint8)
                      for layer in self.layers if spec.has_indexer(layer)}

    def _layer(self, layer_id: int) -> None:
        if layer_id not in self.kv:
            raise ValueError(f"layer_id: expected one of this pool's layers {list(self.layers)}, got {layer_id}")

    def kv_pages(self, layer_id: int) -> torch.Tensor:
        self._layer(layer_id)
        return as_pages(self.kv[layer_id], PAGE_SIZE)

    def index_pages(self, layer_id: int) -> torch.Tensor | None:
        self._layer(layer_id)
        return self.index.get(layer_id)

    # SGLang DSATokenToKVPool-shaped accessors --------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The MLA latent cache of ``layer_id`` (``[num_slots, row]``)."""
        self._layer(layer_id)
        return self.kv[layer_id]

    get_kv_buffer = get_key_buffer

    def set_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k_nope: torch.Tensor,
                          cache_k_rope: torch.Tensor) -> None:
        """Write latent ``[n, L]`` and rope ``[n, R]`` rows at token slots ``loc [n]``."""
        pack_mla_kv(cache_k_nope, cache_k_rope, self.get_key_buffer(layer_id), loc)

    def get_mla_kv_buffer(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_mla_kv(self.get_key_buffer(layer_id), loc, self.spec.kv_lora_rank)

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """The paged indexer-key cache of ``layer_id`` (``[num_pages, 64 * (D + 4)]`` uint8)."""
        buf = self.index_pages(layer_id)
        if buf is None:
            raise ValueError(f"layer_id: expected a layer that runs the indexer {list(self.spec.indexer_layers)}, got {layer_id}")
        return buf

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        """Quantize ``index_k [n, D]`` into the fp8 paged layout at token slots ``loc``."""
        quantize_index_keys(index_k, self.get_index_k_with_scale_buffer(layer_id), loc)

    def get_index_k_buffer(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        return dequantize_index_keys(self.get_index_k_with_scale_buffer(layer_id), loc)

    def fill_pages(self, pages: torch.Tensor, value: int) -> None:
        """Set every byte of ``pages`` in every layer to ``value`` (0xFF = NaN poison for tests)."""
        for layer in self.layers:
            self.kv_pages(layer)[pages] = value
            if layer in self.index:
                self.index[layer][pages] = value

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.kv.values(), *self.index.values()])
