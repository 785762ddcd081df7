"""The guards of the abort safe-release hardening (issue 15), by name, each switchable off — UNSAFE,
to show that the checks catch the race the guard closes (``tools.pd_check`` finds a counterexample with any
one of them off; the regression tests replay those).

A guard is either a method of the protocol whose unsafe replacement is swapped in for the duration of
:func:`guards_off` (process-wide, like a test's monkeypatch), or a ``DecodeConfig`` flag. The legacy
immediate release (``legacy_immediate_release``) is the pre-hardening protocol as a whole, not one guard.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from layersplit.pd.abort.decode_kv import DecodeKV
from layersplit.pd.abort.decode_side import DecodeConfig, DecodeNode
from layersplit.pd.abort.pages import TaggedPages
from layersplit.pd.abort.prefill_side import PrefillNode
from layersplit.pd.abort.room_book import RoomBook
from layersplit.pd.abort.transfer_engine import TransferEngine


@dataclass(frozen=True)
class Guard:
    name: str
    closes: str  # the race or leak it prevents, one line
    owner: type | None = None  # the class whose method is the guard ...
    method: str = ""
    unsafe: Callable | None = None  # ... and what replaces it when the guard is off
    decode_flag: str = ""  # or the DecodeConfig flag that switches it off


GUARDS: dict[str, Guard] = {g.name: g for g in (
    Guard("idempotent-abort", "a second abort (client + router, or after success/release) frees pages again",
          DecodeNode, "_abortable", lambda self, req: True),
    Guard("release-unannounced-at-once", "an abort waits for acks from ranks never told the pages (quarantine "
          "for nothing when a rank is down)",
          DecodeNode, "_must_ack", lambda self, req: set(self.topology.ranks) - req.done_peers),
    Guard("fan-in-every-rank", "release after the first rank's ack while another rank still writes",
          DecodeNode, "_must_ack", lambda self, req: set(sorted(req.told - req.done_peers)[:1])),
    Guard("quarantine-at-bound", "free the pages when the abort re-sends give up (upstream's timeout path)",
          decode_flag="unsafe_free_at_bound"),
    Guard("floor-rejects-late", "a late duplicate of a pruned room is accepted and written again",
          RoomBook, "below_floor", lambda self, epoch: False),
    Guard("prune-below-floor", "prefill records and tombstones are never forgotten (state grows with the run)",
          RoomBook, "advance", lambda self, floor: None),
    Guard("incarnation-address", "a restarted process acts on a request meant for its previous life",
          PrefillNode, "_addressed_here", lambda self, msg: True),
    Guard("restart-drains-first", "a restarted process vouches (acks) while its previous life's writes still land",
          PrefillNode, "_await_old_writes", lambda self, incarnation: self._serve(incarnation)),
    Guard("sources-held-until-drained", "prefill frees a source page while a posted write still reads it",
          PrefillNode, "_sources_drained", lambda self, req: not req.computing),
    Guard("free-by-owner-only", "a stale free releases a page that another (room, generation) owns now",
          TaggedPages, "_owns", lambda self, page, tag: self.owner[page] is not None),
    # issue 25: liveness, fencing, decode identity, membership
    Guard("quarantine-heals", "quarantine is terminal: re-sends stop for good, the pages are held for ever",
          decode_flag="unsafe_terminal_quarantine"),
    Guard("fence-refuses-writes", "a fenced (dead) process's write still in flight lands on released pages",
          TransferEngine, "_refuses", lambda self, owner: False),
    Guard("decode-life-fence", "an old decode life's write in flight lands on the new life's pages",
          DecodeKV, "accepts", lambda self, tag: True),
    Guard("floor-per-decode-life", "prefill keeps the old decode life's floor: the new life's requests are "
          "rejected as late", PrefillNode, "_reset_book", lambda self: None),
    Guard("owners-only", "success counts TransferDone reports instead of checking every owner sent one",
          DecodeNode, "_record_done", lambda self, req, msg: _done_by_count(self, req, msg)),
    Guard("reply-from-its-peer", "a reply naming another peer than the one it came from is believed",
          DecodeNode, "_from_peer", lambda self, msg, src: True),
)}


def _done_by_count(node: DecodeNode, req, msg) -> bool:
    """UNSAFE (issue 15's fan-in): any report counts, success when there are as many as ranks told."""
    req.done_peers.add(msg.peer)
    node._close(req, msg.peer)
    return len(req.done_peers) >= len(req.told)


def check_names(names) -> tuple[str, ...]:
    """``names`` validated against :data:`GUARDS` (a ValueError names the unknown one)."""
    for name in names:
        if name not in GUARDS:
            raise ValueError(f"guard: expected one of {', '.join(GUARDS)}, got {name!r}")
    return tuple(names)


def decode_config_off(cfg: DecodeConfig, names) -> DecodeConfig:
    """``cfg`` with the DecodeConfig-flag guards among ``names`` switched off."""
    flags = {GUARDS[n].decode_flag: True for n in check_names(names) if GUARDS[n].decode_flag}
    return replace(cfg, **flags) if flags else cfg


@contextlib.contextmanager
def guards_off(names) -> Iterator[None]:
    """UNSAFE: swap in the unsafe replacement of each method guard in ``names`` while the block runs."""
    saved = []
    try:
        for name in check_names(names):
            g = GUARDS[name]
            if g.owner is not None:
                saved.append((g.owner, g.method, g.owner.__dict__[g.method]))
                setattr(g.owner, g.method, g.unsafe)
        yield
    finally:
        for owner, method, original in reversed(saved):
            setattr(owner, method, original)
