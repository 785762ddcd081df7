"""PD abort safe-release: the protocol between a decode worker and its LayerSplit prefill ranks (decode and
prefill sides, messages, pages, the transfer-engine model, the faulty channel, the bootstrap registry),
its seeded discrete-event stress (``stress``) and its explicit-state model checker (``check``), which
run the same protocol code."""
