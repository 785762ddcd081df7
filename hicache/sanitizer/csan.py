"""PyTorch's CUDA sanitizer (CSAN) recording every hazard instead of raising at the first.

``TORCH_CUDA_SANITIZER=1`` makes torch enable CSAN when it is imported: a dispatch mode that checks
every kernel's reads and writes (by schema: our Triton and vendor kernels are registered custom ops,
``dsa_kernels.custom_ops``) against the last access on another stream, and raises at the first
unordered one. A run then shows one hazard and stops, so two removed edges cannot be told apart (the
first one found hides the other). :func:`collecting` keeps CSAN's own analysis and turns the raise
into a record: the run goes on, and every hazard it meets is kept as CSAN's text (both kernels'
schemas and stack traces), which a check can match by the ops it names.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


def active() -> bool:
    """CSAN is on in this process (``TORCH_CUDA_SANITIZER`` was set when torch was imported)."""
    if "TORCH_CUDA_SANITIZER" not in os.environ:
        return False
    from torch.cuda import _sanitizer as csan

    return csan.cuda_sanitizer.enabled


@contextmanager
def collecting() -> Iterator[list[str]]:
    """Inside: CSAN's hazards are appended to the yielded list (as text) instead of raised."""
    from torch.cuda import _sanitizer as csan

    handler = csan.cuda_sanitizer.dispatch.event_handler
    found: list[str] = []
    launch = handler._handle_kernel_launch

    def record(*args, **kwargs) -> list:
        found.extend(str(error) for error in launch(*args, **kwargs))
        return []  # nothing to raise: CSAN's state is updated, the kernel's outputs are returned
    handler._handle_kernel_launch = record
    try:
        yield found
    finally:
        del handler._handle_kernel_launch  # back to the class's method
