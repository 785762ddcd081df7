"""Explicit round-to-nearest-even of fp32 values to bf16 and onto the e4m3 grid, in the kernels.

Why: a kernel's final ``x.to(bf16)`` / ``x.to(fp8e4nv)`` is exact on a GPU (``cvt.rn``), but the
Triton interpreter (``TRITON_INTERPRET=1``, the CPU CI) converts with its own bit code, which
(Triton 3.x ``interpreter._convert_float``) truncates fp32 -> bf16, and for fp32 -> fp8 rounds
ties up instead of to even and, when the mantissa carries out, drops the carry whenever the
exponent's low bit is set (124 -> 64 instead of 128: the "up to 2x" of DESIGN.md section 5).
So the kernels round themselves, with integer and exact fp32 operations only: bf16 is built from
the bits (``to_bf16``); an e4m3 value is rounded onto the e4m3 grid (``round_to_e4m3``), and the
cast then receives a representable value, which every converter (interpreter or hardware) maps
exactly (all 2^16 bf16 values, every e4m3 value, tie and subnormal:
``tests/dsa_kernels/test_cast_bytes.py``). On a GPU it is the value ``cvt.rn`` gives (within
+-448, where ``satfinite`` does not act), so the bytes there should not change; the same tests
check that on CUDA.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_bf16(x):
    """fp32 ``x`` as bf16, rounded to nearest even, built from the bits (no cast: the interpreter
    also mangles fp32 subnormals it casts); inf kept, NaN -> the canonical 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    # add 0x7FFF plus the kept lsb, then keep the high 16 bits: RNE on the bit pattern, the carry
    # into the exponent done by the integer add (overflow past the largest bf16 gives inf)
    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    high = tl.where(x != x, 0x7FC0, high)
    return high.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to_e4m3(y, FMAX: tl.constexpr):
    """fp32 ``y`` saturated to ``+-FMAX`` (448) and rounded to the nearest e4m3 value (ties to even),
    as fp32, sign of zero kept. e4m3: 3 mantissa bits, normals from 2^-6, subnormal step 2^-9.

    ``|y|`` is scaled by the inverse of its grid step ``ulp = 2^(max(e, -6) - 3)`` (a power of two:
    exact) into ``[0, 16)``, rounded to an integer there (exact fp32 steps), and scaled back.
    """
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    a = tl.minimum(tl.abs(y), FMAX)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent of |y|
    step = tl.maximum(e, -6) - 3  # log2 of the e4m3 grid step at |y|
    ulp = ((step + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - step) << 23).to(tl.float32, bitcast=True)
    q = a * inv_ulp  # in [0, 16): exact
    whole = q.to(tl.int32)  # truncation == floor (q >= 0)
    frac = q - whole.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    mag = (whole + up.to(tl.int32)).to(tl.float32) * ulp  # exact: at most 16 steps of ulp
    return (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
