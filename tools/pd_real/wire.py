"""The control frames the real pair sends over ZMQ: typed msgpack, never pickle.

A socket is reachable by any local process, so what arrives on one is data to check, never code to
run. Each frame is ``[VERSION byte] + msgpack([tag, src, dst, {field: value}])``:

* ``VERSION`` (one raw byte, checked before anything is parsed): 1;
* ``tag``: which message (:data:`TAGS`: 1-6 the protocol's, 16-17 the registry link's, 32 the probes');
* ``src`` / ``dst``: endpoint names, 1-64 characters of ``[A-Za-z0-9_.:-]``;
* the fields: a map holding exactly the dataclass's fields, every one (defaults are not applied on the
  wire), each ``int`` in ``[0, 2**63)`` (a bool is not an int) or a ``tuple`` of such ints
  (at most :data:`MAX_ITEMS`). No message carries a float, bool, str or enum field; a new kind needs a
  checker here.

:func:`decode` refuses anything else — another version, an unknown tag, missing / extra / repeated
fields, a wrong type, an ext type, trailing bytes, a frame over :data:`MAX_FRAME_BYTES` — with
:class:`WireError`, the only error it raises. :func:`encode` checks the same, so a frame it makes is one
``decode`` takes. The format lives here, not in ``layersplit.pd.abort``: the product never opens a
socket (its nodes take a :class:`~layersplit.pd.abort.channel.Channel`), and the registry link's and
the probes' messages are this tool's own.
"""

from __future__ import annotations

import dataclasses
import re

import msgpack

from layersplit.pd.abort.messages import Abort, AbortAck, TransferDone, TransferFailed, TransferRequest, TransferStarted
from tools.pd_real.registry_link import Heartbeat, Revoked
from tools.pd_real.zmq_order import Seq

VERSION = 1
MAX_FRAME_BYTES = 1 << 20
MAX_ITEMS = 1 << 14  # pages of one TransferRequest
MAX_INT = (1 << 63) - 1
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
INT, INTS = "int", "ints"  # field kinds: a non-negative int64, a tuple of them

TAGS: dict[int, type] = {1: TransferRequest, 2: TransferStarted, 3: TransferDone, 4: TransferFailed, 5: Abort,
                         6: AbortAck, 16: Heartbeat, 17: Revoked, 32: Seq}
KINDS: dict[type, dict[str, str]] = {  # field -> kind, in the dataclass's order
    TransferRequest: {"rid": INT, "room": INT, "epoch": INT, "incarnation": INT, "floor": INT, "pages": INTS,
                      "generations": INTS, "decode_life": INT},
    **{cls: {"rid": INT, "room": INT, "peer": INT, "incarnation": INT, "decode_life": INT}
       for cls in (TransferStarted, TransferDone, TransferFailed)},
    Abort: {"rid": INT, "room": INT, "token": INT, "epoch": INT, "floor": INT, "decode_life": INT},
    AbortAck: {"rid": INT, "room": INT, "token": INT, "peer": INT, "incarnation": INT, "decode_life": INT},
    Heartbeat: {"rank": INT, "incarnation": INT},
    Revoked: {"rank": INT, "incarnation": INT},
    Seq: {"incarnation": INT, "seq": INT},
}
TAG_OF = {cls: tag for tag, cls in TAGS.items()}
WIRE_TYPES = tuple(TAGS.values())
for _cls, _kinds in KINDS.items():  # a dataclass that gained or lost a field must be reviewed here
    assert list(_kinds) == [f.name for f in dataclasses.fields(_cls)], f"{_cls.__name__}: wire fields drifted"
assert set(KINDS) == set(TAG_OF), "every wire type has a tag and a field table"


class WireError(ValueError):
    """A frame (or a message to frame) that is not one of :data:`TAGS`, exactly as specified."""


def encode(src: str, dst: str, msg: object) -> bytes:
    """The frame of ``msg`` from endpoint ``src`` to ``dst``; raises :class:`WireError` for a message
    ``decode`` would refuse (another type, a negative or non-int field, an oversized frame)."""
    cls = type(msg)
    if cls not in TAG_OF:
        raise WireError(f"msg: expected one of {', '.join(c.__name__ for c in WIRE_TYPES)}, got {cls.__name__}")
    _name("src", src), _name("dst", dst)
    fields = {name: _check(f"{cls.__name__}.{name}", kind, getattr(msg, name)) for name, kind in KINDS[cls].items()}
    frame = bytes([VERSION]) + msgpack.packb([TAG_OF[cls], src, dst, fields], use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame: expected at most {MAX_FRAME_BYTES} bytes, got {len(frame)}")
    return frame


def decode(frame: bytes) -> tuple[str, str, object]:
    """``(src, dst, msg)`` of one frame; :class:`WireError` for anything but a frame :func:`encode` makes.
    Nothing in the frame names code: tags map to this module's table, fields are plain ints."""
    body = _unpack(frame)
    if type(body) is not list or len(body) != 4:
        raise WireError(f"frame: expected [tag, src, dst, fields], got {_what(body)}")
    tag, src, dst, fields = body
    if type(tag) is not int or tag not in TAGS:
        raise WireError(f"tag: expected one of {sorted(TAGS)}, got {tag!r}")
    cls, kinds = TAGS[tag], KINDS[TAGS[tag]]
    if type(fields) is not dict or fields.keys() != kinds.keys():
        got = sorted(fields) if type(fields) is dict else _what(fields)
        raise WireError(f"{cls.__name__} fields: expected {sorted(kinds)}, got {got}")
    values = {name: _check(f"{cls.__name__}.{name}", kind, fields[name]) for name, kind in kinds.items()}
    return _name("src", src), _name("dst", dst), cls(**values)


def _unpack(frame: bytes) -> object:
    if not isinstance(frame, bytes):
        raise WireError(f"frame: expected bytes, got {type(frame).__name__}")
    if not 1 < len(frame) <= MAX_FRAME_BYTES:
        raise WireError(f"frame: expected 2 to {MAX_FRAME_BYTES} bytes, got {len(frame)}")
    if frame[0] != VERSION:
        raise WireError(f"version: expected {VERSION}, got {frame[0]}")
    try:  # limits bound what a hostile length prefix can make the unpacker allocate
        return msgpack.unpackb(frame[1:], raw=False, strict_map_key=True, object_pairs_hook=_fields,
                               max_str_len=64, max_bin_len=0, max_ext_len=0, max_array_len=MAX_ITEMS,
                               max_map_len=16)
    except WireError:
        raise
    except (ValueError, TypeError) as exc:  # msgpack's errors (truncated, extra data, limits) are ValueErrors
        raise WireError(f"frame: expected one msgpack value, got {type(exc).__name__}: {exc}") from None


def _fields(pairs: list[tuple]) -> dict:
    """A msgpack map as a dict; a repeated key would silently keep the last value, so it is refused."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise WireError(f"fields: expected distinct names, got {[k for k, _ in pairs]}")
    return out


def _check(field: str, kind: str, value: object) -> object:
    if kind == INT:
        return _int(field, value)
    assert kind == INTS, kind
    if type(value) not in (list, tuple) or len(value) > MAX_ITEMS:
        raise WireError(f"{field}: expected a tuple of at most {MAX_ITEMS} ints, got {_what(value)}")
    return tuple(_int(f"{field}[{i}]", v) for i, v in enumerate(value))


def _int(field: str, value: object) -> int:
    if type(value) is not int or not 0 <= value <= MAX_INT:  # type(): a bool is an int subclass
        raise WireError(f"{field}: expected an int in [0, 2**63), got {_what(value)}")
    return value


def _name(field: str, value: object) -> str:
    if type(value) is not str or not NAME.fullmatch(value):
        raise WireError(f"{field}: expected an endpoint name of 1-64 [A-Za-z0-9_.:-], got {_what(value)}")
    return value


def _what(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"
