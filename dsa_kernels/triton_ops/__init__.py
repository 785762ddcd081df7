"""Triton kernels. Each file: ``@triton.jit`` kernel -> launcher (checks, grid) -> public function.

Under ``TRITON_INTERPRET=1`` (CPU) bf16 arithmetic is wrong, so every kernel upcasts to fp32
right after ``tl.load``; fp32 -> fp8/bf16 casts inside a kernel are exact only for values the
target type represents, which is what the CPU tests feed them.
"""
