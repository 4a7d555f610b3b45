"""Unit and fuzz tests of the sans-io NBD codec (duvm.wire.nbdproto): bytes in, events/bytes out.

The transmission tests run against both decoders: the reference in nbdproto and its compiled
twin (duvm.wire._nbdcodec), and a differential test feeds both the same streams. Without the
compiled module its runs skip, except where DUVM_REQUIRE_COMPILED=1 (CI) makes that a failure.
"""

from __future__ import annotations

import errno
import importlib
import itertools
import os
import struct
from types import SimpleNamespace

import pytest
from duvm.base import accel
from duvm.node.daemon.nbdserver import transmission_flags
from duvm.store.storage import Capabilities
from duvm.wire import nbdconst as C
from duvm.wire import nbdproto
from duvm.wire.nbdhandshake import MAX_OPTION_DATA, Handshake, HandshakeState
from duvm.wire.nbdproto import (
    BufferPool,
    ExportInfo,
    NbdProtocolError,
    Request,
    TransmissionDecoder,
    UsageError,
    encode_simple_reply,
    wire_error,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SIZE = 1 << 20
FLAGS = transmission_flags(Capabilities())
EXPORT = ExportInfo("disk", SIZE, FLAGS, description="test export")


# ----------------------------------------------------------------------------- helpers


def option(opt: int, data: bytes = b"") -> bytes:
    return C.OPTION_HEADER.pack(C.IHAVEOPT, opt, len(data)) + data


def go_data(name: str, infos: tuple[int, ...] = ()) -> bytes:
    n = name.encode()
    return struct.pack(">I", len(n)) + n + struct.pack(f">H{len(infos)}H", len(infos), *infos)


def parse_option_replies(data: bytes) -> list[tuple[int, int, bytes]]:
    """-> [(option, reply type, payload)]; asserts the framing is exact."""
    out = []
    while data:
        magic, opt, rtype, length = C.OPTION_REPLY_HEADER.unpack_from(data)
        assert magic == C.OPT_REPLY_MAGIC
        payload = data[20 : 20 + length]
        assert len(payload) == length
        out.append((opt, rtype, payload))
        data = data[20 + length :]
    return out


def negotiated(cflags: int = C.FLAG_C_FIXED_NEWSTYLE | C.FLAG_C_NO_ZEROES) -> Handshake:
    hs = Handshake([EXPORT])
    hs.data_to_send()
    hs.receive_data(struct.pack(">I", cflags))
    return hs


def request(
    cmd: int,
    offset: int = 0,
    length: int = 0,
    flags: int = 0,
    cookie: int = 7,
    payload: bytes = b"",
) -> bytes:
    return C.REQUEST.pack(C.REQUEST_MAGIC, flags, cmd, cookie, offset, length) + payload


def drain(dec: TransmissionDecoder) -> list[Request]:
    out = []
    while (r := dec.next_request()) is not None:
        out.append(r)
    return out


# ----------------------------------------------------------------------------- handshake


def test_greeting_is_fixed_newstyle_with_no_zeroes():
    hs = Handshake([EXPORT])
    assert hs.data_to_send() == struct.pack(
        ">QQH", C.NBDMAGIC, C.IHAVEOPT, C.FLAG_FIXED_NEWSTYLE | C.FLAG_NO_ZEROES
    )
    assert hs.state is HandshakeState.CLIENT_FLAGS


def test_unknown_client_flags_close_the_connection():
    hs = Handshake([EXPORT])
    with pytest.raises(NbdProtocolError, match="client flags"):
        hs.receive_data(struct.pack(">I", 0x80))
    assert hs.state is HandshakeState.CLOSED
    assert "client flags" in (hs.close_reason or "")


def test_go_replies_export_and_block_size_then_enters_transmission():
    hs = negotiated()
    hs.receive_data(option(C.OPT_GO, go_data("disk", (C.INFO_BLOCK_SIZE, C.INFO_NAME))) + b"xyz")
    replies = parse_option_replies(hs.data_to_send())
    assert [r[1] for r in replies] == [C.REP_INFO] * 3 + [C.REP_ACK]
    infos = {struct.unpack_from(">H", p)[0]: p[2:] for _, t, p in replies if t == C.REP_INFO}
    assert struct.unpack(">QH", infos[C.INFO_EXPORT]) == (SIZE, FLAGS)
    assert struct.unpack(">III", infos[C.INFO_BLOCK_SIZE]) == (4096, 4096, 1 << 25)
    assert infos[C.INFO_NAME] == b"disk"
    assert hs.state is HandshakeState.TRANSMISSION
    assert hs.export is EXPORT and hs.block_size_requested
    assert hs.trailing == b"xyz"  # bytes after the last option belong to transmission
    with pytest.raises(UsageError):
        hs.receive_data(b"more")


def test_info_does_not_end_negotiation_and_empty_name_is_default_export():
    hs = negotiated()
    hs.receive_data(option(C.OPT_INFO, go_data("", (C.INFO_DESCRIPTION,))))
    replies = parse_option_replies(hs.data_to_send())
    assert replies[-1][1] == C.REP_ACK
    assert (C.OPT_INFO, C.REP_INFO, struct.pack(">H", C.INFO_DESCRIPTION) + b"test export") in (
        replies
    )
    assert hs.state is HandshakeState.OPTIONS
    hs.receive_data(option(C.OPT_GO, go_data("")))
    assert hs.state is HandshakeState.TRANSMISSION and not hs.block_size_requested


@pytest.mark.parametrize(
    ("cflags", "reply_len"),
    [(C.FLAG_C_FIXED_NEWSTYLE, 134), (C.FLAG_C_FIXED_NEWSTYLE | C.FLAG_C_NO_ZEROES, 10)],
)
def test_export_name_reply_honours_no_zeroes(cflags, reply_len):
    hs = negotiated(cflags)
    hs.receive_data(option(C.OPT_EXPORT_NAME, b"disk"))
    out = hs.data_to_send()
    assert len(out) == reply_len
    assert struct.unpack_from(">QH", out) == (SIZE, FLAGS)
    assert out[10:] == bytes(reply_len - 10)
    assert hs.state is HandshakeState.TRANSMISSION


def test_export_name_unknown_is_a_hard_disconnect():
    hs = negotiated()
    with pytest.raises(NbdProtocolError, match="no export"):
        hs.receive_data(option(C.OPT_EXPORT_NAME, b"nope"))
    assert hs.state is HandshakeState.CLOSED


def test_list_abort_and_unsupported_options():
    hs = negotiated()
    hs.receive_data(option(C.OPT_LIST))
    assert parse_option_replies(hs.data_to_send()) == [
        (C.OPT_LIST, C.REP_SERVER, b"\x00\x00\x00\x04disk"),
        (C.OPT_LIST, C.REP_ACK, b""),
    ]
    hs.receive_data(option(C.OPT_LIST, b"junk"))
    assert parse_option_replies(hs.data_to_send())[0][1] == C.REP_ERR_INVALID
    for opt in (C.OPT_STRUCTURED_REPLY, C.OPT_STARTTLS, C.OPT_SET_META_CONTEXT, 0x7777):
        hs.receive_data(option(opt, b"abc"))
        assert parse_option_replies(hs.data_to_send())[0][:2] == (opt, C.REP_ERR_UNSUP)
    assert hs.state is HandshakeState.OPTIONS
    hs.receive_data(option(C.OPT_ABORT))
    assert parse_option_replies(hs.data_to_send()) == [(C.OPT_ABORT, C.REP_ACK, b"")]
    assert hs.state is HandshakeState.CLOSED


@pytest.mark.parametrize(
    ("data", "rtype"),
    [
        (go_data("other"), C.REP_ERR_UNKNOWN),
        (b"\x00\x00", C.REP_ERR_INVALID),  # too short
        (struct.pack(">I", 100) + b"disk\x00\x00", C.REP_ERR_INVALID),  # name overruns
        (go_data("disk", (3,)) + b"\x00", C.REP_ERR_INVALID),  # trailing garbage
        (go_data("disk")[:-2] + struct.pack(">H", 5), C.REP_ERR_INVALID),  # info count lies
        (struct.pack(">I", 2) + b"\xff\xfe\x00\x00", C.REP_ERR_INVALID),  # not UTF-8
    ],
)
def test_bad_go_is_answered_and_negotiation_continues(data, rtype):
    hs = negotiated()
    hs.receive_data(option(C.OPT_GO, data))
    replies = parse_option_replies(hs.data_to_send())
    assert [r[1] for r in replies] == [rtype]
    assert hs.state is HandshakeState.OPTIONS
    hs.receive_data(option(C.OPT_GO, go_data("disk")))
    assert hs.state is HandshakeState.TRANSMISSION


def test_over_long_option_is_skipped_in_pieces_not_buffered():
    hs = negotiated()
    n = MAX_OPTION_DATA + 5000
    hs.receive_data(C.OPTION_HEADER.pack(C.IHAVEOPT, C.OPT_GO, n))
    for _ in range(n // 1000):
        hs.receive_data(bytes(1000))
        assert len(hs._in) < 2000  # nothing accumulates
    hs.receive_data(bytes(n % 1000) + option(C.OPT_LIST))
    replies = parse_option_replies(hs.data_to_send())
    assert [r[1] for r in replies] == [C.REP_ERR_TOO_BIG, C.REP_SERVER, C.REP_ACK]


def test_bad_option_magic_is_a_protocol_error():
    hs = negotiated()
    with pytest.raises(NbdProtocolError, match="magic"):
        hs.receive_data(struct.pack(">QII", 0x1234, C.OPT_GO, 0))


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_handshake_result_does_not_depend_on_how_bytes_are_split(cuts):
    stream = (
        struct.pack(">I", C.FLAG_C_FIXED_NEWSTYLE)
        + option(C.OPT_LIST)
        + option(C.OPT_INFO, go_data("disk", (C.INFO_BLOCK_SIZE,)))
        + option(C.OPT_GO, go_data("disk"))
        + request(C.CMD_READ, 0, 4096)
    )
    whole = Handshake([EXPORT])
    whole.receive_data(stream)
    pieces = Handshake([EXPORT])
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    for a, b in itertools.pairwise(points):
        if pieces.state is HandshakeState.TRANSMISSION:
            pieces.trailing += stream[a:b]
        else:
            pieces.receive_data(stream[a:b])
    assert pieces.data_to_send() == whole.data_to_send()
    assert pieces.state is whole.state is HandshakeState.TRANSMISSION
    assert pieces.trailing == whole.trailing == request(C.CMD_READ, 0, 4096)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.binary(max_size=400), prefix=st.booleans())
def test_garbage_during_handshake_never_crashes_and_stays_bounded(garbage, prefix):
    hs = Handshake([EXPORT])
    data = (struct.pack(">I", 1) if prefix else b"") + garbage
    try:
        hs.receive_data(data)
    except NbdProtocolError:
        assert hs.state is HandshakeState.CLOSED
        return
    assert len(hs._in) <= C.OPTION_HEADER_SIZE + MAX_OPTION_DATA
    parse_option_replies(hs.data_to_send()[18:])  # replies stay well framed


# ----------------------------------------------------------------------------- transmission

COMPILED = accel.state("duvm.wire._nbdcodec")
if COMPILED != "compiled" and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {COMPILED}")


def _codecs() -> dict[str, SimpleNamespace]:
    out = {"pure": SimpleNamespace(TransmissionDecoder=TransmissionDecoder, BufferPool=BufferPool)}
    if COMPILED == "compiled":
        c = importlib.import_module("duvm.wire._nbdcodec")  # whatever DUVM_PURE_PYTHON says
        out["compiled"] = SimpleNamespace(
            TransmissionDecoder=c.TransmissionDecoder, BufferPool=c.BufferPool
        )
    return out


@pytest.fixture(
    scope="module",
    params=[
        "pure",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(COMPILED != "compiled", reason=f"compiled: {COMPILED}"),
        ),
    ],
)
def codec(request) -> SimpleNamespace:
    """The decoder and pool classes of one path."""
    return _codecs()[request.param]


def test_read_request_decodes(codec):
    dec = codec.TransmissionDecoder(EXPORT)
    dec.receive_data(request(C.CMD_READ, 8192, 4096, cookie=0xDEADBEEFCAFEF00D))
    (r,) = drain(dec)
    assert (r.cmd, r.offset, r.length, r.cookie, r.error) == (
        C.CMD_READ,
        8192,
        4096,
        0xDEADBEEFCAFEF00D,
        0,
    )
    assert r.payload is None and not dec.mid_request


def test_write_payload_arrives_in_pooled_buffer(codec):
    pool = codec.BufferPool()
    dec = codec.TransmissionDecoder(EXPORT, pool)
    data = bytes(range(256)) * 16
    dec.receive_data(request(C.CMD_WRITE, 4096, 4096, payload=data) + request(C.CMD_FLUSH))
    w, f = drain(dec)
    assert w.cmd == C.CMD_WRITE and bytes(w.payload) == data and len(w.buffer) == 4096
    assert f.cmd == C.CMD_FLUSH and f.error == 0
    pool.release(w.buffer)
    assert pool.acquire(4000) is w.buffer  # reused, not reallocated


def test_large_write_is_received_straight_into_its_payload_buffer(codec):
    dec = codec.TransmissionDecoder(EXPORT, buffer_size=4096)
    data = bytes([7]) * (256 << 10)
    dec.receive_data(request(C.CMD_WRITE, 0, len(data)) + data[:100])
    assert dec.next_request() is None
    view = dec.get_buffer()
    assert len(view) == len(data) - 100  # the payload itself, not the receive buffer
    view[:] = data[100:]
    dec.buffer_updated(len(view))
    (w,) = drain(dec)
    assert bytes(w.payload) == data


def test_after_a_large_write_the_next_header_is_read_alone(codec):
    """Catches a decoder that reads a large write's header together with the start of its
    payload into its own buffer: the payload (256 KiB, all of it when the socket has it) is
    then copied out of that buffer, instead of received straight into the payload buffer.
    After a small request the receive buffer is offered whole again (small requests come in
    batches, one read for many)."""
    dec = codec.TransmissionDecoder(EXPORT)

    def recv(data: bytes) -> None:  # recv_into, as the transport does it: as much as fits
        view = memoryview(data)
        while view:
            dst = dec.get_buffer()
            n = min(len(dst), len(view))
            dst[:n] = view[:n]
            dec.buffer_updated(n)
            view = view[n:]

    big = [bytes([i]) * (256 << 10) for i in (1, 2)]
    assert len(dec.get_buffer()) == 256 << 10  # nothing seen yet: the whole buffer
    recv(request(C.CMD_WRITE, 0, len(big[0]), payload=big[0])[: 28 + 4096])
    assert dec.next_request() is None  # the first one: its payload partly copied
    recv(big[0][4096:])
    (first,) = drain(dec)
    header = dec.get_buffer()
    assert len(header) == 28  # the next header alone
    header[:] = request(C.CMD_WRITE, 512 << 10, len(big[1]))
    dec.buffer_updated(28)
    assert dec.next_request() is None
    direct = dec.get_buffer()
    assert len(direct) == len(big[1])  # the payload buffer itself
    direct[:] = big[1]
    dec.buffer_updated(len(big[1]))
    (second,) = drain(dec)
    assert bytes(first.payload) == big[0] and bytes(second.payload) == big[1]
    direct[:1] = b"x"
    assert bytes(second.payload[:1]) == b"x"  # the same memory: received, not copied
    recv(request(C.CMD_READ, 0, 4096))
    (read,) = drain(dec)
    assert read.cmd == C.CMD_READ and len(dec.get_buffer()) == 256 << 10


E = EXPORT
RO = ExportInfo("ro", SIZE, transmission_flags(Capabilities(can_write=False)))
NOTRIM = ExportInfo("nt", SIZE, transmission_flags(Capabilities(can_trim=False)))


@pytest.mark.parametrize(
    ("export", "cmd", "offset", "length", "flags", "expect"),
    [
        (E, C.CMD_READ, SIZE - 4096, 4096, 0, 0),
        (E, C.CMD_READ, SIZE, 4096, 0, errno.EINVAL),  # beyond the end: read -> EINVAL
        (E, C.CMD_TRIM, SIZE - 4096, 8192, 0, errno.EINVAL),
        (E, C.CMD_WRITE_ZEROES, SIZE, 4096, 0, errno.ENOSPC),  # write-ish -> ENOSPC
        (E, C.CMD_READ, 2**64 - 4096, 4096, 0, errno.EINVAL),  # no wrap-around
        (E, C.CMD_READ, 2**64 - 4096, 8192, 0, errno.EINVAL),  # ... even onto a valid range
        (E, C.CMD_READ, 512, 4096, 0, errno.EINVAL),  # unaligned offset
        (E, C.CMD_TRIM, 0, 1000, 0, errno.EINVAL),  # unaligned length
        (E, C.CMD_READ, 0, 4096, C.CMD_FLAG_FUA, 0),  # FUA is valid on every command
        (E, C.CMD_READ, 0, 4096, C.CMD_FLAG_DF, errno.EINVAL),  # no structured replies
        (E, C.CMD_READ, 0, 4096, 0x8000, errno.EINVAL),  # unknown flag
        (E, C.CMD_TRIM, 0, 4096, C.CMD_FLAG_NO_HOLE, errno.EINVAL),  # NO_HOLE: zeroes only
        (E, C.CMD_WRITE_ZEROES, 0, 4096, C.CMD_FLAG_NO_HOLE, 0),
        (E, C.CMD_WRITE_ZEROES, 0, 4096, C.CMD_FLAG_FAST_ZERO, errno.EINVAL),  # not offered
        (E, C.CMD_WRITE_ZEROES, 0, SIZE, 0, 0),  # no payload: longer than max payload is fine
        (E, C.CMD_FLUSH, 0, 0, 0, 0),
        (E, C.CMD_FLUSH, 4096, 0, 0, errno.EINVAL),  # reserved fields must be zero
        (E, C.CMD_CACHE, 0, 4096, 0, errno.EINVAL),  # not offered
        (E, C.CMD_BLOCK_STATUS, 0, 4096, 0, errno.EINVAL),
        (E, 99, 0, 0, 0, errno.EINVAL),  # unknown command
        (ExportInfo("big", 1 << 26, FLAGS), C.CMD_READ, 0, (1 << 25) + 4096, 0, errno.EINVAL),
        (RO, C.CMD_TRIM, 0, 4096, 0, errno.EPERM),
        (RO, C.CMD_READ, 0, 4096, 0, 0),
        (NOTRIM, C.CMD_TRIM, 0, 4096, 0, errno.EINVAL),
    ],
)
def test_requests_are_validated_once_with_the_documented_errors(
    codec, export, cmd, offset, length, flags, expect
):
    dec = codec.TransmissionDecoder(export)
    dec.receive_data(request(cmd, offset, length, flags))
    (r,) = drain(dec)
    assert r.error == expect


@pytest.mark.parametrize(
    ("export", "offset", "expect"),
    [(E, SIZE, errno.ENOSPC), (E, 100, errno.EINVAL), (RO, 0, errno.EPERM)],
)
def test_refused_write_payload_is_skipped_and_stream_stays_in_step(codec, export, offset, expect):
    dec = codec.TransmissionDecoder(export, buffer_size=1024)
    stream = request(C.CMD_WRITE, offset, 8192, payload=b"\xaa" * 8192) + request(
        C.CMD_READ, 0, 4096, cookie=99
    )
    out = []
    for i in range(0, len(stream), 700):
        dec.receive_data(stream[i : i + 700])
        out += drain(dec)
    assert [(r.cmd, r.error, r.payload) for r in out] == [
        (C.CMD_WRITE, expect, None),
        (C.CMD_READ, 0, None),
    ]
    assert out[1].cookie == 99


def test_oversized_write_is_refused_and_its_payload_skipped(codec):
    small = ExportInfo("s", SIZE, FLAGS, max_payload=8192)
    dec = codec.TransmissionDecoder(small, buffer_size=4096)
    dec.receive_data(request(C.CMD_WRITE, 0, 12288))
    out = drain(dec)
    for _ in range(3):  # the payload arrives in pieces and is thrown away, not buffered
        dec.receive_data(b"p" * 4096)
        out += drain(dec)
        assert dec.buffered == 0
    dec.receive_data(request(C.CMD_READ, 0, 8192, cookie=3))
    out += drain(dec)
    assert [(r.cmd, r.error) for r in out] == [(C.CMD_WRITE, errno.EINVAL), (C.CMD_READ, 0)]


def test_bad_request_magic_is_a_protocol_error(codec):
    dec = codec.TransmissionDecoder(EXPORT)
    dec.receive_data(b"\x00" * 28)
    with pytest.raises(NbdProtocolError, match="magic"):
        dec.next_request()


def test_receive_data_refuses_to_overflow_the_buffer(codec):
    dec = codec.TransmissionDecoder(EXPORT, buffer_size=64)
    with pytest.raises(UsageError):
        dec.receive_data(request(C.CMD_FLUSH) * 4)


# Independent oracle of proto.md's rules for the generated-request test below.
def oracle(cmd: int, flags: int, offset: int, length: int) -> int:
    known = {
        C.CMD_READ: 1,
        C.CMD_WRITE: 1,
        C.CMD_FLUSH: 1,
        C.CMD_TRIM: 1,
        C.CMD_WRITE_ZEROES: 3,
        C.CMD_DISC: 1,
    }
    if cmd not in known or flags & ~known[cmd]:
        return errno.EINVAL
    if cmd in (C.CMD_FLUSH, C.CMD_DISC):
        return errno.EINVAL if offset or length else 0
    if cmd in (C.CMD_READ, C.CMD_WRITE) and length > 1 << 25:
        return errno.EINVAL
    if offset + length > SIZE:
        return errno.ENOSPC if cmd in (C.CMD_WRITE, C.CMD_WRITE_ZEROES) else errno.EINVAL
    return errno.EINVAL if offset % 4096 or length % 4096 else 0


req_strategy = st.tuples(
    st.sampled_from([0, 1, 3, 4, 5, 6, 7, 42]),
    st.sampled_from([0, 1, 2, 4, 16, 0x8000]),
    st.one_of(
        st.integers(0, SIZE // 4096).map(lambda p: p * 4096),
        st.integers(0, 2**64 - 1),
        st.integers(1, 16).map(lambda p: 2**64 - p * 4096),  # where offset + length wraps
    ),
    st.one_of(st.sampled_from([0, 4096, 8192, 65536]), st.integers(0, 20000)),
    st.integers(0, 2**64 - 1),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(req_strategy, max_size=12),
    chunk=st.integers(1, 5000),
    bufsize=st.sampled_from([64, 1000, 65536]),
)
def test_generated_request_streams_decode_exactly(codec, reqs, chunk, bufsize):
    stream = b""
    expected = []
    for cmd, flags, offset, length, cookie in reqs:
        payload = bytes([cookie & 0xFF]) * length if cmd == C.CMD_WRITE else b""
        stream += request(cmd, offset, length, flags, cookie, payload)
        err = oracle(cmd, flags, offset, length)
        # A valid non-empty write carries its payload; a refused one had it skipped.
        expected.append(
            (
                cmd,
                flags,
                offset,
                length,
                cookie,
                err,
                payload if cmd == C.CMD_WRITE and length and not err else None,
            )
        )
    dec = codec.TransmissionDecoder(EXPORT, buffer_size=bufsize)
    got = []
    view = memoryview(stream)
    while view:  # recv_into style, as the driver does it
        dst = dec.get_buffer()
        n = min(len(dst), len(view), chunk)
        dst[:n] = view[:n]
        dec.buffer_updated(n)
        view = view[n:]
        got += [
            (
                r.cmd,
                r.flags,
                r.offset,
                r.length,
                r.cookie,
                r.error,
                bytes(r.payload) if r.payload is not None else None,
            )
            for r in drain(dec)
        ]
    assert got == expected
    assert not dec.mid_request


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=2000))
def test_garbage_requests_raise_protocol_error_or_wait_never_crash(codec, garbage):
    dec = codec.TransmissionDecoder(EXPORT, buffer_size=4096)
    try:
        dec.receive_data(garbage[:4096])
        drain(dec)
    except NbdProtocolError:
        return
    assert dec.buffered < C.REQUEST_SIZE or dec.mid_request


def test_truncated_request_waits_for_the_rest(codec):
    frame = request(C.CMD_WRITE, 0, 4096, payload=b"z" * 4096)
    for cut in (1, 27, 28, 29, len(frame) - 1):
        dec = codec.TransmissionDecoder(EXPORT)
        dec.receive_data(frame[:cut])
        assert dec.next_request() is None and dec.mid_request
        dec.receive_data(frame[cut:])
        (w,) = drain(dec)
        assert bytes(w.payload) == b"z" * 4096


@pytest.mark.skipif(COMPILED != "compiled", reason=f"compiled: {COMPILED}")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(req_strategy, max_size=10),
    tail=st.binary(max_size=64),
    chunks=st.lists(st.integers(1, 70000), min_size=1, max_size=8),
    bufsize=st.sampled_from([64, 1000, 65536]),
)
def test_compiled_decoder_matches_the_reference(reqs, tail, chunks, bufsize):
    """The same bytes, cut the same way, give the same requests, payload bytes, pooled
    buffer sizes, progress (`buffered`, `mid_request`) and errors on both paths. Catches a
    compiled rule that drifts from the reference: an unchecked u64 wrap-around in the range
    check, a payload copied from the wrong place, a refused write whose payload is not
    skipped."""
    stream = b"".join(
        request(
            cmd, offset, length, flags, cookie, bytes([cookie & 0xFF]) * length if cmd == 1 else b""
        )
        for cmd, flags, offset, length, cookie in reqs
    )
    stream += tail  # garbage: a bad magic, or a request cut short
    decs = [c.TransmissionDecoder(EXPORT, c.BufferPool(), bufsize) for c in _codecs().values()]
    trails: list[list[object]] = [[], []]
    for dec, trail in zip(decs, trails, strict=True):
        view, i = memoryview(stream), 0
        try:
            while view:
                dst = dec.get_buffer()
                n = min(len(dst), len(view), chunks[i % len(chunks)])
                i += 1
                dst[:n] = view[:n]
                dec.buffer_updated(n)
                view = view[n:]
                while (r := dec.next_request()) is not None:
                    trail.append(
                        (
                            r.cmd,
                            r.flags,
                            r.cookie,
                            r.offset,
                            r.length,
                            r.error,
                            None if r.payload is None else bytes(r.payload),
                            None if r.buffer is None else len(r.buffer),
                        )
                    )
                trail.append((dec.buffered, dec.mid_request))
        except NbdProtocolError as e:
            trail.append(str(e))
    assert trails[0] == trails[1]


def test_compiled_pool_keeps_the_reference_rules():
    """Sizes, reuse and the cap on free buffers per size class are the reference's."""
    if COMPILED != "compiled":
        pytest.skip(f"compiled: {COMPILED}")
    pools = [c.BufferPool(keep_bytes=64 << 10) for c in _codecs().values()]
    for pool in pools:
        got = [pool.acquire(n) for n in (1, 4096, 4097, 70000, 1 << 20)]
        assert [len(b) for b in got] == [4096, 4096, 8192, 131072, 1 << 20]
        for b in got:
            pool.release(b)
        assert pool.acquire(3000) is got[1] and pool.acquire(5000) is got[2]
        many = [pool.acquire(8192) for _ in range(30)]
        for b in many:
            pool.release(b)
        ids = {id(b) for b in many}
        kept = 0
        while id(pool.acquire(8192)) in ids:  # the kept ones, then a new buffer
            kept += 1
        assert kept == (64 << 10) // 8192 + 4


def test_the_factories_follow_the_chosen_path(monkeypatch):
    """DUVM_PURE_PYTHON=1 gives the reference classes; otherwise the compiled ones where built."""
    monkeypatch.setenv(accel.ENV, "1")
    assert type(nbdproto.buffer_pool()) is BufferPool
    assert type(nbdproto.transmission_decoder(EXPORT, BufferPool())) is TransmissionDecoder
    monkeypatch.delenv(accel.ENV)
    if COMPILED == "compiled":
        assert type(nbdproto.transmission_decoder(EXPORT, BufferPool())).__module__ == (
            "duvm.wire._nbdcodec"
        )


# ----------------------------------------------------------------------------- small pieces


@pytest.mark.parametrize(
    ("err", "flags", "wire"),
    [
        (0, 0, 0),
        (errno.EPERM, 0, C.EPERM),
        (errno.EROFS, 0, C.EPERM),
        (errno.EIO, 0, C.EIO),
        (errno.ENOMEM, 0, C.ENOMEM),
        (errno.EINVAL, 0, C.EINVAL),
        (errno.ENOSPC, 0, C.ENOSPC),
        (errno.EDQUOT, 0, C.ENOSPC),
        (errno.EFBIG, 0, C.ENOSPC),
        (errno.ESHUTDOWN, 0, C.ESHUTDOWN),
        (errno.ENOTSUP, 0, C.EINVAL),
        (errno.ENOTSUP, C.CMD_FLAG_FAST_ZERO, C.ENOTSUP),
        (errno.EOVERFLOW, 0, C.EINVAL),
        (errno.EOVERFLOW, C.CMD_FLAG_DF, C.EOVERFLOW),
        (errno.ECONNRESET, 0, C.EIO),  # anything else from a store is an I/O error
        (errno.ETIMEDOUT, 0, C.EIO),
    ],
)
def test_wire_error_mapping(err, flags, wire):
    assert wire_error(err, flags) == wire


def test_simple_reply_encoding():
    assert encode_simple_reply(5, C.EIO) == bytes.fromhex("67446698") + struct.pack(">IQ", 5, 5)


def test_transmission_flags_follow_capabilities():
    assert transmission_flags(Capabilities()) == (
        C.FLAG_HAS_FLAGS
        | C.FLAG_SEND_FLUSH
        | C.FLAG_SEND_FUA
        | C.FLAG_SEND_TRIM
        | C.FLAG_SEND_WRITE_ZEROES
        | C.FLAG_CAN_MULTI_CONN
    )
    ro = transmission_flags(Capabilities(can_write=False, can_flush=False, can_multi_conn=False))
    assert ro == C.FLAG_HAS_FLAGS | C.FLAG_READ_ONLY


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(size=1000),
        dict(min_block=3000),
        dict(min_block=1 << 17, preferred_block=1 << 17, size=1 << 17),
        dict(preferred_block=256, min_block=256),
        dict(max_payload=1024),
        dict(flags=0),
        dict(name="x" * 5000),
    ],
)
def test_export_info_rejects_what_the_document_forbids(kwargs):
    base = dict(name="d", size=SIZE, flags=FLAGS)
    with pytest.raises(ValueError):
        ExportInfo(**{**base, **kwargs})
