"""Capacity planning: model and hardware configs (:mod:`.config`) and the per-rank KV budget and
capacity of every layout (:mod:`.capacity`: redundant CP, upstream SGLang's layer split, the
plug-in, LayerSplit). Pure arithmetic over the YAML configs; no torch work."""
