"""Prefill<->decode integrity: abort safe-release protocol, transfer-engine model, spec-decoding anomaly monitor."""
