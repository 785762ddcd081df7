"""Replay recorded requests through the monitor: ``layersplit monitor replay FILE.jsonl``.

One JSON object per line, in either form (``rid`` falls back to ``meta_info.id``, then the line number;
an optional ``label`` — healthy / garbled / repetition — is compared with the verdict in the summary)::

    {"rid": "a", "meta_info": {"completion_tokens": 412, "spec_verify_ct": 160,
                               "spec_accept_length": 2.575, "spec_accept_rate": 0.525}}
    {"rid": "b", "draft_tokens": 4, "accepted": [3, 2, 0, 3, ...]}

The first is SGLang's per-request ``meta_info`` (the meta fields may also sit at the top level) and is judged
once on its cumulative metrics; the second is a per-step trace (accepted drafts per verify step;
``draft_tokens`` is one int or one per step) and is fed step by step, as the live guard would see it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd.monitor_config import MonitorConfig
from pd.spec_metrics import snapshot_from_meta
from pd.spec_monitor import VERDICTS, SpecMonitor, Verdict, judge

META_KEYS = ("completion_tokens", "spec_verify_ct")


@dataclass(frozen=True)
class ReplayRecord:
    rid: str
    source: str  # "meta_info" | "trace"
    meta: dict[str, Any] | None = None
    steps: tuple[tuple[int, int], ...] = ()  # (draft_tokens, accepted) per verify step
    label: str | None = None


@dataclass(frozen=True)
class ReplayResult:
    record: ReplayRecord
    verdict: Verdict
    detected_at: int | None  # generated tokens when a trace was flagged (None: not flagged, or meta_info)

    def to_dict(self) -> dict[str, Any]:
        return {"rid": self.record.rid, "source": self.record.source, "label": self.record.label,
                "detected_at_generated": self.detected_at, **self.verdict.to_dict()}


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


def parse_record(where: str, rec: Any) -> ReplayRecord:
    """One JSONL object -> :class:`ReplayRecord`; ``where`` ("file:line") prefixes every error."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    label = rec.get("label")
    if label is not None and label not in VERDICTS:
        raise ValueError(f"{where}: field 'label': expected one of {list(VERDICTS)}, got {label!r}")
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


def load_records(path: str | Path) -> list[ReplayRecord]:
    """Read a JSONL file (blank lines and lines starting with '#' are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: expected a JSONL file, got no such file")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
        records.append(parse_record(where, obj))
    return records


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
    return {"records": len(results), "verdicts": dict(Counter(r.verdict.kind for r in results)),
            "by_source": by_source, "labelled": len(labelled), "agree_with_label": agree,
            "label_to_verdict": dict(sorted(confusion.items()))}


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
    lines.append("(gen/steps/acc_* are at the verdict: the detection step for flagged traces, the end otherwise; "
                 "'at' = generated tokens when flagged)")
    return "\n".join(lines)
