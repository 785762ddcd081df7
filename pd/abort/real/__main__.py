"""``python -m pd.abort.real [a a-timeout b b-fence c c-reregister d d-kill d-proxy ...]``: run the probes
of the assumptions (issue 28, item 4) and print each result as one JSON line (all of them by default)."""

from __future__ import annotations

import json
import sys

from pd.abort.real import probes, proxy_order, zmq_order

PROBES = {
    "a": lambda: probes.after_complete(),
    "a-timeout": lambda: probes.after_timeout(),
    "b": lambda: probes.after_kill(),
    "b-running": lambda: probes.after_kill(stall_decode=False, kill_after_s=0.0, count=2048),
    "b-fence": lambda: probes.after_kill(fence=True),
    "c": lambda: probes.after_deregister(),
    "c-reregister": lambda: probes.after_deregister(reregister=True),
    "d": lambda: {p: zmq_order.order(p) for p in zmq_order.PATTERNS},
    "d-kill": lambda: {p: zmq_order.order(p, count=3000, kill_first_after=500) for p in zmq_order.PATTERNS},
    "d-proxy": lambda: {f"seed {s}": proxy_order.order_through_proxy(seed=s) for s in (0, 1, 2)},
}


def main(argv: list[str]) -> int:
    names = argv or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise SystemExit(f"probes: expected any of {list(PROBES)}, got {unknown}")
    for name in names:
        print(json.dumps({"probe": name, **PROBES[name]()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
