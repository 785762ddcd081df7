"""``layersplit monitor``: the speculative-decoding anomaly monitor (pd/) from the command line.

* ``monitor replay FILE.jsonl [--json] [--config Y]``: verdicts for recorded requests (SGLang meta_info, per-step
  traces, or the per-step JSONL the SGLang hook exports with ``LAYERSPLIT_SGLANG_SPEC_TRACE``), under the
  thresholds of ``--config``;
* ``monitor eval [--json] [--requests N] [--seed S]``: SYNTHETIC precision / recall / FPR / tokens-to-detect of
  the monitor, a threshold sweep and a regex/charset text baseline.
"""

from __future__ import annotations

import argparse
import json

from layersplit.cli import options


def add_parser(sub: argparse._SubParsersAction, int_at_least) -> None:
    p = sub.add_parser("monitor", help="spec-decoding anomaly monitor: replay recorded requests, evaluate")
    which = p.add_subparsers(dest="action", required=True)
    r = which.add_parser("replay", help="judge recorded requests (JSONL: SGLang meta_info, per-step traces, "
                                        "or the SGLang hook's per-step export)")
    r.add_argument("file", type=options.readable_file, help="JSONL file, one request (or, for a per-step export, one verify step) per line")
    r.add_argument("--config", type=options.name_or_path, default=None,
                   help="monitor YAML (default configs/monitor.yaml)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=run_replay)
    e = which.add_parser("eval", help="SYNTHETIC evaluation on labelled traces from a tiny draft/target pair")
    e.add_argument("--requests", type=int_at_least(1), default=24, help="requests per regime (default 24)")
    e.add_argument("--seed", type=options.seed, default=0, help="seed of the synthetic traces (default 0)")
    e.add_argument("--config", type=options.name_or_path, default=None,
                   help="monitor YAML (default configs/monitor.yaml)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=run_eval)


def run_replay(args: argparse.Namespace) -> int:
    from layersplit.pd.spec.monitor_config import default_config_path, load_monitor_config
    from layersplit.pd.spec.replay import format_results, load_records, replay, summarize

    cfg = load_monitor_config(args.config)
    try:
        records = load_records(args.file)
    except UnicodeDecodeError as exc:  # the codec's message names neither the file nor the line
        line = exc.object[:exc.start].count(b"\n") + 1
        raise ValueError(f"{args.file}:{line}: expected UTF-8 text, got byte 0x{exc.object[exc.start]:02x} (not "
                         "UTF-8)") from None
    if not records:
        raise ValueError(f"file: expected at least one JSONL record in {str(args.file)!r}, got none")
    results = replay(records, cfg)
    summary = summarize(results)
    if args.json:
        print(json.dumps({"file": str(args.file), "config": str(args.config or default_config_path()),
                          "results": [r.to_dict() for r in results], "summary": summary}))
    else:
        print(format_results(results, summary))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from layersplit.pd.spec.monitor_config import load_monitor_config
    from layersplit.pd.spec.evaluate import format_report, run_eval as evaluate

    cfg = load_monitor_config(args.config)
    options.stage_printer("monitor eval")(f"{args.requests} synthetic requests per regime through a tiny draft/target pair")
    report = evaluate(cfg, requests_per_regime=args.requests, seed=args.seed)
    print(json.dumps(report) if args.json else format_report(report))
    return 0
