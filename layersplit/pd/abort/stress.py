"""PD abort stress: abort storms against LayerSplit prefill ranks, over a lossy control channel and a
transfer engine whose writes cannot be cancelled, with the safe-release protocol on (default) or the
legacy immediate release. A **discrete-event simulation** (virtual time); all randomness comes from
one seed, so every run — and every race it finds — replays exactly.

Checks: (1) the invariant checker — every landing write must hit a page whose current (room,
generation) is the writer's, and every free must come from the page's owner; (2) a checksum of every
layer of every successful request's KV when decode starts, and of every source page a write reads;
(3) end-of-run accounting — every page free or held by a request still tracked, no request still
held (liveness: quarantine heals, dead ranks are fenced), no quarantined page freed; (4) no write of a
fenced prefill process lands, and no TransferRequest decode still waits on is rejected as late. ``failures(report)`` lists what a safe run must never show.
"""

from __future__ import annotations

import math
from collections import Counter

from layersplit.pd.abort.cluster import PDCluster
from layersplit.pd.abort.stress_config import PDStressConfig  # noqa: F401 - this module's API (configs come from here)

MUST_BE_ZERO = ("overwrites", "bad_frees", "source_stale_reads", "checksum_mismatches", "leaked_pages",
                "prefill_leaked_pages", "requests_still_held", "quarantined_pages_freed", "fenced_writes_landed",
                "false_late_rejections")


def run_pd_stress(cfg: PDStressConfig) -> dict:
    """Run the storm; returns the report (counts and virtual-time latencies, JSON-ready)."""
    cluster = PDCluster(cfg)
    t = 0.0
    for rid in range(cfg.requests):
        t += cluster.rng.expovariate(1.0 / cfg.mean_arrival_s)
        cluster.loop.after(t, cluster.submit, rid)
    cluster.schedule_faults(until=t)
    cluster.loop.run(cfg.until_s)
    return _report(cfg, cluster)


def _report(cfg: PDStressConfig, cluster: PDCluster) -> dict:
    d, prefills = cluster.decode, cluster.prefills
    lives = [*cluster.past_decodes, d]  # every decode process: what a crashed one counted still counts
    stats = Counter()
    for node in lives:
        stats.update(node.stats)
    return {
        "requests": cfg.requests, "seed": cfg.seed, "legacy_immediate_release": cfg.legacy_immediate_release,
        "prefill_cp": len(prefills), "layers": cfg.topology.num_layers,
        "layers_by_rank": [list(layers) for layers in cfg.topology.layers_by_rank],
        "rooms": cluster.rooms, "retries": cluster.retries, "outcomes": dict(cluster.outcomes),
        **{k: stats[k] for k in ("success", "aborts", "aborts_ignored", "released_at_once", "abort_sends",
                                 "abort_resends", "acks", "acks_from_restarted_rank", "transfer_resends")},
        "aborts_by_reason": dict(sorted(sum((node.abort_reasons for node in lives), Counter()).items())),
        "stale_acks_ignored": stats["stale_acks"], "late_messages_ignored": stats["late_messages"],
        "abort_to_release_s": percentiles([x for node in lives for x in node.release_latencies]),
        **{f"prefill_{k}": sum(p.stats[k] for p in prefills)
           for k in ("rejected_late", "wrong_incarnation", "crashes", "lost_while_down")},
        "peak_prefill_records": max(p.peak_records for p in prefills),
        "peak_prefill_tombstones": max(p.peak_tombstones for p in prefills),
        "prefill_records_at_end": max(len(p.book.records) for p in prefills),
        "quarantines": stats["quarantines"], "quarantine_released": stats["quarantine_released"],
        "quarantined_pages_at_end": d.quarantined_pages, "quarantined_pages_freed": stats["quarantined_pages_freed"],
        "overwrites": sum(len(node.kv.overwrites) for node in lives),
        "bad_frees": sum(len(node.kv.bad_frees) for node in lives) + sum(len(p.kv.bad_frees) for p in prefills),
        "source_stale_reads": sum(len(p.kv.stale_reads) for p in prefills),
        "checksum_mismatches": stats["checksum_mismatches"],
        "leaked_pages": cluster.leaked_pages(), "prefill_leaked_pages": cluster.prefill_leaked_pages(),
        "requests_still_held": len(d.reqs), "pages_held_at_end": sum(len(r.pages) for r in d.reqs.values()),
        "peak_held_aborted_pages": d.peak_held_aborted_pages,
        "fences": [{"rank": r, "incarnation": i, "at_s": round(t, 4)} for node in lives
                   for r, i, t in node.fences],
        **{k: stats[k] for k in ("released_by_fence", "misaddressed", "non_owner", "old_life_messages",
                                 "resumed_sends", "paused_sends", "decode_restarts", "unreachable_fences")},
        "fenced_writes_refused": sum(p.engine.stats["fenced_refused"] for p in prefills),
        "fenced_writes_landed": sum(p.engine.stats["fenced_landed"] for p in prefills),
        "dead_life_writes_refused": sum(node.kv.refused_dead_life for node in lives), "decode_life": d.life,
        **{f"prefill_{k}": sum(p.stats[k] for p in prefills) for k in ("stale_decode_life", "orphaned")},
        **cluster.stats, **cluster.watch.report(),
        "channel": dict(cluster.channel.stats),
        "engine": {k: sum(p.engine.stats[k] for p in prefills) for k in ("batches", "writes", "errors")},
        "sim_seconds": cluster.loop.now,
    }


def percentiles(values: list[float]) -> dict:
    """p50 / p99 / max by the nearest-rank method (None when there is nothing to rank)."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    ranked = sorted(values)
    at = lambda q: ranked[max(0, math.ceil(q * len(ranked)) - 1)]  # noqa: E731
    return {"n": len(ranked), "p50": round(at(0.50), 4), "p99": round(at(0.99), 4), "max": round(ranked[-1], 4)}


def failures(report: dict) -> list[str]:
    """What a safe run must never show; the CLI exits non-zero when this is not empty."""
    return [f"{key}={report[key]}" for key in MUST_BE_ZERO if report[key]]
