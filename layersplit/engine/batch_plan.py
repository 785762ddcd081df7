"""Per-batch plan, built once and used by every layer: pages, page tables, broadcast rows, token split.

Page allocation is replicated: every rank runs the same allocator sequence (as SGLang's scheduler
does), so a request's pool pages have the same ids on every rank and one ``pool_table`` serves all.

Scratch layout (LayerSplit non-owners): the pages holding a request's cached prefix rows are the
*broadcast pages*; they come first in scratch, in request order, so a broadcast lands directly in
``scratch[:n_bcast]``; pages holding only new tokens follow. ``scratch_table`` maps each request's
logical page to its scratch page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsa_kernels.layout import PAGE_SIZE

from layersplit.plan.choices import SPLITS  # re-exported


@dataclass(frozen=True)
class Request:
    prefix_len: int  # cached tokens (any length, not only whole pages)
    new_tokens: tuple[int, ...]  # token ids to prefill
    from_host: bool = False  # the prefix sits in the host tier and is reloaded layer by layer


@dataclass
class BatchPlan:
    requests: list[Request]
    pool_pages: list[list[int]]  # per request, its pool pages
    pool_table: torch.Tensor  # [B, max_pages] int32
    scratch_table: torch.Tensor  # [B, max_pages] int32
    bcast_pages: torch.Tensor  # [n_bcast] int64 pool pages holding prefix rows, in scratch order
    new_req: torch.Tensor  # [n_new] request of each new token (global order: request by request)
    new_pos: torch.Tensor  # [n_new] position in its request
    new_tokens: torch.Tensor  # [n_new]
    new_pool_slots: torch.Tensor  # [n_new]
    new_scratch_slots: torch.Tensor  # [n_new]
    local: list[torch.Tensor]  # per rank: global indices of its new tokens
    max_ctx: int

    def to(self, device, pin_memory: bool = False) -> "BatchPlan":
        """The same plan with its tensors on ``device`` (built on the host, used where the caches live).
        Copies are ``non_blocking``: from pinned memory (``pin_memory``, where an accelerator exists)
        they are asynchronous H2D copies on the current stream, so the host does not wait; the
        caching host allocator keeps the pinned sources until the copies ran."""
        import dataclasses

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin_memory else t).to(device, non_blocking=True)

        moved = {f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved, local=[move(x) for x in self.local])

    @property
    def n_bcast(self) -> int:
        return int(self.bcast_pages.numel())

    @property
    def scratch_pages_needed(self) -> int:
        return int(self.scratch_table.max()) + 1 if self.scratch_table.numel() else 0

    @property
    def rows_read(self) -> int:
        """Prefix rows a non-owner receives per layer (whole pages: the pool's granularity)."""
        return self.n_bcast * PAGE_SIZE


def _split(n_new: list[int], cp: int, how: str) -> list[torch.Tensor]:
    if how not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {how!r}")
    owners = []
    for n in n_new:
        if how == "interleave":
            owner = torch.arange(n) % cp
        else:  # zigzag: 2N chunks; rank r takes chunks r and 2N-1-r (balances causal work)
            chunk = torch.arange(n) * (2 * cp) // max(n, 1)
            owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
        owners.append(owner)
    owner = torch.cat(owners) if owners else torch.zeros(0, dtype=torch.long)
    return [(owner == r).nonzero().squeeze(1) for r in range(cp)]


def plan_batch(requests: list[Request], pool_alloc, cp: int, split: str = "zigzag") -> BatchPlan:
    """Allocate pool pages for ``requests`` (``pool_alloc(n) -> list[int]``) and build the plan."""
    if not requests:
        raise ValueError("requests: expected at least one request, got none")
    for i, r in enumerate(requests):
        if r.prefix_len < 0 or not r.new_tokens:
            raise ValueError(f"requests[{i}]: expected prefix_len >= 0 and >= 1 new token, got "
                             f"prefix_len={r.prefix_len}, {len(r.new_tokens)} new tokens")
    ctx = [r.prefix_len + len(r.new_tokens) for r in requests]
    n_pages = [-(-c // PAGE_SIZE) for c in ctx]
    pool_pages = [pool_alloc(n) for n in n_pages]
    width = max(n_pages)
    pool_table = torch.zeros(len(requests), width, dtype=torch.int32)
    scratch_table = torch.zeros(len(requests), width, dtype=torch.int32)
    n_prefix_pages = [-(-r.prefix_len // PAGE_SIZE) for r in requests]
    n_bcast = sum(n_prefix_pages)
    bcast, next_bcast, next_new = [], 0, n_bcast
    for b, pages in enumerate(pool_pages):
        pool_table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for k in range(len(pages)):
            if k < n_prefix_pages[b]:
                scratch_table[b, k], next_bcast = next_bcast, next_bcast + 1
                bcast.append(pages[k])
            else:
                scratch_table[b, k], next_new = next_new, next_new + 1
    new_req = torch.cat([torch.full((len(r.new_tokens),), b, dtype=torch.int32) for b, r in enumerate(requests)])
    new_pos = torch.cat([torch.arange(r.prefix_len, c) for r, c in zip(requests, ctx)])
    page_of = new_pos // PAGE_SIZE
    def slots(table: torch.Tensor) -> torch.Tensor:
        return table[new_req.long(), page_of].long() * PAGE_SIZE + new_pos % PAGE_SIZE
    return BatchPlan(
        requests, pool_pages, pool_table, scratch_table, torch.tensor(bcast, dtype=torch.int64),
        new_req, new_pos, torch.tensor([t for r in requests for t in r.new_tokens], dtype=torch.int64),
        slots(pool_table), slots(scratch_table), _split([len(r.new_tokens) for r in requests], cp, split), max(ctx),
    )
