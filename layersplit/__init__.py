"""LayerSplit context-parallel prefill for DSA models: capacity planning, ownership, configs."""
