"""Control messages between a decode worker and its prefill peers, with their SGLang counterparts.

``room`` identifies one incarnation of a request (SGLang's bootstrap room); a request id (``rid``)
may be reused by a retry, the room never is. ``token`` is drawn at random for each abort, so an ack
can only release the abort it answers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferRequest:
    """decode -> prefill: write the KV of ``rid`` into these decode pages (SGLang: the decode
    receiver sends its KV indices to the prefill sender during bootstrap)."""

    rid: int
    room: int
    pages: tuple[int, ...]
    generations: tuple[int, ...]  # the pages' allocation generations (carried for the invariant checker)
    first_index: int = 0  # this peer writes request pages first_index, first_index + stride, ...
    stride: int = 1


@dataclass(frozen=True)
class TransferStarted:
    """prefill -> decode: the first write was posted (decode moves to ``KVPoll.Transferring``)."""

    rid: int
    room: int
    peer: int


@dataclass(frozen=True)
class TransferDone:
    """prefill -> decode: all of this peer's writes completed (``KVPoll.Success`` once every peer says so)."""

    rid: int
    room: int
    peer: int


@dataclass(frozen=True)
class TransferFailed:
    """prefill -> decode: a write reported an error (``KVPoll.Failed``); its data may still land."""

    rid: int
    room: int
    peer: int


@dataclass(frozen=True)
class Abort:
    """decode -> prefill: the abort notification; retried on a timer until acknowledged."""

    rid: int
    room: int
    token: int


@dataclass(frozen=True)
class AbortAck:
    """prefill -> decode: "safe to release" — this peer's writes for ``room`` never started or all
    completed, and none will be posted again (the room is tombstoned)."""

    rid: int
    room: int
    token: int
    peer: int
