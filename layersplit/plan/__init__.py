"""Capacity planning, pure arithmetic at the bottom of ``layersplit`` (no torch; imports nothing of
``engine``, ``serving`` or ``sglang_plugin``):

- :mod:`.config` — model and hardware configs (YAML, or a model's ``config.json`` via :mod:`.model_json`);
- :mod:`.choices` — the engine's named choices (modes, splits, ownership strategies, schedules) as tuples;
- :mod:`.ownership` — which rank owns (stores the KV cache of) each layer;
- :mod:`.sizing` — the bytes the SGLang plug-in's pool allocates beside the owned layers;
- :mod:`.kv_sharding` — page-level KV sharding's per-rank bytes (the upstream design it is compared with);
- :mod:`.modes`, :mod:`.capacity` — the per-rank KV budget and capacity of every layout (redundant CP,
  upstream SGLang's layer split, the plug-in, LayerSplit).
"""
