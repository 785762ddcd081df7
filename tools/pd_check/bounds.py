"""The bounds of one model-checking run: the world's size, the fault budget, and the safety limits."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from layersplit.pd.abort.guards import check_names

FAULT_KINDS = ("drop", "duplicate", "reorder", "crash", "fail", "kill", "decode_restart", "misaddress", "partition",
               "lease_loss")


@dataclass(frozen=True)
class CheckBounds:
    """prefill_ranks: LayerSplit prefill CP ranks (one layer each); requests: request ids submitted at
    the start; pages: decode pages per request (the pool holds requests x pages, so a retry reuses
    pages); retries: router retries per aborted request (same rid, new room: the reused request id);
    faults: budget of drop / duplicate / reorder / misaddress of a control message, a failed write
    batch, a prefill crash (its restart then always follows) or kill (for good: decode fences it), a
    decode restart, a partition of a rank's control link (its heal then always follows), a live rank's
    lease lost (a false suspicion: decode may fence a running writer; its heartbeat's return then always
    follows); fault_kinds:
    which of those the budget may be spent on (all by default); cancels: client aborts, at any moment; abort_sends: decode's
    abort re-send bound before quarantine; polls: times decode's poll timer (re-send TransferRequest)
    may fire per room; channel_capacity: messages in flight per endpoint pair
    (executions beyond it are not explored). max_states / timeout_s stop the run early (``complete``
    is then false). ``fence_unreachable``: decode's ``fence_unreachable_s`` policy on (its timer may
    fire at any moment).
    ``legacy`` and ``guards_off``: the UNSAFE protocol variants (see ``layersplit.pd.abort.guards``).
    ``symmetry`` / ``stale_events`` / ``por``: the reductions (all off: the exhaustive cross-check);
    ``max_depth``: explore no deeper (what a re-run for the shortest counterexample uses; None: no limit)."""

    prefill_ranks: int = 2
    requests: int = 2
    faults: int = 2
    pages: int = 1
    retries: int = 1
    cancels: int = 1
    abort_sends: int = 2
    polls: int = 1
    channel_capacity: int = 2
    max_states: int = 2_000_000
    timeout_s: float = 600.0
    legacy: bool = False
    fence_unreachable: bool = False  # decode may fence a lease-holding rank it hears nothing from (at any moment)
    guards_off: tuple[str, ...] = ()
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    symmetry: bool = True  # merge states equal up to a renaming of prefill ranks and of request ids
    stale_events: bool = True  # neither fire nor hash pending events that can change nothing (tools.pd_check.stale)
    por: bool = True  # partial-order reduction: persistent sets (tools.pd_check.por)
    max_depth: int | None = None

    def __post_init__(self) -> None:
        for name, low in (("prefill_ranks", 1), ("requests", 1), ("faults", 0), ("pages", 1), ("retries", 0),
                          ("cancels", 0), ("abort_sends", 1), ("polls", 0), ("channel_capacity", 1), ("max_states", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if self.max_depth is not None and (not isinstance(self.max_depth, int) or isinstance(self.max_depth, bool)
                                           or self.max_depth < 0):
            raise ValueError(f"max_depth: expected an integer >= 0 or None, got {self.max_depth!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected seconds > 0, got {self.timeout_s!r}")
        object.__setattr__(self, "guards_off", check_names(tuple(self.guards_off)))
        kinds = tuple(self.fault_kinds)
        for kind in kinds:
            if kind not in FAULT_KINDS:
                raise ValueError(f"fault_kinds: expected some of {', '.join(FAULT_KINDS)}, got {kind!r}")
        object.__setattr__(self, "fault_kinds", kinds)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["guards_off"] = list(self.guards_off)
        d["fault_kinds"] = list(self.fault_kinds)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CheckBounds":
        return cls(**{**d, "guards_off": tuple(d.get("guards_off", ())),
                      "fault_kinds": tuple(d.get("fault_kinds", FAULT_KINDS))})
