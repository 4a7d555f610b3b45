"""The page protocol codec: round trips, framing at every split, limits, garbage and fuzz."""

from __future__ import annotations

import os
import struct

import pytest
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import NEED_DATA, Decoder
from duvm.wire.pageencode import encode, encode_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def requests() -> list[pp.Request]:
    data = os.urandom(3 * pp.PAGE_SIZE)
    return [
        pp.Hello(1, "node-a/nbd0/1732900000"),
        pp.Hello(2, "ü" * 100, 1, 7),
        pp.Reserve(3, 12345),
        pp.Release(4),
        pp.make_store(5, [0, 2**64 - 1, 7], data),
        pp.make_load(6, [1, 2, 3]),
        pp.make_free(7, range(pp.MAX_BATCH)),
        pp.Status(2**64 - 1),
        pp.RdmaOpen(8, 256),
        pp.RdmaMap(9, 2**64 - 1),
    ]


def replies() -> list[pp.Reply]:
    return [
        pp.HelloReply(1, 1, True, 60000, pp.MAX_FRAME, pp.MAX_BATCH, 10, 5, 3),
        pp.ReserveReply(3, 10, 2),
        pp.ReleaseReply(4, 99),
        pp.StoreReply(5),
        pp.LoadReply(6, memoryview(os.urandom(2 * pp.PAGE_SIZE))),
        pp.FreeReply(7, 1000),
        pp.StatusReply(8, b'{"capacity_pages": 1}'),
        pp.ErrorReply(9, pp.MsgType.STORE, pp.ErrorCode.NO_SPACE, "full: 10 of 10 pages"),
        pp.RdmaOpenReply(10, 7070, 16, os.urandom(32)),
        pp.RdmaMapReply(11, 0x7F00_0000_0000, 0xDEADBEEF, 256),
        pp.ErrorReply(12, pp.MsgType.RDMA_MAP, pp.ErrorCode.INVALID, "no RDMA connection"),
    ]


def same(a: pp.Message, b: pp.Message) -> bool:
    """Equality that compares borrowed memoryviews by content."""
    if type(a) is not type(b):
        return False
    for name in a.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, memoryview) or isinstance(y, memoryview):
            x, y = bytes(x), bytes(y)
        if x != y:
            return False
    return True


def decode_all(role: str, wire: bytes, chunk: int | None = None) -> list[pp.Message]:
    dec, out = Decoder(role), []
    chunk = chunk or len(wire) or 1
    for i in range(0, len(wire), chunk):
        dec.receive_data(wire[i : i + chunk])
        while (m := dec.next_event()) is not NEED_DATA:
            # copy borrowed data before the next receive_data may move it
            if isinstance(m, pp.Store):
                m = pp.Store(m.req_id, m.keys, memoryview(bytes(m.data)))
            elif isinstance(m, pp.LoadReply):
                m = pp.LoadReply(m.req_id, memoryview(bytes(m.data)))
            out.append(m)
    dec.receive_eof()
    assert dec.next_event() is NEED_DATA
    return out


@pytest.mark.parametrize("role,msgs", [("server", requests()), ("client", replies())])
@pytest.mark.parametrize("chunk", [None, 1, 7, 24, 4096])
def test_round_trip_at_any_split(role: str, msgs: list, chunk: int | None) -> None:
    wire = b"".join(encode_bytes(m) for m in msgs)
    got = decode_all(role, wire, chunk)
    assert len(got) == len(msgs)
    for a, b in zip(got, msgs, strict=True):
        assert same(a, b), (a, b)


def test_header_layout_is_little_endian_and_documented() -> None:
    wire = encode_bytes(pp.Reserve(0x0102030405060708, 5))
    assert wire[:4] == b"DUVM"
    assert struct.unpack_from("<HHQII", wire, 4) == (
        pp.MsgType.RESERVE,
        0,
        0x0102030405060708,
        0,
        8,
    )
    assert wire[24:] == struct.pack("<Q", 5)
    assert pp.HEADER_SIZE == 24


def test_store_data_is_not_copied_by_encode() -> None:
    data = bytearray(2 * pp.PAGE_SIZE)
    parts = encode(pp.make_store(1, [1, 2], data))
    assert isinstance(parts[-1], memoryview) and parts[-1].obj is data


def test_zero_copy_receive_path() -> None:
    wire = encode_bytes(pp.make_store(9, [4], b"x" * pp.PAGE_SIZE))
    dec = Decoder("server")
    buf = dec.get_buffer()
    buf[: len(wire)] = wire
    dec.buffer_updated(len(wire))
    msg = dec.next_event()
    assert isinstance(msg, pp.Store) and list(msg.keys) == [4]
    assert bytes(msg.data) == b"x" * pp.PAGE_SIZE
    assert msg.data.obj is buf.obj  # borrowed from the decoder's own buffer


@pytest.mark.parametrize("role", ["server", "client"])
def test_truncated_frame_at_eof_is_a_remote_error(role: str) -> None:
    msg = requests()[4] if role == "server" else replies()[4]
    wire = encode_bytes(msg)
    for cut in (1, 23, 24, 100, len(wire) - 1):
        dec = Decoder(role)
        dec.receive_data(wire[:cut])
        assert dec.next_event() is NEED_DATA
        dec.receive_data(b"")
        with pytest.raises(pp.RemoteProtocolError, match="closed inside a frame"):
            dec.next_event()


def _frame(
    mtype: int, length: int, *, magic: int = pp.MAGIC, flags: int = 0, status: int = 0
) -> bytes:
    return pp.HEADER.pack(magic, mtype, flags, 1, status, length)


@pytest.mark.parametrize(
    "role,wire,reason",
    [
        ("server", _frame(pp.MsgType.STORE, 0, magic=0x12345678), "bad magic"),
        ("server", _frame(99, 0), "unexpected frame type"),
        ("server", _frame(pp.MsgType.STORE | pp.REPLY_BIT, 0), "unexpected frame type"),
        ("client", _frame(pp.MsgType.STORE, 0), "unexpected frame type"),
        ("server", _frame(pp.MsgType.STATUS, 0, flags=1), "reserved flags"),
        ("server", _frame(pp.MsgType.STATUS, 0, status=2), "non-zero status"),
        ("client", _frame(pp.MsgType.STORE | pp.REPLY_BIT, 0, status=77), "unknown error code"),
        ("server", _frame(pp.MsgType.STORE, 2**32 - 1), "exceeds the limit"),
        ("server", _frame(pp.MsgType.STATUS, 1), "exceeds the limit"),
        ("client", _frame(pp.MsgType.LOAD | pp.REPLY_BIT, pp.MAX_FRAME), "exceeds the limit"),
        ("server", _frame(pp.MsgType.LOAD, 8) + struct.pack("<II", 0, 0), "carries 0 pages"),
        ("server", _frame(pp.MsgType.LOAD, 8) + struct.pack("<II", 2000, 0), "carries 2000"),
        ("server", _frame(pp.MsgType.LOAD, 16) + struct.pack("<IIQ", 1, 5, 0), "reserved"),
        ("server", _frame(pp.MsgType.LOAD, 16) + struct.pack("<IIQ", 2, 0, 0), "expected 24"),
        ("server", _frame(pp.MsgType.STORE, 16) + struct.pack("<IIQ", 1, 0, 0), "expected 4112"),
        ("server", _frame(pp.MsgType.RESERVE, 4) + b"\0" * 4, "expected 8"),
        (
            "server",
            _frame(pp.MsgType.HELLO, 9) + struct.pack("<HHHH", 1, 1, 0, 0) + b"x",
            "expected 8",
        ),
        (
            "server",
            _frame(pp.MsgType.HELLO, 9) + struct.pack("<HHHH", 1, 1, 1, 0) + b"\xff",
            "bad HELLO",
        ),
        ("server", _frame(pp.MsgType.HELLO, 8) + struct.pack("<HHHH", 1, 1, 0, 0), "bad HELLO"),
        ("client", _frame(pp.MsgType.LOAD | pp.REPLY_BIT, 5) + b"12345", "not whole pages"),
        (
            "client",
            _frame(pp.MsgType.AUTH | pp.REPLY_BIT, 40) + b"\1\0\4\0" + b"\0" * 36,
            "unknown flags",
        ),
        (
            "client",
            _frame(pp.MsgType.HELLO | pp.REPLY_BIT, 80) + b"\2\0\4\0" + b"\0" * 76,
            "unknown flags",
        ),
        ("server", _frame(pp.MsgType.AUTH, 31) + b"\0" * 31, "expected 32"),
        ("server", _frame(pp.MsgType.RDMA_OPEN, 8) + struct.pack("<II", 0, 0), "chunk pages"),
        ("server", _frame(pp.MsgType.RDMA_OPEN, 8) + struct.pack("<II", 256, 1), "reserved"),
        ("server", _frame(pp.MsgType.RDMA_OPEN, 4) + b"\0" * 4, "expected 8"),
        ("server", _frame(pp.MsgType.RDMA_MAP, 4) + b"\0" * 4, "expected 8"),
        ("server", _frame(pp.MsgType.RDMA_MAP, 9) + b"\0" * 9, "exceeds the limit"),
        (
            "client",
            _frame(pp.MsgType.RDMA_OPEN | pp.REPLY_BIT, 40) + b"\0\0\1\0" + b"\0" * 36,
            "reserved",
        ),
        ("client", _frame(pp.MsgType.RDMA_MAP | pp.REPLY_BIT, 15) + b"\0" * 15, "expected 16"),
        (
            "server",
            _frame(pp.MsgType.HELLO, 9) + struct.pack("<HHHH", 1, 2, 1, 0) + b"x",
            "needs a nonce",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
def test_bad_frames_are_remote_errors(role: str, wire: bytes, reason: str) -> None:
    dec = Decoder(role)
    dec.receive_data(wire)
    with pytest.raises(pp.RemoteProtocolError, match=reason):
        dec.next_event()


def test_oversized_frame_refused_from_its_header_alone() -> None:
    """The limit is enforced before the payload is buffered: a peer cannot make us hold it."""
    dec = Decoder("server")
    dec.receive_data(_frame(pp.MsgType.STORE, pp.MAX_FRAME))  # header only, no payload yet
    with pytest.raises(pp.RemoteProtocolError, match="exceeds the limit"):
        dec.next_event()


def test_smaller_max_frame_is_enforced() -> None:
    dec = Decoder("server", max_frame=64 << 10)
    dec.receive_data(encode_bytes(pp.make_store(1, range(16), bytes(16 * pp.PAGE_SIZE)))[:30])
    with pytest.raises(pp.RemoteProtocolError, match="exceeds the limit"):
        dec.next_event()


def test_local_misuse_is_a_local_error() -> None:
    with pytest.raises(pp.LocalProtocolError, match="client id"):
        pp.Hello(1, "")
    with pytest.raises(pp.LocalProtocolError, match="client id"):
        pp.Hello(1, "x" * 256)
    with pytest.raises(pp.LocalProtocolError, match="min_version"):
        pp.Hello(1, "a", 3, 2)
    with pytest.raises(pp.LocalProtocolError, match="needs 8192 bytes"):
        pp.make_store(1, [1, 2], bytes(4096))
    with pytest.raises(pp.LocalProtocolError, match="carries 0 pages"):
        pp.make_load(1, [])
    with pytest.raises(pp.LocalProtocolError, match="carries 1025 pages"):
        pp.make_free(1, range(1025))
    with pytest.raises(pp.LocalProtocolError, match="integers"):
        pp.make_load(1, [-1])
    with pytest.raises(pp.LocalProtocolError, match="non-zero code"):
        pp.ErrorReply(1, pp.MsgType.LOAD, pp.ErrorCode.OK, "")
    with pytest.raises(pp.LocalProtocolError, match="role"):
        Decoder("peer")
    with pytest.raises(pp.LocalProtocolError, match="not a page protocol message"):
        encode("hello")  # type: ignore[arg-type]


def test_feeding_more_than_fits_is_a_local_error_and_loses_nothing() -> None:
    dec = Decoder("server", max_frame=4096)
    one = encode_bytes(pp.Status(1))
    room = len(dec.get_buffer())
    with pytest.raises(pp.LocalProtocolError, match="call next_event"):
        dec.receive_data(one * (room // len(one) + 1))
    dec.receive_data(one * 3)
    assert [m.req_id for m in iter(dec.next_event, NEED_DATA)] == [1, 1, 1]


def test_buffer_compacts_so_a_partial_max_frame_still_fits() -> None:
    dec = Decoder("server")
    small = encode_bytes(pp.Status(1))
    big = encode_bytes(pp.make_store(2, range(pp.MAX_BATCH), bytes(pp.MAX_BATCH * 4096)))
    for _ in range(200):
        dec.receive_data(small)
    dec.receive_data(big[:100])
    assert len([m for m in iter(dec.next_event, NEED_DATA)]) == 200
    dec.receive_data(big[100:])  # fits after compaction
    msg = dec.next_event()
    assert isinstance(msg, pp.Store) and len(msg.keys) == pp.MAX_BATCH


def test_error_codes_map_to_errno() -> None:
    import errno

    assert pp.ErrorCode.NO_SPACE.to_errno() == errno.ENOSPC
    assert pp.ErrorCode.NOT_FOUND.to_errno() == errno.ENOENT
    assert pp.ErrorCode.INTERNAL.to_errno() == errno.EIO
    assert all(c.to_errno() for c in pp.ErrorCode if c)


# --- fuzz ---

message_requests = st.sampled_from(requests())
message_replies = st.sampled_from(replies())


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(message_requests, min_size=1, max_size=6), st.integers(1, 9000))
def test_fuzz_request_streams_decode_at_any_chunking(msgs: list, chunk: int) -> None:
    wire = b"".join(encode_bytes(m) for m in msgs)
    got = decode_all("server", wire, chunk)
    assert all(same(a, b) for a, b in zip(got, msgs, strict=True)) and len(got) == len(msgs)


@settings(max_examples=250, deadline=None)
@given(st.binary(max_size=600), st.sampled_from(["server", "client"]))
def test_fuzz_garbage_only_raises_remote_errors(data: bytes, role: str) -> None:
    dec = Decoder(role)
    dec.receive_data(data)
    dec.receive_eof()
    try:
        while dec.next_event() is not NEED_DATA:
            pass
    except pp.RemoteProtocolError:
        pass


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_fuzz_mutated_valid_frames_never_crash(data: st.DataObject) -> None:
    role = data.draw(st.sampled_from(["server", "client"]))
    msg = data.draw(message_requests if role == "server" else message_replies)
    wire = bytearray(encode_bytes(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, min(len(wire) - 1, 80)))
        wire[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(wire)))
    dec = Decoder(role)
    dec.receive_data(bytes(wire[:cut]))
    dec.receive_eof()
    try:
        while (m := dec.next_event()) is not NEED_DATA:
            assert type(m).__name__ in {
                t.__name__ for t in (*pp.Request.__args__, *pp.Reply.__args__)
            }
    except pp.RemoteProtocolError:
        pass
