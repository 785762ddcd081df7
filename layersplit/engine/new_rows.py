"""The new rows' trip to every rank: packed as the caches store them, all-gathered as bytes, landed by row copies.

Each rank packs its own new tokens' cache rows of one layer into one uint8 send buffer
(:class:`RowLayout`), in the bytes of :mod:`dsa_kernels.layout`:

* bytes ``[0, rows * kv_row_bytes)``: ``[rows, kv_row_bytes]`` MLA rows in the cache's ``kv_dtype``
  (``pack_mla_kv``: bf16 latent ++ rope, or the fp8 row: e4m3 latent, fp32 tile scales, bf16 rope);
* then, on layers that run the indexer, ``ceil(rows / 64)`` pages of indexer keys in the cache's paged
  layout (``quantize_index_keys``: 64 e4m3 keys, then their 64 ue8m0 scales, per page).

``rows`` is the largest rank's new-token count (an all-gather moves buffers of one size); a rank's
padding rows are zeros and never land. After the all-gather every rank copies row ``i`` of rank ``r``
to the slot of that token (:meth:`NewRows.land_kv`, :meth:`NewRows.land_index`): every rank stores the
bytes the token's own rank packed (data movement, exact).

Both parts are quantized from the bf16-rounded projections, as when bf16 rows travelled and each
rank quantized them where they landed; a row's bytes depend on that bf16 row alone, so the pools hold
the same bytes as then (on one backend). The indexer keys travel quantized for both KV dtypes: they
are stored quantized in both, their ue8m0 scale is a power of two (the division is exact, every
backend writes the same bytes), and a key moves ``D + 4`` bytes instead of ``2 D``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_kernels import pack_mla_kv, quantize_index_keys
from dsa_kernels.layout import PAGE_SIZE, index_page_bytes
from hicache.paged_buffers import DSACacheSpec


def paged_index_parts(pages: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a paged indexer-key buffer ``[..., P, 64 * (D + 4)]`` uint8: its key bytes
    ``[..., P, 64, D]`` and its scale bytes ``[..., P, 64, 4]`` (token ``o`` of a page at index ``o``)."""
    keys = pages[..., : PAGE_SIZE * head_dim].unflatten(-1, (PAGE_SIZE, head_dim))
    return keys, pages[..., PAGE_SIZE * head_dim:].unflatten(-1, (PAGE_SIZE, 4))


@dataclass(frozen=True)
class RowLayout:
    """One rank's send buffer of one layer's new rows (see the module docstring)."""

    rows: int  # the largest rank's new tokens
    kv_row_bytes: int
    kv_dtype: str
    index_head_dim: int  # 0: no indexer keys (a layer without the indexer)

    def __post_init__(self) -> None:
        # the index pages start at kv_bytes: their fp32 scales (read through a float32 view) need 4-byte
        # alignment; an fp8 row is L + L/32 + 2R bytes with L a multiple of 128, a bf16 row 2(L + R), R even
        assert self.kv_row_bytes % 4 == 0, f"MLA row of {self.kv_row_bytes} B: expected a multiple of 4"

    @property
    def kv_bytes(self) -> int:
        return self.rows * self.kv_row_bytes

    @property
    def index_pages(self) -> int:
        return -(-self.rows // PAGE_SIZE) if self.index_head_dim else 0

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + self.index_pages * index_page_bytes(self.index_head_dim)

    def kv_rows(self, buf: torch.Tensor) -> torch.Tensor:
        """``[..., rows, width]`` view of the MLA rows of ``buf [..., nbytes]`` (bf16 or uint8, as the cache)."""
        part = buf[..., : self.kv_bytes]
        if self.kv_dtype == "bf16":
            part = part.view(torch.bfloat16)
        return part.unflatten(-1, (self.rows, -1))

    def index_pages_of(self, buf: torch.Tensor) -> torch.Tensor:
        """``[..., index_pages, 64 * (D + 4)]`` view of the indexer-key pages of ``buf [..., nbytes]``."""
        return buf[..., self.kv_bytes: self.nbytes].unflatten(-1, (self.index_pages, -1))


class NewRows:
    """Built once per batch: the send-buffer layouts (with and without indexer keys) and, for every
    new token in global order, the rank and row it arrives from."""

    def __init__(self, spec: DSACacheSpec, local: list[torch.Tensor], rank: int, device: torch.device) -> None:
        self.spec, self.cp = spec, len(local)
        counts = [len(idx) for idx in local]
        rows = max(counts)
        self.layouts = {has: RowLayout(rows, spec.kv_row_bytes, spec.kv_dtype, spec.index_head_dim if has else 0)
                        for has in (False, True)}
        self.send_slots = torch.arange(counts[rank], device=device)
        self.src_rank = torch.empty(sum(counts), dtype=torch.int64, device=device)
        self.src_row = torch.empty(sum(counts), dtype=torch.int64, device=device)
        for r, idx in enumerate(local):
            self.src_rank[idx] = r
            self.src_row[idx] = torch.arange(len(idx), device=device)
        self.src_page, self.src_off = self.src_row // PAGE_SIZE, self.src_row % PAGE_SIZE  # in the index pages

    def layout(self, layer: int) -> RowLayout:
        return self.layouts[self.spec.has_indexer(layer)]

    def pack(self, layer: int, kv_c: torch.Tensor, k_pe: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
        """This rank's send buffer ``[nbytes]`` uint8 for ``layer``: its rows ``kv_c [n, L]``, ``k_pe [n, R]``
        and ``index_k [n, D]`` (fp32 projections), rounded to bf16 and packed as the caches store them."""
        layout = self.layout(layer)
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8, device=kv_c.device)
        if len(self.send_slots):  # a rank may have no new token (fewer new tokens than ranks)
            bf16 = torch.bfloat16
            pack_mla_kv(kv_c.to(bf16).contiguous(), k_pe.to(bf16).contiguous(), layout.kv_rows(buf), self.send_slots)
            if layout.index_head_dim:
                quantize_index_keys(index_k.to(bf16).contiguous(), layout.index_pages_of(buf), self.send_slots)
        return buf

    def receive_buffer(self, layer: int, device: torch.device) -> torch.Tensor:
        """``[cp, nbytes]`` uint8: row ``r`` receives rank ``r``'s send buffer (``unbind(0)`` gives the
        all-gather's outputs, views of this one tensor)."""
        return torch.empty(self.cp, self.layout(layer).nbytes, dtype=torch.uint8, device=device)

    def land_kv(self, layer: int, gathered: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy every new token's MLA row from ``gathered [cp, nbytes]`` into ``kv`` at ``slots [n_new]``."""
        kv[slots] = self.layout(layer).kv_rows(gathered)[self.src_rank, self.src_row]

    def land_index(self, layer: int, gathered: torch.Tensor, index: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy every new token's indexer key and scale bytes from ``gathered`` into the paged ``index``
        cache ``[P, 64 * (D + 4)]`` at token ``slots [n_new]``."""
        d = self.spec.index_head_dim
        src_keys, src_scales = paged_index_parts(self.layout(layer).index_pages_of(gathered), d)
        dst_keys, dst_scales = paged_index_parts(index, d)
        page, off = slots // PAGE_SIZE, slots % PAGE_SIZE
        dst_keys[page, off] = src_keys[self.src_rank, self.src_page, self.src_off]
        dst_scales[page, off] = src_scales[self.src_rank, self.src_page, self.src_off]
