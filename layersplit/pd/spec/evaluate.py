"""SYNTHETIC evaluation of the spec-decoding monitor against labelled traces (layersplit/pd/spec/synth.py).

For every detector (the monitor at ``configs/monitor.yaml``, a one-knob-at-a-time threshold sweep, and the
regex/charset text baseline) over healthy / garbled / repetition traces:

* precision: correct flags / all flags. A flag is correct when its kind matches the label and it comes at
  or after the fault onset; flags on healthy traces, before the onset, or of the wrong kind are false.
* recall: correct flags / anomalous traces (also per kind).
* FPR: flagged healthy traces / healthy traces.
* tokens to detect: generated tokens from the onset to the flag, over correct flags (median, p90).

Everything is computed from seeded traces; nothing here is production data.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

from layersplit.pd.spec.monitor_config import MonitorConfig
from layersplit.pd.spec.monitor import HEALTHY, SpecMonitor
from layersplit.pd.spec.synth import REGIMES, SynthConfig, SynthTrace, TinyPair, decode, generate
from layersplit.pd.spec.text_baseline import TextBaseline

SYNTHETIC_NOTE = ("SYNTHETIC: traces from a tiny seeded draft/target pair (layersplit/pd/spec/synth.py) with injected "
                  "faults; not production data")

Detection = tuple[str, int | None]  # (kind, generated tokens when flagged)


def make_traces(requests_per_regime: int, seed: int, synth: SynthConfig = SynthConfig()) -> list[SynthTrace]:
    """``requests_per_regime`` traces of each regime from one seeded draft/target pair."""
    if requests_per_regime < 1:
        raise ValueError(f"requests_per_regime: expected an int >= 1, got {requests_per_regime}")
    pair = TinyPair(synth, seed)
    return [generate(pair, regime, f"{regime}-{i}", [seed, r, i])
            for r, regime in enumerate(REGIMES) for i in range(requests_per_regime)]


def detect_monitor(trace: SynthTrace, cfg: MonitorConfig) -> Detection:
    """Feed the trace's verify steps through a :class:`SpecMonitor`; the first anomalous verdict wins."""
    monitor, generated = SpecMonitor(cfg), 0
    for accepted in trace.accepted:
        generated += accepted + 1
        verdict = monitor.observe(trace.rid, trace.draft_tokens, accepted)
        if verdict.anomalous:
            return verdict.kind, generated
    return HEALTHY, None


def detect_text(trace: SynthTrace, baseline: TextBaseline, every_tokens: int = 32) -> Detection:
    """Run the text heuristic on the decoded output every ``every_tokens`` generated tokens and at the end."""
    n = len(trace.tokens)
    for stop in [*range(every_tokens, n, every_tokens), n]:
        kind = baseline.judge(decode(trace.tokens[:stop]))
        if kind != HEALTHY:
            return kind, stop
    return HEALTHY, None


def _percentile(values: list[int], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def score(traces: list[SynthTrace], detections: list[Detection]) -> dict[str, Any]:
    """Precision, recall (all and per kind), FPR on healthy traces and tokens to detect."""
    tp = {kind: 0 for kind in REGIMES[1:]}
    labelled = {kind: sum(t.label == kind for t in traces) for kind in REGIMES}
    flagged = fp_healthy = early = 0
    delays: dict[str, list[int]] = {kind: [] for kind in REGIMES[1:]}
    for trace, (kind, at) in zip(traces, detections):
        if kind == HEALTHY:
            continue
        flagged += 1
        if trace.label == HEALTHY:
            fp_healthy += 1
        elif kind == trace.label and at >= trace.onset_generated:
            tp[kind] += 1
            delays[kind].append(at - trace.onset_generated)
        elif at < trace.onset_generated:
            early += 1
    hits, anomalous = sum(tp.values()), labelled["garbled"] + labelled["repetition"]
    every = delays["garbled"] + delays["repetition"]
    median = lambda xs: float(statistics.median(xs)) if xs else None  # noqa: E731
    ratio = lambda num, den: round(num / den, 4) if den else None  # noqa: E731
    return {
        "precision": ratio(hits, flagged), "recall": ratio(hits, anomalous),
        "recall_garbled": ratio(tp["garbled"], labelled["garbled"]),
        "recall_repetition": ratio(tp["repetition"], labelled["repetition"]),
        "fpr_healthy": ratio(fp_healthy, labelled[HEALTHY]),
        "ttd_median": median(every), "ttd_p90": _percentile(every, 0.9),
        "ttd_median_garbled": median(delays["garbled"]), "ttd_median_repetition": median(delays["repetition"]),
        "flagged": flagged, "true_positives": hits, "false_positives": flagged - hits,
        "flagged_healthy": fp_healthy, "flagged_before_onset": early,
    }


def sweep(base: MonitorConfig) -> list[tuple[str, MonitorConfig]]:
    """One knob at a time around ``base``: (setting, config) pairs."""
    rows = []
    for signal in ("cumulative", "window"):  # both rules on one signal; "cumulative" is the rule as published
        both = dataclasses.replace(base, garbled=dataclasses.replace(base.garbled, signal=signal),
                                   repetition=dataclasses.replace(base.repetition, signal=signal))
        rows.append((f"both rules {signal} only", both))
    for signal in ("cumulative", "window"):
        for thr in (1.2, 1.3, 1.4, 1.5, 1.6, 1.8):
            rule = dataclasses.replace(base.garbled, accept_length_below=thr, signal=signal)
            rows.append((f"garbled {signal} length<{thr}", dataclasses.replace(base, garbled=rule)))
    for after in (64, 256):
        rule = dataclasses.replace(base.garbled, after_generated_tokens=after)
        rows.append((f"garbled after>{after} tokens", dataclasses.replace(base, garbled=rule)))
    for signal in ("cumulative", "window"):
        for thr in (0.90, 0.93, 0.96, 0.98):
            rule = dataclasses.replace(base.repetition, accept_rate_above=thr, signal=signal)
            rows.append((f"repetition {signal} rate>{thr}", dataclasses.replace(base, repetition=rule)))
    for window in (16, 64):
        rows.append((f"window {window} steps", dataclasses.replace(base, window_steps=window)))
    return rows


def _regime_stats(traces: list[SynthTrace]) -> dict[str, Any]:
    """Per regime: accept metrics over whole traces and after the onset, and the non-ASCII share of the text."""
    out = {}
    for regime in REGIMES:
        group = [t for t in traces if t.label == regime]
        whole = [a for t in group for a in t.accepted]
        after = [a for t in group for a in t.accepted_after_onset()]
        text = "".join(t.text for t in group)
        drafts = group[0].draft_tokens - 1
        out[regime] = {
            "requests": len(group), "quoting_requests": sum(t.variant == "quote" for t in group),
            "verify_steps": len(whole),
            "accept_length": round((sum(whole) + len(whole)) / len(whole), 4),
            "accept_rate": round(sum(whole) / (len(whole) * drafts), 4),
            "accept_length_after_onset": round((sum(after) + len(after)) / len(after), 4),
            "accept_rate_after_onset": round(sum(after) / (len(after) * drafts), 4),
            "non_ascii_char_fraction": round(sum(not ch.isascii() for ch in text) / len(text), 4),
        }
    return out


def _row(detector: str, setting: str, traces: list[SynthTrace], detect: Callable[[SynthTrace], Detection]):
    return {"detector": detector, "setting": setting, **score(traces, [detect(t) for t in traces])}


def run_eval(cfg: MonitorConfig, requests_per_regime: int = 24, seed: int = 0,
             synth: SynthConfig = SynthConfig()) -> dict[str, Any]:
    """The full SYNTHETIC report: setup, per-regime metrics, and one scored row per detector setting.

    Example::

        report = run_eval(load_monitor_config(), requests_per_regime=8)
        report["rows"][0]["recall"]
    """
    traces = make_traces(requests_per_regime, seed, synth)
    baseline = TextBaseline()
    rows = [_row("monitor", "configs/monitor.yaml", traces, lambda t: detect_monitor(t, cfg)),
            _row("text baseline", f"non-ascii>{baseline.rare_fraction_above:.0%} | unit x{baseline.min_repeats} regex",
                 traces, lambda t: detect_text(t, baseline))]
    rows += [_row("monitor sweep", name, traces, lambda t, c=c: detect_monitor(t, c)) for name, c in sweep(cfg)]
    return {
        "synthetic": True, "note": SYNTHETIC_NOTE, "seed": seed, "requests_per_regime": requests_per_regime,
        "draft_tokens": synth.draft_tokens, "max_new_tokens": synth.max_new_tokens,
        "onset_tokens": list(synth.onset_tokens), "regimes": _regime_stats(traces), "rows": rows,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) and not float(value).is_integer() else f"{value:g}"


def format_report(report: dict[str, Any]) -> str:
    """A text table of :func:`run_eval`'s report."""
    lines = [report["note"], f"seed {report['seed']}, {report['requests_per_regime']} requests per regime, "
             f"draft_tokens {report['draft_tokens']}, {report['max_new_tokens']} new tokens, fault onset "
             f"{report['onset_tokens'][0]}..{report['onset_tokens'][1]} tokens", ""]
    lines.append(f"{'regime':<12}{'requests':>9}{'accept_len':>11}{'accept_rate':>12}{'len_after':>10}"
                 f"{'rate_after':>11}{'non-ascii':>10}")
    for regime, st in report["regimes"].items():
        lines.append(f"{regime:<12}{st['requests']:>9}{st['accept_length']:>11.3f}{st['accept_rate']:>12.3f}"
                     f"{st['accept_length_after_onset']:>10.3f}{st['accept_rate_after_onset']:>11.3f}"
                     f"{st['non_ascii_char_fraction']:>10.3f}")
    lines.append("(*_after: verify steps from the fault onset on; healthy traces have no onset)")
    cols = [("precision", "prec"), ("recall", "recall"), ("recall_garbled", "rec_garb"),
            ("recall_repetition", "rec_rep"), ("fpr_healthy", "FPR"), ("ttd_median", "ttd_med"), ("ttd_p90", "ttd_p90")]
    lines += ["", f"{'detector':<15}{'setting':<42}" + "".join(f"{h:>9}" for _, h in cols)]
    for row in report["rows"]:
        lines.append(f"{row['detector']:<15}{row['setting']:<42}" + "".join(f"{_fmt(row[k]):>9}" for k, _ in cols))
    lines.append("ttd = generated tokens from fault onset to detection (correct detections only)")
    return "\n".join(lines)
