"""Replay recorded requests through the monitor: ``layersplit monitor replay FILE.jsonl``.

One JSON object per line, in any of three forms (``rid`` falls back to ``meta_info.id``, then the line number;
an optional ``label`` — healthy / garbled / repetition — is compared with the verdict in the summary)::

    {"rid": "a", "meta_info": {"completion_tokens": 412, "spec_verify_ct": 160,
                               "spec_accept_length": 2.575, "spec_accept_rate": 0.525}}
    {"rid": "b", "draft_tokens": 4, "accepted": [3, 2, 0, 3, ...]}
    {"rid": "c", "step": 1, "draft_tokens": 4, "accepted": 2}

The first is SGLang's per-request ``meta_info`` (the meta fields may also sit at the top level) and is judged
once on its cumulative metrics; the second is a per-step trace (accepted drafts per verify step;
``draft_tokens`` is one int or one per step) and is fed step by step, as the live guard would see it. The third
is one verify step as the SGLang per-step hook exports it (``LAYERSPLIT_SGLANG_SPEC_TRACE``, see
:mod:`layersplit.sglang_plugin.spec.step`): lines of many requests interleave, each request's steps count
1, 2, 3, ... in file order, and the step the hook aborted on carries ``"verdict"``. They are gathered into one
trace per request (a request whose steps start again at 1 becomes ``rid#2``); the hook's own verdict is kept
as ``live_verdict`` so a replay with other thresholds can be compared with what production decided.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layersplit.pd.spec.monitor_config import MonitorConfig
from layersplit.pd.spec.metrics import snapshot_from_meta
from layersplit.pd.spec.monitor import VERDICTS, SpecMonitor, Verdict, judge

META_KEYS = ("completion_tokens", "spec_verify_ct")


@dataclass(frozen=True)
class ReplayRecord:
    rid: str
    source: str  # "meta_info" | "trace"
    meta: dict[str, Any] | None = None
    steps: tuple[tuple[int, int], ...] = ()  # (draft_tokens, accepted) per verify step
    label: str | None = None
    live_verdict: str | None = None  # per-step exports: the verdict the hook aborted with (None: not aborted)


@dataclass(frozen=True)
class ReplayResult:
    record: ReplayRecord
    verdict: Verdict
    detected_at: int | None  # generated tokens when a trace was flagged (None: not flagged, or meta_info)

    def to_dict(self) -> dict[str, Any]:
        out = {"rid": self.record.rid, "source": self.record.source, "label": self.record.label,
               "detected_at_generated": self.detected_at, **self.verdict.to_dict()}
        if self.record.live_verdict is not None:
            out["live_verdict"] = self.record.live_verdict
        return out


def _parse_steps(where: str, rec: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    accepted, draft = rec["accepted"], rec.get("draft_tokens")
    if not isinstance(accepted, list) or not all(isinstance(a, int) and not isinstance(a, bool) for a in accepted):
        raise ValueError(f"{where}: field 'accepted': expected a list of ints, got {accepted!r:.80}")
    if isinstance(draft, int) and not isinstance(draft, bool):
        draft = [draft] * len(accepted)
    if not isinstance(draft, list) or len(draft) != len(accepted):
        raise ValueError(f"{where}: field 'draft_tokens': expected an int or a list of {len(accepted)} ints, "
                         f"got {rec.get('draft_tokens')!r:.80}")
    return tuple(zip(draft, accepted))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StepLine:
    """One verify step of a per-step export (``{"rid", "step", "draft_tokens", "accepted"[, "verdict"]}``)."""

    rid: str
    step: int
    draft_tokens: int
    accepted: int
    verdict: str | None = None
    label: str | None = None


def _parse_step_line(where: str, rec: dict[str, Any], label: str | None) -> StepLine:
    for key in ("step", "draft_tokens", "accepted"):
        if not _is_int(rec.get(key)):
            raise ValueError(f"{where}: field '{key}': expected an int, got {rec.get(key)!r:.80}")
    verdict = rec.get("verdict")
    if verdict is not None and verdict not in VERDICTS:
        raise ValueError(f"{where}: field 'verdict': expected one of {list(VERDICTS)}, got {verdict!r}")
    if "rid" not in rec:
        raise ValueError(f"{where}: field 'rid': expected the request id of this step, got nothing (field missing)")
    return StepLine(str(rec["rid"]), rec["step"], rec["draft_tokens"], rec["accepted"], verdict, label)


def parse_record(where: str, rec: Any) -> ReplayRecord | StepLine:
    """One JSONL object -> :class:`ReplayRecord` (or one :class:`StepLine` of a per-step export);
    ``where`` ("file:line") prefixes every error."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    label = rec.get("label")
    if label is not None and label not in VERDICTS:
        raise ValueError(f"{where}: field 'label': expected one of {list(VERDICTS)}, got {label!r}")
    if "step" in rec:
        return _parse_step_line(where, rec, label)
    meta = rec.get("meta_info", rec if all(k in rec for k in META_KEYS) else None)
    rid = str(rec.get("rid") or (meta or {}).get("id") or where)
    if "accepted" in rec:
        return ReplayRecord(rid, "trace", steps=_parse_steps(where, rec), label=label)
    if isinstance(meta, dict):
        missing = [k for k in META_KEYS if k not in meta]
        if missing:
            raise ValueError(f"{where}: field 'meta_info.{missing[0]}': expected an int, got nothing (field missing)")
        return ReplayRecord(rid, "meta_info", meta=meta, label=label)
    raise ValueError(f"{where}: expected a 'meta_info' object (or {', '.join(META_KEYS)}) or an 'accepted' "
                     f"list, got keys {sorted(rec)}")


@dataclass
class _StepRun:
    """The steps of one request gathered so far from a per-step export."""

    rid: str
    steps: list[tuple[int, int]]
    live_verdict: str | None = None
    label: str | None = None

    def record(self) -> ReplayRecord:
        return ReplayRecord(self.rid, "trace", steps=tuple(self.steps), label=self.label,
                            live_verdict=self.live_verdict)


class _StepGather:
    """Per-step lines -> one run per request, in order of each request's first step."""

    def __init__(self) -> None:
        self.newest: dict[str, _StepRun] = {}  # rid -> its newest run
        self.runs: dict[str, int] = {}

    def add(self, where: str, line: StepLine, records: list) -> None:
        run = self.newest.get(line.rid)
        if line.step == 1:  # a request's first step (again, for a rid that ran before: a new run)
            n = self.runs[line.rid] = self.runs.get(line.rid, 0) + 1
            run = self.newest[line.rid] = _StepRun(line.rid if n == 1 else f"{line.rid}#{n}", [])
            records.append(run)
        expected = len(run.steps) + 1 if run else 1
        if line.step != expected:
            raise ValueError(f"{where}: field 'step': expected {expected} (the next step of request "
                             f"{line.rid!r}), got {line.step}")
        run.steps.append((line.draft_tokens, line.accepted))
        run.live_verdict = line.verdict or run.live_verdict
        run.label = line.label or run.label


def load_records(path: str | Path) -> list[ReplayRecord]:
    """Read a JSONL file (blank lines and lines starting with '#' are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: expected a JSONL file, got no such file")
    records: list[ReplayRecord | _StepRun] = []
    gather = _StepGather()
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
        parsed = parse_record(where, obj)
        if isinstance(parsed, StepLine):
            gather.add(where, parsed, records)
        else:
            records.append(parsed)
    return [r.record() if isinstance(r, _StepRun) else r for r in records]


def replay_record(record: ReplayRecord, cfg: MonitorConfig) -> ReplayResult:
    """Judge one record: meta_info once on its totals, a trace step by step until the first anomaly."""
    if record.source == "meta_info":
        try:
            return ReplayResult(record, judge(snapshot_from_meta(record.meta), cfg), None)
        except ValueError as exc:
            raise ValueError(f"record {record.rid!r}: {exc}") from None
    monitor, verdict = SpecMonitor(cfg), None
    for draft_tokens, accepted in record.steps:
        try:
            verdict = monitor.observe(record.rid, draft_tokens, accepted)
        except ValueError as exc:
            raise ValueError(f"record {record.rid!r}: {exc}") from None
        if verdict.anomalous:
            return ReplayResult(record, verdict, verdict.snapshot.generated)
    return ReplayResult(record, monitor.verdict(record.rid), None)


def replay(records: list[ReplayRecord], cfg: MonitorConfig) -> list[ReplayResult]:
    return [replay_record(r, cfg) for r in records]


def summarize(results: list[ReplayResult]) -> dict[str, Any]:
    """Verdict counts per source and, for labelled records, label -> verdict counts and agreement."""
    by_source = {src: dict(Counter(r.verdict.kind for r in results if r.record.source == src))
                 for src in ("meta_info", "trace")}
    labelled = [r for r in results if r.record.label is not None]
    confusion = Counter(f"{r.record.label}->{r.verdict.kind}" for r in labelled)
    agree = sum(r.record.label == r.verdict.kind for r in labelled)
    live = [r for r in results if r.record.live_verdict is not None]
    return {"records": len(results), "verdicts": dict(Counter(r.verdict.kind for r in results)),
            "by_source": by_source, "labelled": len(labelled), "agree_with_label": agree,
            "label_to_verdict": dict(sorted(confusion.items())),
            "live_aborted": len(live), "agree_with_live": sum(r.record.live_verdict == r.verdict.kind for r in live)}


def format_results(results: list[ReplayResult], summary: dict[str, Any]) -> str:
    """Per-request table, reasons, and the summary table."""
    w = max([len(r.record.rid) for r in results] + [14]) + 2
    lines = [f"{'rid':<{w}}{'source':<11}{'label':<12}{'verdict':<12}"
             f"{'gen':>6}{'steps':>7}{'acc_len':>9}{'acc_rate':>10}{'at':>6}"]
    for r in results:
        n = r.verdict.numbers
        rate = f"{n['accept_rate']:.4f}" if "accept_rate" in n else "-"
        length = f"{n['accept_length']:.4f}" if "accept_length" in n else "-"
        lines.append(f"{r.record.rid:<{w}}{r.record.source:<11}{r.record.label or '-':<12}{r.verdict.kind:<12}"
                     f"{n['generated']:>6}{n['verify_steps']:>7}{length:>9}{rate:>10}{r.detected_at or '-':>6}")
    lines += ["", "reasons:"] + [f"  {r.record.rid}: {r.verdict.reason}" for r in results]
    lines += ["", f"{'summary':<{w}}" + "".join(f"{k:>12}" for k in VERDICTS)]
    for src, counts in summary["by_source"].items():
        lines.append(f"{src:<{w}}" + "".join(f"{counts.get(k, 0):>12}" for k in VERDICTS))
    lines.append(f"{'all':<{w}}" + "".join(f"{summary['verdicts'].get(k, 0):>12}" for k in VERDICTS))
    if summary["labelled"]:
        lines.append(f"labelled records: {summary['labelled']}, verdict = label: {summary['agree_with_label']}")
    if summary["live_aborted"]:
        lines.append(f"requests the live hook aborted: {summary['live_aborted']}, "
                     f"replay verdict = live verdict: {summary['agree_with_live']}")
    lines.append("(gen/steps/acc_* are at the verdict: the detection step for flagged traces, the end otherwise; "
                 "'at' = generated tokens when flagged)")
    return "\n".join(lines)
