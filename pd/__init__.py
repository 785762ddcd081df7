"""Prefill<->decode integrity, one room each: ``pd.abort`` (the abort safe-release protocol, its stress
and its model checker) and ``pd.spec`` (the speculative-decoding anomaly monitor)."""
