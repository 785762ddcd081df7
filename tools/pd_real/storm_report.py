"""The real storm's report, from the files its processes wrote (:mod:`tools.pd_real.storm`).

Decode lives: the landing checker's counts and the protocol's are summed over every life (a SIGKILLed
life's last snapshot, at most ``snapshot_s`` old, stands for it); what is held and leaked at the end is
the last life's (a dead life's memory died with it). Abort -> release latencies are pooled over the
lives, in wall-clock seconds. Prefill: summed over every incarnation of every rank; leaks and records
at the end are the last incarnations' that ended (a rank killed for good died with its memory: it is
counted in ``prefill_ranks_dead_at_end``, its last snapshot is no end state). ``requests_per_s``:
successful requests per wall second of the pair, from the supervisor starting decode's first life to
the last request's final outcome (each life's clock starts when its process is up, so a restarted
life's span is short by its start-up time).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tools.pd_real.decode_proc import ROOM_STRIDE
from layersplit.pd.abort.stress import percentiles


def _stats(run_dir: Path, prefix: str) -> list[dict]:
    out = []
    for path in sorted(run_dir.glob(f"{prefix}*.stats.json")):
        out.append(json.loads(path.read_text()))
    return out


def report(run, faults, run_dir: Path, wall_s: float, proxy_stats: dict) -> dict:
    cfg = run.stress
    lives = sorted(_stats(run_dir, "decode-l"), key=lambda r: r["life"])
    prefills = _stats(run_dir, "prefill")
    last = lives[-1] if lives else {}
    outcomes = Counter()
    last_outcome = 0.0
    lines = (run_dir / "outcomes.jsonl").read_text().splitlines() if (run_dir / "outcomes.jsonl").exists() else []
    for line in lines:
        rec = json.loads(line)
        outcomes["success" if rec["state"] == "Success" else "cancelled" if rec["reason"] == "client" else "gave_up"] += 1
    events = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()] \
        if (run_dir / "faults.jsonl").exists() else []
    latencies = [x for life in lives for x in life["release_latencies"]]
    newest = {}
    for p in prefills:
        if p["rank"] not in newest or p["incarnation"] > newest[p["rank"]]["incarnation"]:
            newest[p["rank"]] = p
    ended = [p for p in newest.values() if p.get("final")]
    sum_life = lambda key: sum(life["checks"][key] for life in lives)  # noqa: E731
    sum_stat = lambda key: sum(life["stats"][key] for life in lives)  # noqa: E731
    starts = {int(e["process"][len("decode-l"):]): e["at_s"] for e in events
              if e["event"] == "start" and e["process"].startswith("decode-l")}
    span = max((starts.get(rec["room"] // ROOM_STRIDE, 0.0) + rec["at_s"] for rec in map(json.loads, lines)),
               default=wall_s)
    return {
        "transport": "mooncake-tcp + zmq (real processes on loopback)", "requests": cfg.requests, "seed": cfg.seed,
        "legacy_immediate_release": cfg.legacy_immediate_release, "guards_off": list(run.guards_off),
        "prefill_cp": len(cfg.topology.ranks),
        "layers_by_rank": [list(x) for x in cfg.topology.layers_by_rank], "page_bytes": run.page_bytes,
        "wall_s": round(wall_s, 3), "final_outcomes": len(lines), "outcomes": dict(outcomes),
        "requests_per_s": round(outcomes["success"] / max(span, 1e-9), 2), "span_s": round(span, 3),
        "decode_lives": len(lives), "lives": [{k: life[k] for k in ("life", "pending_at_start", "final_outcomes")}
                                              for life in lives], "prefill_incarnations": len(prefills),
        "faults": events, "proxy": proxy_stats,
        # control frames dropped unread (tools.pd_real.wire): none of the pair's own; any is a stranger's or a bug
        "malformed_frames": proxy_stats["malformed_frames"]
        + sum(r["channel"]["malformed_frames"] for r in lives + prefills),
        "refused_frames": sum(r["channel"]["refused_frames"] for r in lives + prefills),
        "overwrites": sum_life("overwrites"), "stale_reads": sum_life("stale_reads"),
        "landing": {k: sum_life(k) for k in ("pages_read", "overwrites_at_release", "late_writes_on_free_pages",
                                             "late_writes_at_alloc", "scans")},
        "overwrite_log": [e for life in lives for e in life["overwrite_log"]][:10],
        "checksum_mismatches": sum_stat("checksum_mismatches"), "bad_frees": sum(life["bad_frees"] for life in lives)
        + sum(p["bad_frees"] for p in prefills),
        "source_stale_reads": sum(p["source_stale_reads"] for p in prefills),
        "leaked_pages": last.get("leaked_pages", 0), "requests_still_held": last.get("requests_still_held", 0),
        "pages_held_at_end": last.get("pages_held_at_end", 0),
        "quarantined_pages_at_end": last.get("quarantined_pages_at_end", 0),
        "prefill_leaked_pages": sum(p["prefill_leaked_pages"] for p in ended),
        "prefill_ranks_dead_at_end": len(newest) - len(ended),
        "abort_to_release_s": percentiles(latencies),
        "decode_successes": sum_stat("success"),  # a dead life's successes still decoding were submitted again
        **{k: sum_stat(k) for k in ("aborts", "acks", "abort_sends", "abort_resends", "fences",
                                    "released_by_fence", "unreachable_fences", "quarantines", "old_life_messages",
                                    "stale_acks")},
        "aborts_by_reason": dict(sum((Counter(life["aborts_by_reason"]) for life in lives), Counter())),
        "memory": {k: sum(life["memory"][k] for life in lives) for k in ("deregistrations", "reregistrations")},
        "unsafe_fences_kept_registered": sum(life["memory"]["unsafe_fences_kept_registered"] for life in lives),
        "deregister_s_max": max((life["memory"]["deregister_s_max"] for life in lives), default=0.0),
        "registry": {k: sum(life["registry"][k] for life in lives) for k in ("admissions", "readmissions",
                                                                              "expiries", "revoked_sent")},
        "engine": {k: sum(p["engine"][k] for p in prefills) for k in ("batches", "writes", "errors", "post_failures")},
        "prefill_in_flight_at_end": sum(p["in_flight"] for p in ended),
        "prefill_stats": {k: sum(p["stats"][k] for p in prefills) for k in ("rejected_late", "wrong_incarnation",
                                                                             "acks_sent", "orphaned", "decode_lives")},
        "run_dir": str(run_dir),
    }
