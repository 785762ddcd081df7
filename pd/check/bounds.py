"""The bounds of one model-checking run: the world's size, the fault budget, and the safety limits."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pd.guards import check_names


@dataclass(frozen=True)
class CheckBounds:
    """prefill_ranks: LayerSplit prefill CP ranks (one layer each); requests: request ids submitted at
    the start; pages: decode pages per request (the pool holds requests x pages, so a retry reuses
    pages); retries: router retries per aborted request (same rid, new room: the reused request id);
    faults: budget of drop / duplicate / reorder of a control message, a failed write batch, a prefill
    crash (its restart then always follows); cancels: client aborts, at any moment; abort_sends: decode's
    abort re-send bound before quarantine; polls: times decode's poll timer (re-send TransferRequest)
    may fire per room; channel_capacity: messages in flight per endpoint pair
    (executions beyond it are not explored). max_states / timeout_s stop the run early (``complete``
    is then false). ``legacy`` and ``guards_off``: the UNSAFE protocol variants (see ``pd.guards``)."""

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
    guards_off: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, low in (("prefill_ranks", 1), ("requests", 1), ("faults", 0), ("pages", 1), ("retries", 0),
                          ("cancels", 0), ("abort_sends", 1), ("polls", 0), ("channel_capacity", 1), ("max_states", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected seconds > 0, got {self.timeout_s!r}")
        object.__setattr__(self, "guards_off", check_names(tuple(self.guards_off)))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["guards_off"] = list(self.guards_off)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CheckBounds":
        return cls(**{**d, "guards_off": tuple(d.get("guards_off", ()))})
