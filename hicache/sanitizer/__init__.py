"""The stream-ordering sanitizer: GPU races found on a CPU, without relying on timing.

- :mod:`.core` — the vector-clock tracker (agents, hazards, :func:`sanitized`, ``LAYERSPLIT_SANITIZE``);
- :mod:`.access` — what a tensor op touches (schema reads/writes, byte ranges, host memory, call sites);
- :mod:`.host_reads` — the host reads the dispatcher never sees (``tolist``, ``numpy``);
- :mod:`.kernel_accesses` — what each DSA op really reads and writes around interpreted Triton launches;
- :mod:`.csan` — the hazards torch's own CUDA sanitizer (CSAN) reports, collected instead of raised.

The names below are the sanitizer's API (``from hicache import sanitizer; with sanitizer.sanitized(): ...``).
Depends on ``dsa_kernels`` and ``lsconfig`` only; :mod:`hicache.runtime` calls into it, never the reverse.
"""

from hicache.sanitizer.core import (Hazard, Sanitizer, Site, current, disable, enable, enable_from_env, enabled_by_env,
                                    follow_current_stream, host_work, mark_host_memory, opaque, sanitized)

__all__ = ["Hazard", "Sanitizer", "Site", "current", "disable", "enable", "enable_from_env", "enabled_by_env",
           "follow_current_stream", "host_work", "mark_host_memory", "opaque", "sanitized"]
