"""64-bit row offsets for every Triton kernel here.

A program id or a loaded index is an int32; multiplied by a row stride it wraps past 2^31 elements
(indexer scores at 16k queries x 131k context: 2.1e9; sparse MLA q/out rows at >= 58k tokens x 64
heads x 576). Every ``row * stride`` product therefore widens ``row`` to int64 first, through
``as_offset``. ``UNSAFE_INT32_OFFSETS`` (tests only) turns the widening off, so the int64 test can
show that it catches the old 32-bit arithmetic (``tests/dsa_kernels/test_offsets.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

UNSAFE_INT32_OFFSETS = False  # documented unsafe switch: True brings back 32-bit row offsets


def wide() -> bool:
    """The ``WIDE`` constexpr every launcher passes (True unless the unsafe switch is on)."""
    return not UNSAFE_INT32_OFFSETS


@triton.jit
def as_offset(i, WIDE: tl.constexpr):
    """``i`` as int64 (``WIDE``) or unchanged: use it for every index that multiplies a stride."""
    if WIDE:
        return i.to(tl.int64)
    else:
        return i
