"""Triton kernels. Each file: ``@triton.jit`` kernel -> launcher (checks, grid) -> public function.

Under ``TRITON_INTERPRET=1`` (CPU) bf16 arithmetic is wrong, so every kernel upcasts to fp32
right after ``tl.load``; the interpreter's fp32 -> fp8/bf16 casts do not round to nearest even, so
every stored bf16 / e4m3 value is rounded by the kernel itself first (``rounding``): the bytes
equal the torch reference's under the interpreter and on a GPU alike. Argument checks are the
shared ``dsa_kernels.contract``.
"""
