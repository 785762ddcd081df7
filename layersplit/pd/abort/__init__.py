"""PD abort safe-release: the protocol between a decode worker and its LayerSplit prefill ranks (decode and
prefill sides, messages, pages, the transfer-engine model, the faulty channel, the bootstrap registry) and
its seeded discrete-event stress (:mod:`.stress`). The model checker (``tools/pd_check``) and the
real-transport storms (``tools/pd_real``) run this same protocol code from a checkout."""
