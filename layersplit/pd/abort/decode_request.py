"""The decode worker's configuration and its per-request state (see :mod:`layersplit.pd.abort.decode_side`).

What an operator configures, and the bounds it gives:

* ``abort_backoff``: abort re-sends, capped at ``max_s`` (1 s). Past ``max_sends`` the request is
  **quarantined** (counted, logged once) but the re-sends go on at the cap while the rank is registered,
  pause while its lease is expired, and resume at once when it registers again: after a partition or a
  restart heals, the pages are released within ``max_s`` + one round trip + the writes still draining.
* ``fence_after_s``: a rank whose lease expired and that stayed down this long is fenced (its
  writes refused) and its pages released. Pages held for a dead rank: at most those announced to it
  in ``lease_s`` + ``fence_after_s`` (and never more than the pool). ``None``: never fence.
* ``fence_unreachable_s``: a rank that *holds its lease* (the bootstrap server hears it) but has left an
  abort unacknowledged this long and sent decode **nothing at all** meanwhile (decode's control link to
  it is cut: a partition; a rank that is only slow to drain its writes still answers other rooms) is
  fenced as if it were dead: its registration is torn down (its writes refused from then on), what waited
  on it is released, and the process, told *revoked* at its next heartbeat, exits and comes back as a
  new incarnation. Each abort is then held at most about this long; the pages held at a time are at
  most those announced to the rank in ``wait_timeout_s`` + ``fence_unreachable_s`` (again per new
  incarnation while the link stays cut), instead of up to the whole pool until the heal. The price: a
  link outage longer than this restarts a live prefill process (the real pair's exits and is started
  again by its supervisor; a server that reloads its model on restart pays that). ``None`` (the
  default): hold the pages until the link heals.
* ``queue_timeout_s``: a request waiting for pages is aborted after this (``wait_timeout_s`` counts
  from its page allocation, as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layersplit.pd.abort.backoff import AbortBackoff
from layersplit.pd.abort.transfer_engine import WriteTag

BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS, FAILED = (
    "Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed")
LIVE = (BOOTSTRAPPING, WAITING, TRANSFERRING)


@dataclass(frozen=True)
class DecodeConfig:
    num_pages: int = 512
    wait_timeout_s: float = 1.0  # from page allocation: the KV must arrive within this, else abort
    queue_timeout_s: float | None = 30.0  # from submission, while waiting for pages (None: wait for ever)
    bootstrap_s: float = 0.01  # one bootstrap-server lookup
    poll_s: float = 0.15  # re-send TransferRequest to ranks not done; re-try a lookup while a rank is down
    decode_s: float = 0.3  # how long a successful request decodes before freeing its pages
    abort_backoff: AbortBackoff = AbortBackoff()
    fence_after_s: float | None = 30.0  # lease expired and still down this long: fence the rank, release
    fence_unreachable_s: float | None = None  # abort unacked this long by a rank holding its lease: fence it
    legacy_immediate_release: bool = False  # UNSAFE: free pages at abort time (the old race)
    unsafe_free_at_bound: bool = False  # UNSAFE: free when the abort re-sends give up (a write may still land)
    unsafe_terminal_quarantine: bool = False  # UNSAFE (liveness): re-sends stop at quarantine, for ever

    def __post_init__(self) -> None:
        for name in ("queue_timeout_s", "fence_after_s", "fence_unreachable_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: expected seconds > 0 (or None: never), got {value!r}")


@dataclass(eq=False)
class DecodeRequest:
    rid: int
    room: int
    n_pages: int
    state: str = BOOTSTRAPPING
    pages: list[int] = field(default_factory=list)
    tags: tuple[WriteTag, ...] = ()  # the pages' owner tags: what release frees them as
    epoch: int = -1
    incarnations: tuple[int, ...] = ()  # per rank: the process its TransferRequest is addressed to
    told: frozenset[int] = frozenset()  # ranks that were given the page indices
    done_peers: set[int] = field(default_factory=set)
    open_ranks: set[int] = field(default_factory=set)  # ranks whose epoch is still open (see layersplit.pd.abort.watermark)
    abort_reason: str | None = None
    abort_token: int | None = None
    unacked: set[int] = field(default_factory=set)
    aborted_at: float = 0.0
    sends: int = 0  # abort sends so far
    quarantined: bool = False
    resend_armed: bool = False  # an abort re-send timer is pending
    heard: tuple[int, ...] = ()  # decode's per-rank message counts when the unreachable timer was armed
