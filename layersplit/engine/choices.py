"""The engine's named choices, as plain tuples (no torch), so the command line can offer them
without importing the engine."""

MODES = ("redundant", "layersplit")  # CP KV pool layouts (:mod:`layersplit.engine.cp_pool`)
SPLITS = ("interleave", "zigzag")  # new-token split over ranks (:mod:`layersplit.engine.batch_plan`)
STRATEGIES = ("contiguous", "round-robin")  # layer ownership (:mod:`layersplit.engine.ownership`)
