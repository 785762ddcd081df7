"""Prefill<->decode integrity, one room each: :mod:`layersplit.pd.abort` (the abort safe-release protocol
and its seeded stress) and :mod:`layersplit.pd.spec` (the speculative-decoding anomaly monitor).

It imports nothing of the CP code (``engine``, ``plan``, ``hicache``, ``dsa_kernels``): the LayerSplit
ownership reaches it as plain data. Its maintainers' tools — the exhaustive model checker and the
real-transport storms — live outside the package, in the checkout's ``tools/pd_check`` and ``tools/pd_real``."""
