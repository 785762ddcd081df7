"""The device runtime every stream in the project runs on.

- :mod:`.streams` — CUDA or emulated streams and events, the compute stream, ``record_stream``
  (:func:`~hicache.runtime.streams.get_runtime` chooses, in one place);
- :mod:`.device_module` — a ``torch.cuda``-shaped facade over the emulated runtime;
- :mod:`.happens_before` — the happens-before order of the issued work, as vector clocks;
- :mod:`.syncs` — counts host synchronizations (the host waiting for the device).

Depends on :mod:`hicache.sanitizer` (stream work reports its accesses to it) and nothing above.
"""
