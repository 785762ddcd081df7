"""Paged row gather/scatter of one layer: pack whole pages into a contiguous buffer and back."""

from __future__ import annotations

import torch


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """``out[i] = pages[page_ids[i]]``; pages ``[P, page_bytes]`` uint8 -> ``[n, page_bytes]``."""
    return pages[page_ids.long()]


def scatter_pages(packed: torch.Tensor, pages: torch.Tensor, page_ids: torch.Tensor) -> None:
    """``pages[page_ids[i]] = packed[i]`` (page ids must be distinct)."""
    pages[page_ids.long()] = packed
