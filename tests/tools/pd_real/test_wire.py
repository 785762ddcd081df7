"""The control frames' wire format: every message type round-trips; anything else — random bytes, a
truncated frame, another version, an unknown tag, missing / extra / repeated fields, a wrong type, a
pickle that would run code — is refused with WireError and never executed. Over a real ZmqChannel and
the fault proxy, such frames between valid messages are counted and dropped while the valid ones
arrive in order."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import socket
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import layersplit.pd.abort.messages as messages
from layersplit.pd.abort.messages import Abort, AbortAck, TransferDone, TransferRequest
from tools.pd_real import wire
from tools.pd_real.proxy import FaultProxy
from tools.pd_real.registry_link import Heartbeat
from tools.pd_real.zmq_channel import ZmqChannel
from tools.pd_real.zmq_order import Seq

pytestmark = pytest.mark.timeout(60)
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=150)
INTS = st.integers(0, wire.MAX_INT)
NAMES = st.from_regex(wire.NAME, fullmatch=True)


class Armed:
    """A pickle that creates ``marker`` (a directory) when unpickled: it must never be."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _message(cls: type) -> st.SearchStrategy:
    fields = {name: INTS if kind == wire.INT else st.lists(INTS, max_size=40).map(tuple)
              for name, kind in wire.KINDS[cls].items()}
    return st.builds(cls, **fields)


MESSAGES = st.one_of(*(_message(cls) for cls in wire.WIRE_TYPES))


def _frame(body, version: int = wire.VERSION) -> bytes:
    return bytes([version]) + msgpack.packb(body, use_bin_type=True)


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


SAMPLES = [TransferRequest(7, room=1000, epoch=3, incarnation=1, floor=2, pages=(4, 5), generations=(9, 10),
                           decode_life=1), TransferDone(7, room=1000, peer=0, incarnation=1, decode_life=1),
           Abort(7, room=1000, token=2**62, epoch=3, floor=2), AbortAck(7, 1000, token=5, peer=1),
           Heartbeat(rank=0, incarnation=2), Seq(1, 0)]


# round trips -------------------------------------------------------------------------------------------
def test_every_protocol_message_has_a_tag():
    defined = {v for v in vars(messages).values() if dataclasses.is_dataclass(v) and v.__module__ == messages.__name__}
    assert defined and defined <= set(wire.WIRE_TYPES)
    assert len(set(wire.TAGS)) == len(wire.WIRE_TYPES)


@FUZZ
@given(src=NAMES, dst=NAMES, msg=MESSAGES)
def test_every_message_type_round_trips(src, dst, msg):
    frame = wire.encode(src, dst, msg)
    assert frame[0] == wire.VERSION and wire.decode(frame) == (src, dst, msg)


@pytest.mark.parametrize("pages", [0, 1, wire.MAX_ITEMS], ids=lambda n: f"{n}-pages")
def test_tuple_sizes_up_to_the_bound_round_trip(pages):
    msg = TransferRequest(1, 2, 3, 4, 5, tuple(range(pages)), (wire.MAX_INT,) * pages)
    assert wire.decode(wire.encode("decode", "prefill0", msg))[2] == msg


@pytest.mark.parametrize("msg, match", [
    (None, "msg: expected one of"), ((1, 2), "msg: expected one of"), (7, "got int"),
    (TransferDone(-1, 2, 0), r"TransferDone.rid: expected an int in \[0, 2\*\*63\), got int -1"),
    (TransferDone(2**63, 2, 0), "TransferDone.rid"), (TransferDone(True, 2, 0), "got bool"),
    (TransferRequest(1, 2, 3, 4, 5, [1], (0,)), None),  # a list of ints is sent as a tuple
    (TransferRequest(1, 2, 3, 4, 5, (1, "2"), (0,)), r"TransferRequest.pages\[1\]: expected an int"),
    (TransferRequest(1, 2, 3, 4, 5, (0,) * (wire.MAX_ITEMS + 1), ()), "at most 16384 ints"),
], ids=["none", "tuple", "int", "negative", "too-big", "bool", "list-ok", "str-item", "too-many"])
def test_encode_refuses_what_decode_would(msg, match):
    if match is None:
        assert wire.decode(wire.encode("a", "b", msg))[2].pages == (1,)
        return
    with pytest.raises(wire.WireError, match=match):
        wire.encode("decode", "prefill0", msg)


@pytest.mark.parametrize("src", ["", "x" * 65, "a b", "é", 3], ids=["empty", "65-chars", "space", "non-ascii", "int"])
def test_endpoint_names_are_bounded(src):
    with pytest.raises(wire.WireError, match="src: expected an endpoint name"):
        wire.encode(src, "decode", Seq(1, 2))
    with pytest.raises(wire.WireError):
        wire.decode(_frame([32, src, "decode", {"incarnation": 1, "seq": 2}]))


# refusals ------------------------------------------------------------------------------------------------
def _rejected(frame) -> wire.WireError:
    with pytest.raises(wire.WireError) as err:
        wire.decode(frame)
    return err.value


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_are_refused_or_are_a_wire_message(data):
    try:
        src, dst, msg = wire.decode(data)
    except wire.WireError:
        return
    assert type(src) is str and type(dst) is str and type(msg) in wire.WIRE_TYPES  # never anything else


@FUZZ
@given(msg=MESSAGES, data=st.data())
def test_mutated_frames_are_refused_or_are_a_wire_message(msg, data):
    frame = bytearray(wire.encode("decode", "prefill0", msg))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    try:
        out = wire.decode(bytes(frame))
    except wire.WireError:
        return
    assert type(out[2]) in wire.WIRE_TYPES


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncation_of_a_valid_frame_is_refused(msg):
    frame = wire.encode("decode", "prefill0", msg)
    for cut in range(len(frame)):
        _rejected(frame[:cut])


@pytest.mark.parametrize("version", [0, 2, 0x80, 255])
def test_another_version_is_refused_before_parsing(version):
    frame = wire.encode("decode", "prefill0", SAMPLES[0])
    assert "version: expected 1, got" in str(_rejected(bytes([version]) + frame[1:]))


@pytest.mark.parametrize("tag", [0, 7, 33, 2**40, -1, True, 1.0, "TransferDone", None, [1]])
def test_an_unknown_tag_is_refused(tag):
    assert "tag: expected one of" in str(_rejected(_frame([tag, "decode", "prefill0", {"rid": 1}])))


def _body(msg) -> list:
    return [wire.TAG_OF[type(msg)], "decode", "prefill0", _fields(msg)]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_missing_extra_and_repeated_fields_are_refused(msg):
    tag, src, dst, fields = _body(msg)
    first = next(iter(fields))
    missing = {k: v for k, v in fields.items() if k != first}
    assert "fields: expected" in str(_rejected(_frame([tag, src, dst, missing])))
    assert "fields: expected" in str(_rejected(_frame([tag, src, dst, {**fields, "extra": 1}])))
    # a dict cannot repeat a key, so this body is packed by hand: array of 4, tag, src, dst, the map
    head = bytes([wire.VERSION, 0x94]) + b"".join(msgpack.packb(x) for x in (tag, src, dst))
    repeated = msgpack.Packer().pack_map_pairs([*fields.items(), (first, fields[first])])
    assert "distinct names" in str(_rejected(head + repeated))


BAD_INT = [-1, 2**63, 2**64 - 1, 1.0, True, False, None, "1", b"1", [], {}, msgpack.ExtType(1, b"x")]
BAD_INTS = [5, "12", None, {}, [1.0], [True], [-1], [[1]], [2**63], b"\x01"]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_field_of_a_wrong_type_is_refused(msg):
    tag, src, dst, fields = _body(msg)
    for name, kind in wire.KINDS[type(msg)].items():
        for bad in BAD_INT if kind == wire.INT else BAD_INTS:
            err = _rejected(_frame([tag, src, dst, {**fields, name: bad}]))
            assert name in str(err) or "frame:" in str(err), (name, bad, err)


@pytest.mark.parametrize("body", [
    "text", 5, {"tag": 1}, [1, "decode", "prefill0"], [1, "decode", "prefill0", {}, 0],
    [1, "decode", "prefill0", [1, 2, 3]], [3, b"decode", "prefill0", {}], [3, "decode", "p" * 65, {}],
    [32, "a", "b", {"incarnation": 1, "seq": msgpack.Timestamp(1, 0)}],
], ids=["str", "int", "map", "three", "five", "fields-list", "bytes-src", "long-dst", "timestamp"])
def test_bodies_of_the_wrong_shape_are_refused(body):
    _rejected(_frame(body))


@pytest.mark.parametrize("frame", [b"", b"\x01", "text", bytearray(b"\x01\x90"), None,
                                   b"\x01" + b"\x00" * wire.MAX_FRAME_BYTES, _frame(list(range(4))) + b"\x00",
                                   b"\x01\xdd\xff\xff\xff\xff"],
                         ids=["empty", "version-only", "str", "bytearray", "none", "oversized", "trailing",
                              "huge-array-header"])
def test_frames_out_of_bounds_are_refused(frame):
    _rejected(frame)


def _armed_payloads(marker) -> list[bytes]:
    bomb = Armed(marker)
    return [*(pickle.dumps(bomb, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)),
            pickle.dumps(("prefill0", "decode", bomb)),  # the old frame: (src, dst, msg) pickled
            bytes([wire.VERSION]) + pickle.dumps(bomb),
            _frame([3, "prefill0", "decode", {"rid": msgpack.ExtType(1, pickle.dumps(bomb))}])]


def test_a_pickle_that_runs_code_is_refused_and_never_run(tmp_path):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Armed(control)))  # noqa: S301 - proves the payload is armed
    assert control.is_dir()
    marker = tmp_path / "marker"
    for payload in _armed_payloads(marker):
        _rejected(payload)
    assert not marker.exists()


# over real sockets ---------------------------------------------------------------------------------------
def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _garbage(rng: random.Random, marker) -> list[list[bytes]]:
    """Seeded frames a stranger might send, each one ZMQ message (a list of parts)."""
    valid = wire.encode("prefill0", "decode", TransferDone(1, 2, peer=0))
    frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(10)]
    frames += [valid[:rng.randint(0, len(valid) - 1)] for _ in range(5)]
    frames += [b"\x02" + valid[1:], _frame([99, "prefill0", "decode", {}]), *_armed_payloads(marker)]
    return [[f] for f in frames] + [[valid, valid], [b"", valid]]  # and two multipart messages


def _pump_until(channel, done, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        channel.pump(0.02)


def test_garbage_between_valid_messages_is_counted_and_dropped_in_order(tmp_path):
    import zmq

    rng, marker = random.Random(44), tmp_path / "marker"
    addresses = {"decode": _address(), "prefill0": _address()}
    d, p = ZmqChannel(addresses, addresses["decode"]), ZmqChannel(addresses, addresses["prefill0"])
    got, asked = [], []
    d.register("decode", lambda msg, src: got.append((src, msg)), accepts=(TransferDone,), senders=["prefill0"])
    p.register("prefill0", lambda msg, src: asked.append(msg), accepts=(TransferRequest,))
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(addresses["decode"])
    garbage, sent = _garbage(rng, marker), []
    try:
        for i, parts in enumerate(garbage):  # one connection: ZMQ keeps this interleaving
            stranger.send_multipart(parts)
            sent.append(TransferDone(i, room=100 + i, peer=0))
            stranger.send(wire.encode("prefill0", "decode", sent[-1]))
        _pump_until(d, lambda: len(got) == len(sent))
        d.send("decode", "prefill0", TransferRequest(1, 2, 3, 4, 5, (6,), (7,)))  # the loop is still live
        _pump_until(p, lambda: asked)
    finally:
        stranger.close(), d.close(), p.close()
    assert got == [("prefill0", m) for m in sent]
    assert d.stats["malformed_frames"] == len(garbage) and d.stats["refused_frames"] == 0
    assert d.stats["delivered"] == len(sent) and asked == [TransferRequest(1, 2, 3, 4, 5, (6,), (7,))]
    assert not marker.exists()


def test_well_formed_frames_no_endpoint_takes_are_refused():
    import zmq

    addresses = {"decode": _address(), "prefill0": _address()}
    d = ZmqChannel(addresses, addresses["decode"])
    got = []
    d.register("decode", lambda msg, src: got.append(msg), accepts=(TransferDone,), senders=["prefill0"])
    stranger = zmq.Context.instance().socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(addresses["decode"])
    done = TransferDone(1, 2, peer=0)
    refused = [("prefill0", "nobody", done), ("prefill0", "prefill0", done),  # no such endpoint here
               ("stranger", "decode", done), ("decode", "decode", done),  # not a sender decode takes
               ("prefill0", "decode", Heartbeat(0, 1))]  # not a type decode takes
    try:
        for src, dst, msg in [*refused, ("prefill0", "decode", done)]:
            stranger.send(wire.encode(src, dst, msg))
        _pump_until(d, lambda: got)
        d.pump(0.1)
    finally:
        stranger.close(), d.close()
    assert got == [done] and d.stats["refused_frames"] == len(refused) and d.stats["malformed_frames"] == 0


def test_a_heartbeat_is_taken_only_for_the_rank_whose_endpoint_sent_it():
    """Well-formed is not well-meant: a heartbeat naming another rank, or none of the registry's, is
    ignored (counted), never an IndexError in decode's loop."""
    from types import SimpleNamespace

    from layersplit.pd.abort.bootstrap import BootstrapRegistry
    from tools.pd_real.registry_link import RegistryServer

    registry, sent = BootstrapRegistry(2), []
    server = RegistryServer(SimpleNamespace(now=0.0, after=lambda *a: None), registry, None, 1.0,
                            lambda rank, msg: sent.append(msg))
    server.handle(Heartbeat(5, 0), "prefill0")
    server.handle(Heartbeat(1, 0), "prefill0")
    assert server.stats["misaddressed"] == 2 and registry.serving(1) is None
    server.handle(Heartbeat(0, 0), "prefill0")
    assert registry.serving(0) == 0 and server.stats["admissions"] == 1 and not sent


def test_send_refuses_a_message_the_wire_cannot_carry():
    addresses = {"decode": _address(), "prefill0": "tcp://127.0.0.1:1"}
    d = ZmqChannel(addresses, addresses["decode"])
    try:
        with pytest.raises(wire.WireError, match="msg: expected one of"):
            d.send("decode", "prefill0", (1, 2))
        with pytest.raises(ValueError, match="accepts: expected wire types"):
            d.register("decode", print, accepts=(tuple,))
    finally:
        d.close()
    assert d.stats["sent"] == 0


def test_the_proxy_drops_garbage_and_forwards_the_valid_frames_in_order(tmp_path):
    import zmq

    marker = tmp_path / "marker"
    recv, via = _address(), _address()
    r = ZmqChannel({"recv": recv, "send": via}, recv)
    got = []
    r.register("recv", lambda msg, src: got.append(msg), accepts=(Seq,))
    garbage = _garbage(random.Random(45), marker)
    sender = zmq.Context.instance().socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    try:
        with FaultProxy({via: recv}) as proxy:
            sender.connect(via)
            for i, parts in enumerate(garbage):
                sender.send_multipart(parts)
                sender.send(wire.encode("send", "recv", Seq(1, i)))
            _pump_until(r, lambda: len(got) == len(garbage))
    finally:
        sender.close(), r.close()
    assert got == [Seq(1, i) for i in range(len(garbage))]
    assert proxy.stats["malformed_frames"] == len(garbage) and proxy.stats["forwarded"] == len(garbage)
    assert r.stats["malformed_frames"] == 0 and not marker.exists()
