"""The LayerSplit CP prefill engine: what one prefill group of N ranks runs.

- :mod:`.batch_plan` — the per-batch plan every layer uses (pages, page tables, broadcast rows, token split);
- :mod:`.cp_pool` — the ``redundant`` and ``layersplit`` KV pools behind one interface;
- :mod:`.comm` — CP collectives on a comm stream, each returning the event that guards its result;
- :mod:`.model` — the tiny DSA model (seeded weights) split into the stages the engine interleaves with comm;
- :mod:`.engine` — one rank's prefill of a batch (broadcast schedule, scratch slots, stream edges);
- :mod:`.requests` — requests and cached prefixes built from plain arguments (context, hit rate, seed);
- :mod:`.launcher` — N real rank processes (gloo on CPU, NCCL on CUDA) or the single-process reference;
- :mod:`.trace` — a rank's timeline as Chrome trace-event JSON.

Which rank owns each layer is :mod:`layersplit.plan.ownership` (plain arithmetic, below the engine).
Depends on :mod:`layersplit.plan`, ``dsa_kernels`` and ``hicache`` below it; nothing here imports the CLI.
"""
