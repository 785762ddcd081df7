"""Control messages between a decode worker and its prefill ranks, with their SGLang counterparts.

``room`` identifies one incarnation of a request (SGLang's bootstrap room); a request id (``rid``)
may be reused by a retry, the room never is. ``token`` is drawn at random for each abort, so an ack
can only release the abort it answers.

Decode numbers the rooms it announces with increasing **epochs** and piggybacks, on every message to
a rank, that rank's **floor**: every epoch below it is closed (decode will never again wait on that
rank for it), so the rank may forget those rooms and must reject anything below the floor. Each
prefill process has an **incarnation** (bumped by a restart); a ``TransferRequest`` is addressed to
the incarnation decode resolved at bootstrap, and only that process may act on it.

The decode worker has incarnations too (its **life**, bumped by a restart): every message carries it.
A decode restart deregisters the old life's memory, so a write of the old life is refused where it
lands; prefill forgets the old life's rooms and its floor (the new life's epochs restart at 0) and
drops a message of an older life. Replies name their sender (``peer``, ``incarnation``); decode acts
on one only if the channel delivered it from that peer and that peer owns the request (see
``layersplit.pd.abort.decode_side``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferRequest:
    """decode -> prefill rank: write the layers you own of ``rid`` into these decode pages (SGLang: the decode
    receiver sends its KV indices to the prefill sender once bootstrapped). Re-sent as a status poll;
    it is idempotent."""

    rid: int
    room: int
    epoch: int
    incarnation: int  # the prefill process this is addressed to
    floor: int
    pages: tuple[int, ...]  # decode page of request page i
    generations: tuple[int, ...]  # the pages' allocation generations (carried for the invariant checker)
    decode_life: int = 0  # the decode process (its memory registration) the pages belong to


@dataclass(frozen=True)
class TransferStarted:
    """prefill -> decode: the first write was posted (decode moves to ``KVPoll.Transferring``)."""

    rid: int
    room: int
    peer: int
    incarnation: int = 0
    decode_life: int = 0


@dataclass(frozen=True)
class TransferDone:
    """prefill -> decode: all of this rank's writes landed and none will be posted again
    (``KVPoll.Success`` once every rank says so)."""

    rid: int
    room: int
    peer: int
    incarnation: int = 0
    decode_life: int = 0


@dataclass(frozen=True)
class TransferFailed:
    """prefill -> decode: a write reported an error (``KVPoll.Failed``); its data may still land."""

    rid: int
    room: int
    peer: int
    incarnation: int = 0
    decode_life: int = 0


@dataclass(frozen=True)
class Abort:
    """decode -> prefill rank: the abort notification; re-sent with backoff until acknowledged."""

    rid: int
    room: int
    token: int
    epoch: int
    floor: int
    decode_life: int = 0


@dataclass(frozen=True)
class AbortAck:
    """prefill -> decode: "safe to release" — this rank's writes for ``room`` never started or all
    landed, and none will be posted again (the room is tombstoned, or below the floor). A process
    answers only once every write of its previous lives has drained, so the ack covers the rank."""

    rid: int
    room: int
    token: int
    peer: int
    incarnation: int = 0
    decode_life: int = 0
