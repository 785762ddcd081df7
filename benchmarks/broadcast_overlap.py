"""KV-broadcast overlap benchmark: how much of a stall injected before every KV broadcast reaches the forward.

The runtime's delay hook stalls the comm stream for ``--delay-ms`` before every ``bcast_kv[l]``, on
every rank. Each schedule of the CP engine runs the same batch without and with the stall, in one set
of rank processes, alternating per repeat (so load drift on the machine hits both alike):

* ``legacy``: one FIFO comm stream; layer l's all-gather, which the indexer waits for, queues behind
  layer l's KV broadcast, so the stall reaches the indexer (on owned layers too: the owner's
  all-gather queues behind its own send);
* ``overlapped``: the KV broadcast on its own stream and communicator; only sparse attention waits for
  it, so the stall hides under MLP(l-1), the projections, the all-gather and the indexer.

``exposed_share = (forward with stall - forward without) / (delay x non-owned layers)``, forward =
the slowest rank's compute-stream time, median of ``--repeats`` paired differences. Hidden: well below
1 while the delay is shorter than the work it hides under; a schedule that exposes every broadcast
scores ~1 (legacy scores about layers / non-owned layers, since the owner's stalls are exposed too).
On a loaded machine the forward time drifts by more than the stalls; ``wait_exposed_share`` is the
same ratio for the time the compute stream stood still waiting for collectives (all-gathers,
broadcasts, send packing: the slowest rank's sum), which compute-time noise does not inflate.
Measured on this machine's runtime (CPU: gloo between processes, emulated streams; the ranks share
its cores). The per-layer order itself is not timed: ``RankResult.kv_order`` has it, from the issued
program's happens-before order.

    python benchmarks/broadcast_overlap.py [--cp 2] [--context-len 4096] [--hit 0.9] [--delay-ms 10]
                                           [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from dsa_kernels.layout import PAGE_SIZE
from layersplit.engine.engine import SCHEDULES, EngineConfig, FaultInjection
from layersplit.engine.launcher import Scenario, run_cp
from layersplit.plan.ownership import plan_ownership
from layersplit.engine.requests import synthetic_requests
from layersplit.plan.config import load_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--context-len", type=int, default=4096)
    ap.add_argument("--hit", type=float, default=0.9)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per schedule")
    args = ap.parse_args(argv)
    for name in ("cp", "context_len", "requests", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.cp < 2:
        ap.error(f"--cp: expected >= 2 (with one rank nothing is broadcast), got {args.cp}")
    if not 0 <= args.hit < 1:
        ap.error(f"--hit: expected a number in [0, 1), got {args.hit}")
    if not args.delay_ms > 0:
        ap.error(f"--delay-ms: expected a number > 0, got {args.delay_ms}")
    return args


def scenarios(args: argparse.Namespace, reqs) -> list[Scenario]:
    base = dict(mode="layersplit", cp=args.cp, pool_pages=args.requests * -(-args.context_len // PAGE_SIZE),
                max_batch_tokens=args.requests * args.context_len, max_requests=args.requests, trace=False)
    cells = [(s, d) for s in SCHEDULES for d in (0.0, args.delay_ms)]
    out = [Scenario("warm-up", reqs, EngineConfig(**base))]
    for rep in range(args.repeats):  # alternate the order per repeat: drift in the machine's load hits all cells
        for schedule, delay in (cells if rep % 2 == 0 else cells[::-1]):
            cfg = EngineConfig(schedule=schedule, faults=FaultInjection(bcast_kv_delay_s=delay / 1e3), **base)
            out.append(Scenario(f"{schedule}/{delay:g}/{rep}", reqs, cfg))
    return out


def summarize(args: argparse.Namespace, results) -> list[dict]:
    model = load_model(args.model)
    own = plan_ownership(model.num_layers, args.cp, "contiguous")
    non_owned = max(model.num_layers - len(own.owned_layers(r)) for r in range(args.cp))
    by_name = {r.name: r.seconds for r in results}
    by_wait = {r.name: max(rank.comm_wait_s for rank in r.ranks) for r in results}
    rows = []
    for schedule in SCHEDULES:
        base = [by_name[f"{schedule}/0/{i}"] for i in range(args.repeats)]
        stalled = [by_name[f"{schedule}/{args.delay_ms:g}/{i}"] for i in range(args.repeats)]
        growth = statistics.median(s - b for s, b in zip(stalled, base))
        w_base = [by_wait[f"{schedule}/0/{i}"] for i in range(args.repeats)]
        w_stalled = [by_wait[f"{schedule}/{args.delay_ms:g}/{i}"] for i in range(args.repeats)]
        w_growth = statistics.median(s - b for s, b in zip(w_stalled, w_base))
        rows.append({"schedule": schedule, "delay_ms": args.delay_ms, "non_owned_layers": non_owned,
                     "forward_ms": round(statistics.median(base) * 1e3, 2),
                     "forward_with_delay_ms": round(statistics.median(stalled) * 1e3, 2),
                     "growth_ms": round(growth * 1e3, 2),
                     "exposed_share": round(growth / (args.delay_ms / 1e3 * non_owned), 3),
                     "comm_wait_ms": round(statistics.median(w_base) * 1e3, 2),
                     "comm_wait_with_delay_ms": round(statistics.median(w_stalled) * 1e3, 2),
                     "wait_exposed_share": round(w_growth / (args.delay_ms / 1e3 * non_owned), 3),
                     "repeats": args.repeats, "model": args.model, "cp": args.cp,
                     "context_len": args.context_len, "hit": args.hit, "measured": "this machine's runtime"})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = load_model(args.model)
    reqs = synthetic_requests(args.requests, args.context_len, args.hit, model.vocab_size, 0)
    rows = summarize(args, run_cp(model, scenarios(args, reqs), args.cp))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"KV-broadcast stall of {args.delay_ms:g} ms before every bcast_kv, {args.model} cp{args.cp}, "
          f"context {args.context_len} at hit {args.hit}, median of {args.repeats} paired repeats (measured)")
    print(f"{'schedule':<11} {'forward ms':>10} {'with delay':>10} {'growth ms':>9} {'delay x layers':>14} "
          f"{'exposed_share':>13} {'comm waits ms':>13} {'with delay':>10} {'wait_exposed_share':>18}")
    for r in rows:
        print(f"{r['schedule']:<11} {r['forward_ms']:>10.2f} {r['forward_with_delay_ms']:>10.2f} "
              f"{r['growth_ms']:>9.2f} {args.delay_ms * r['non_owned_layers']:>14.1f} {r['exposed_share']:>13.3f} "
              f"{r['comm_wait_ms']:>13.2f} {r['comm_wait_with_delay_ms']:>10.2f} {r['wait_exposed_share']:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
