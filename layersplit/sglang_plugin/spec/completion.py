"""Completion-time monitor adapter, the fallback for SGLang releases without the per-step method that
:mod:`.step` hooks (``compat.spec_step_target()`` is None): judge each finished request's
speculative-decoding metrics as SGLang computes them, and turn an anomalous verdict into an abort the
load balancer retries. By then the whole answer has been generated (and streamed).

SGLang's ``TokenizerManager._calculate_spec_decoding_metrics(meta_info, recv_obj, i)`` fills
``meta_info`` with ``spec_accept_length`` (completion_tokens / spec_verify_ct) and
``spec_accept_rate`` when a request finishes. An AFTER hook on it runs :func:`layersplit.pd.spec.monitor.judge`
on those numbers (cumulative rules; SGLang exposes no per-step data here), records the verdict in
``meta_info["layersplit_spec_verdict"]``, counts it, and on ``garbled`` / ``repetition`` replaces the
finish reason with an abort (HTTP 503) so a router retries the request on another instance.
"""

from __future__ import annotations

from layersplit.pd.spec.monitor_config import MonitorConfig, load_monitor_config
from layersplit.pd.spec.retry import MonitorCounters
from layersplit.pd.spec.metrics import snapshot_from_meta
from layersplit.pd.spec.monitor import judge

RETRYABLE_STATUS = 503


class MetaInfoMonitor:
    def __init__(self, cfg: MonitorConfig | None = None) -> None:
        self.cfg = cfg or load_monitor_config()
        self.counters = MonitorCounters()

    def after_spec_metrics(self, result, manager, meta_info: dict, recv_obj, i: int, *rest, **kwargs):
        """HookRegistry AFTER hook: ``fn(result, *args)`` with the method's own arguments."""
        if "spec_verify_ct" not in meta_info or "completion_tokens" not in meta_info:
            return result  # no speculative decoding for this request
        verdict = judge(snapshot_from_meta(meta_info), self.cfg)
        meta_info["layersplit_spec_verdict"] = verdict.to_dict()
        self.counters.verdicts[verdict.kind] += 1
        if verdict.anomalous:
            self.counters.aborts[verdict.kind] += 1
            meta_info["finish_reason"] = {"type": "abort", "status_code": RETRYABLE_STATUS,
                                          "message": f"layersplit spec monitor: {verdict.kind}: {verdict.reason}"}
        return result


TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics"
TARGET_SIGNATURE = ("(self, meta_info: 'Dict[str, Any]', recv_obj: 'Union[BatchStrOutput, BatchEmbeddingOutput, "
                    "BatchTokenIDOutput]', i: 'int') -> 'None'")
