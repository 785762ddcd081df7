"""The engine's named choices, as plain tuples (no torch), so the command line can offer them
without importing the engine."""

MODES = ("redundant", "layersplit")  # CP KV pool layouts (:mod:`layersplit.engine.cp_pool`)
SPLITS = ("interleave", "zigzag")  # new-token split over ranks (:mod:`layersplit.engine.batch_plan`)
STRATEGIES = ("contiguous", "round-robin")  # layer ownership (:mod:`layersplit.plan.ownership`)
# CP comm schedule (:mod:`layersplit.engine.engine`): the KV broadcast on its own stream and communicator
# (``overlapped``) or every collective on one FIFO stream (``legacy``, the old order)
SCHEDULES = ("overlapped", "legacy")
# the CP engine's MLA cache rows (:mod:`dsa_kernels.layout`): bf16, or fp8 (e4m3 latent + fp32 tile scales +
# bf16 rope, as uint8 rows), in every pool, scratch slot, host tier and broadcast
ENGINE_KV_DTYPES = ("bf16", "fp8")
TIMEOUT_MAX_S = 7 * 24 * 3600  # a rank-process timeout above a week is a typo, not a plan (`prefill --timeout-s`)
