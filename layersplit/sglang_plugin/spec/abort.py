"""The abort the per-step spec monitor finishes a request with: SGLang's ``FINISH_ABORT`` plus the verdict.

A module of its own because it subclasses an sglang class at import time (imported only by the hook), and
at module level so a ``Req`` holding it still pickles.
"""

from __future__ import annotations

from http import HTTPStatus

from layersplit.sglang_plugin import compat

RETRYABLE_STATUS = HTTPStatus.SERVICE_UNAVAILABLE  # what SGLang's own retry-later aborts use


class SpecMonitorAbort(compat.resolve("finish_abort")):
    """``FINISH_ABORT(message, 503)`` whose JSON (``meta_info["finish_reason"]``) also carries
    ``layersplit_spec_verdict``: ``{"verdict", "reason", "numbers"}``."""

    def __init__(self, verdict) -> None:
        super().__init__(f"layersplit spec monitor: {verdict.kind}: {verdict.reason}", RETRYABLE_STATUS)
        self.verdict = verdict.to_dict()

    def to_json(self):
        return {**super().to_json(), "layersplit_spec_verdict": self.verdict}
