"""Speculative-decoding anomaly monitor: per-request metrics, the rules (``configs/monitor.yaml``), the
abort-and-retry policy, replay of recorded requests and a synthetic evaluation against a text baseline."""
