"""Drive SGLang's own per-step speculative path on CPU, for the per-step monitor's tests and benchmark.

:class:`VerifyDriver` settles one verify step for a list of real ``Req`` objects exactly as SGLang 0.5.23's
``SchedulerBatchResultProcessor.process_batch_result_decode`` does for a speculative batch: it calls the real
``_resolve_spec_v2_tokens`` (which advances ``kv_committed_len``, ``spec_verify_ct``, ``spec_num_correct_drafts``
and calls ``Req.update_spec_correct_drafts_histogram`` — where the hook sits) on a real
``GenerationBatchResult`` holding host tensors, then, per unfinished request, ``output_ids.extend(tokens)`` and
``Req.update_finish_state(len(tokens))``. What it leaves out (metrics reporter, grammar, logprobs, streaming)
does not touch the counters; the two collaborators ``_resolve_spec_v2_tokens`` calls on its processor are
no-ops here (the metrics snapshot and the adaptive-draft controller). :func:`stream_chunk` runs SGLang's
per-request output accumulator on a request, :func:`completion_time_meta` its tokenizer manager's
completion-time metrics plus the fallback adapter.
"""

from __future__ import annotations

import contextlib
import importlib
from array import array
from types import SimpleNamespace


def make_req(rid: str, max_new_tokens: int, prompt: tuple[int, ...] = (1, 2, 3), first_token: int | None = 0):
    """A real ``Req`` as the scheduler holds it after prefill: ``first_token`` (prefill's output) already in
    ``output_ids`` (None: nothing yet)."""
    schedule_batch = importlib.import_module("sglang.srt.managers.schedule_batch")
    sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    params = sampling.SamplingParams(max_new_tokens=max_new_tokens)
    params.normalize(None)  # as the tokenizer manager does (no stop strings to tokenize here)
    req = schedule_batch.Req(rid, "", array("q", prompt), params)
    if first_token is not None:
        req.output_ids.append(first_token)
    return req


@contextlib.contextmanager
def spec_published(draft_tokens: int):
    """What an SGLang server started with ``--speculative-num-draft-tokens`` would have published to
    ``get_spec()`` (read by the hook and by the tokenizer manager's completion-time metrics)."""
    bag = SimpleNamespace(speculative_num_draft_tokens=draft_tokens, speculative_algorithm="EAGLE")
    modules = [importlib.import_module(m) for m in
               ("sglang.srt.runtime_context", "sglang.srt.managers.tokenizer_manager")]
    saved = [m.get_spec for m in modules]
    for m in modules:
        m.get_spec = lambda: bag
    try:
        yield bag
    finally:
        for m, fn in zip(modules, saved):
            m.get_spec = fn


class VerifyDriver:
    """One verify step at a time for a batch of ``Req`` objects (see the module docstring).

    Example::

        driver = VerifyDriver(draft_tokens=4)
        driver.step([req], accepted=[2], tokens=[[11, 12, 13]])   # 2 drafts + 1 bonus token
    """

    def __init__(self, draft_tokens: int) -> None:
        import torch

        processor = importlib.import_module("sglang.srt.managers.scheduler_components.batch_result_processor")
        self._torch = torch
        self._resolve = processor.SchedulerBatchResultProcessor._resolve_spec_v2_tokens
        self._result_cls = importlib.import_module("sglang.srt.managers.utils").GenerationBatchResult
        noop = lambda *args, **kwargs: None  # noqa: E731
        self._processor = SimpleNamespace(metrics_reporter=SimpleNamespace(snapshot_spec_decode_metrics=noop),
                                          model_worker=SimpleNamespace(on_verify_complete_cpu=noop),
                                          advance_grammar_fsm=noop)
        self.draft_tokens = draft_tokens

    def step(self, reqs: list, accepted: list[int], tokens: list[list[int]] | None = None) -> None:
        """Settle one verify step: request i accepted ``accepted[i]`` drafts and emits ``tokens[i]``
        (``accepted[i] + 1`` ids; default: zeros)."""
        d = self.draft_tokens
        rows = [[0] * d for _ in reqs]
        for row, n, toks in zip(rows, accepted, tokens or [None] * len(reqs)):
            row[:n + 1] = toks if toks is not None else [0] * (n + 1)
        result = self._result_cls(
            next_token_ids=self._torch.tensor(rows, dtype=self._torch.int64).flatten(),
            accept_lens=self._torch.tensor([n + 1 for n in accepted], dtype=self._torch.int32),
            speculative_num_draft_tokens=d)
        batch = SimpleNamespace(reqs=reqs, has_grammar=False)
        emitted = self._resolve(self._processor, result, batch)
        for req, toks in zip(reqs, emitted):  # process_batch_result_decode's per-request part
            if req.finished():
                continue
            req.output_ids.extend(toks)
            req.update_finish_state(len(toks))


def step_tokens(accepted: list[int], tokens: list[int] | None) -> list[list[int]] | None:
    """Split a trace's generated ``tokens`` into the runs its verify steps emitted (``accepted + 1`` each)."""
    if tokens is None:
        return None
    out, start = [], 0
    for n in accepted:
        out.append(list(tokens[start:start + n + 1]))
        start += n + 1
    return out


def run_request(driver: VerifyDriver, req, accepted: list[int], tokens: list[int] | None = None) -> int:
    """Verify steps of one request until it finishes or the trace ends; returns the steps SGLang settled."""
    runs = step_tokens(accepted, tokens)
    for i, n in enumerate(accepted):
        if req.finished():
            return i
        driver.step([req], [n], None if runs is None else [runs[i]])
    return len(accepted)


def stream_chunk(req) -> dict:
    """What SGLang's output streamer sends for ``req`` now (its real per-request accumulator): the new
    tokens, the finish reason's JSON, and the completion/verify counts."""
    streamer = importlib.import_module("sglang.srt.managers.scheduler_components.output_streamer")
    spec_algo = importlib.import_module("sglang.srt.speculative.spec_info").SpeculativeAlgorithm
    disagg = importlib.import_module("sglang.srt.disaggregation.utils").DisaggregationMode
    acc = streamer._GenerationStreamAccumulator(
        return_logprob=False, return_hidden_states=False, return_routed_experts=False, return_indexer_topk=False,
        spec_algorithm=spec_algo.EAGLE, disaggregation_mode=disagg.NULL, default_stream_interval=1,
        default_force_stream_interval=50, get_cached_tokens_details=lambda r: None,
        is_request_level_customized_info_key=lambda k: False, current_weight_version=None)
    acc.accept(req=req)
    if not acc.rids:
        return {}
    return {"output_ids": list(acc.output_ids[0]), "finish_reason": acc.finished_reasons[0],
            "completion_tokens": acc.completion_tokens[0], "spec_verify_ct": acc.spec_verify_ct[0]}


def completion_time_meta(req, monitor) -> dict:
    """The completion-time path on ``req``'s final counters: SGLang's own
    ``TokenizerManager._calculate_spec_decoding_metrics`` fills ``meta_info``, then ``monitor``
    (a :class:`.completion.MetaInfoMonitor`) judges it, as its AFTER hook would."""
    manager = importlib.import_module("sglang.srt.managers.tokenizer_manager").TokenizerManager
    recv = SimpleNamespace(spec_verify_ct=[req.spec_verify_ct], spec_num_correct_drafts=[req.spec_num_correct_drafts],
                           completion_tokens=[len(req.output_ids)], spec_correct_drafts_histogram=None)
    meta = {"completion_tokens": len(req.output_ids)}
    fn = manager.__dict__["_calculate_spec_decoding_metrics"]
    getattr(fn, "__wrapped__", fn)(SimpleNamespace(), meta, recv, 0)
    monitor.after_spec_metrics(None, None, meta, recv, 0)
    return meta
