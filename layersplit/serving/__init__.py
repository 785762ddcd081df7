"""The 40k-120k serving sweep at 90% prefix reuse.

- :mod:`.workload` — the coding-agent workload (sessions, reusable prefixes) and per-mode tier sizes;
- :mod:`.serving` — the serving loop shared by every engine (prefix-cache tiers, admission, batching);
- :mod:`.cost_model` — the H200 cost model of one batch (everything it returns is MODELLED);
- :mod:`.sweep_engines` — the measured engine (real CP ranks) and the modelled one;
- :mod:`.sweep_config`, :mod:`.sweep` — sweep configs and the sweep itself (streamed ``points.jsonl``);
- :mod:`.gain_map` — LayerSplit's gain over length x sessions (or host GB).
"""
