"""Fuzzing the parsers that face the network: the page protocol decoder (both roles), a
memserver connection fed arbitrary bytes after a real handshake, and the NBD handshake and
transmission decoders.

Each target takes bytes and fails only on a real bug: an exception other than the protocol's
own error, a round trip that changes a message, or a page store whose accounting no longer
adds up. CI runs them with a fixed example budget (DUVM_FUZZ_EXAMPLES, default 300 each);
tools/fuzz_long.py runs the same targets for minutes (with atheris when it is installed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct

import pytest
from duvm.memserver.connection import Connection
from duvm.memserver.server import MemServer
from duvm.wire import nbdconst as C
from duvm.wire import pageproto as pp
from duvm.wire.nbdhandshake import Handshake
from duvm.wire.nbdproto import ExportInfo, NbdProtocolError, TransmissionDecoder
from duvm.wire.pagedecode import HANDSHAKE_FRAME, NEED_DATA, Decoder
from duvm.wire.pageencode import encode_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("DUVM_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck)
)


# --- target 1: the page protocol decoder -----------------------------------------------------


def _same(a: pp.Message, b: pp.Message) -> bool:
    fa = {
        k: bytes(v) if isinstance(v, memoryview) else v
        for k, v in ((s, getattr(a, s)) for s in type(a).__slots__)
    }
    fb = {
        k: bytes(v) if isinstance(v, memoryview) else v
        for k, v in ((s, getattr(b, s)) for s in type(b).__slots__)
    }
    return type(a) is type(b) and fa == fb


def fuzz_page_decoder(data: bytes, role: str = "server", chunk: int = 4096) -> int:
    """Decode `data` in chunks of `chunk` bytes. Returns the messages decoded."""
    dec = Decoder(role, max_frame=HANDSHAKE_FRAME if chunk % 2 else pp.MAX_FRAME)
    n = 0
    try:
        for i in range(0, len(data), max(1, chunk)):
            dec.receive_data(data[i : i + max(1, chunk)])
            while (msg := dec.next_event()) is not NEED_DATA:
                n += 1
                again = Decoder(role)
                again.receive_data(encode_bytes(msg))
                assert _same(again.next_event(), msg), msg  # re-encoding is faithful
        dec.receive_eof()
        dec.next_event()
    except pp.RemoteProtocolError:
        pass
    except pp.LocalProtocolError as e:  # only "does not fit": the caller fed too much at once
        assert "do not fit" in str(e)
    return n


# --- target 2: a memserver connection after a real handshake ---------------------------------


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closed = False

    def writelines(self, parts) -> None:
        self.out += [bytes(p) for p in parts]

    def write(self, data) -> None:
        self.out.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        return ("fuzz", 0) if name == "peername" else default


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_LOOP: asyncio.AbstractEventLoop | None = None
_SERVER: MemServer | None = None
_ERRORS = _Errors()
logging.getLogger("duvm.memserver").addHandler(_ERRORS)  # every memserver module
_LOGIN = (
    encode_bytes(pp.Hello(1, "fuzz"))
    + encode_bytes(pp.Auth(2, bytes(32)))
    + encode_bytes(pp.Reserve(3, 8))
)


def _server() -> tuple[asyncio.AbstractEventLoop, MemServer]:
    global _LOOP, _SERVER
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        _SERVER = MemServer(16 * pp.PAGE_SIZE, lease_s=0.001, lock=False)
    return _LOOP, _SERVER  # type: ignore[return-value]


def fuzz_memserver_conn(data: bytes, chunk: int = 4096, login: bool = True) -> None:
    """Feed `data` to one memserver connection (after HELLO/AUTH/RESERVE when `login`)."""
    loop, server = _server()

    async def run() -> None:
        conn = Connection(server)
        t = _Transport()
        conn.connection_made(t)
        before = len(_ERRORS.records)
        stream = (_LOGIN if login else b"") + data
        i = 0
        while i < len(stream) and not t.closed:
            buf = conn.get_buffer(-1)
            n = min(len(buf), max(1, chunk), len(stream) - i)
            buf[:n] = stream[i : i + n]
            conn.buffer_updated(n)
            i += n
        conn.connection_lost(None)
        assert len(_ERRORS.records) == before, _ERRORS.records[-1].getMessage()
        st = server.store
        used = sum(len(ns.pages) for ns in st.namespaces.values())
        assert st.arena.used_slots == used  # no slot leaked or shared
        assert all(len(ns.pages) <= ns.reserved for ns in st.namespaces.values())
        assert st.reserved_total == sum(ns.reserved for ns in st.namespaces.values())
        assert st.reserved_total <= st.capacity_pages

    loop.run_until_complete(run())
    loop.run_until_complete(asyncio.sleep(0.002))  # let the lease expire: no namespace piles up


# --- targets 3 and 4: NBD --------------------------------------------------------------------

EXPORT = ExportInfo("", 1 << 20, C.FLAG_HAS_FLAGS | C.FLAG_SEND_FLUSH | C.FLAG_SEND_TRIM)


def fuzz_nbd_handshake(data: bytes, chunk: int = 64) -> None:
    hs = Handshake([EXPORT])
    try:
        for i in range(0, len(data), max(1, chunk)):
            if hs.state.value in ("transmission", "closed"):
                break
            hs.receive_data(data[i : i + max(1, chunk)])
            hs.data_to_send()
    except NbdProtocolError:
        return


def fuzz_nbd_transmission(data: bytes, chunk: int = 4096) -> None:
    dec = TransmissionDecoder(EXPORT, buffer_size=8192)
    try:
        for i in range(0, len(data), max(1, chunk)):
            dec.receive_data(data[i : i + max(1, chunk)])
            while (req := dec.next_request()) is not None:
                assert (req.offset >= 0 and req.offset + req.length <= EXPORT.size) or req.error
    except NbdProtocolError:
        return


TARGETS = {
    "page_decoder_server": lambda d, c: fuzz_page_decoder(d, "server", c),
    "page_decoder_client": lambda d, c: fuzz_page_decoder(d, "client", c),
    "memserver_conn": fuzz_memserver_conn,
    "memserver_conn_unauthenticated": lambda d, c: fuzz_memserver_conn(d, c, False),
    "nbd_handshake": fuzz_nbd_handshake,
    "nbd_transmission": fuzz_nbd_transmission,
}


# --- inputs: raw bytes, and valid frames spliced and mutated (to get past the headers) ------

_keys = st.lists(st.integers(0, 20), min_size=1, max_size=6)
_page_frames = st.one_of(
    st.builds(
        lambda r, k: encode_bytes(pp.make_store(r, k, bytes(len(k) * pp.PAGE_SIZE))),
        st.integers(0, 2**64 - 1),
        _keys,
    ),
    st.builds(lambda r, k: encode_bytes(pp.make_load(r, k)), st.integers(0, 9), _keys),
    st.builds(lambda r, k: encode_bytes(pp.make_free(r, k)), st.integers(0, 9), _keys),
    st.builds(lambda r, n: encode_bytes(pp.Reserve(r, n)), st.integers(0, 9), st.integers(0, 40)),
    st.builds(lambda r: encode_bytes(pp.Release(r)), st.integers(0, 9)),
    st.builds(lambda r: encode_bytes(pp.Status(r)), st.integers(0, 9)),
    st.builds(lambda i: encode_bytes(pp.Hello(1, i)), st.text(min_size=1, max_size=8)),
    st.builds(lambda p: encode_bytes(pp.Auth(2, p)), st.binary(min_size=32, max_size=32)),
    st.builds(lambda r, e: encode_bytes(pp.Fence(r, e)), st.integers(0, 9), st.integers(1, 3)),
    st.builds(  # FENCE bodies of any length, epoch 0, reserved bits (answered INVALID)
        lambda r, b: pp.HEADER.pack(pp.MAGIC, pp.MsgType.FENCE, 0, r, 0, len(b)) + b,
        st.integers(0, 9),
        st.binary(max_size=24),
    ),
    st.binary(max_size=64),
)


@st.composite
def page_streams(draw) -> bytes:
    stream = bytearray(b"".join(draw(st.lists(_page_frames, max_size=6))))
    for _ in range(draw(st.integers(0, 3))):  # flip a few bytes: headers, counts, lengths
        if stream:
            i = draw(st.integers(0, len(stream) - 1))
            stream[i] = draw(st.integers(0, 255))
    return bytes(stream)


def _nbd_request(cmd: int, offset: int, length: int, flags: int = 0) -> bytes:
    return struct.pack(">IHHQQI", C.REQUEST_MAGIC, flags, cmd, 7, offset, length)


_nbd_frames = st.one_of(
    st.builds(
        lambda c, o, n, f: _nbd_request(c, o, n, f),
        st.integers(0, 9),
        st.integers(0, 2**20 + 8192),
        st.integers(0, 3 * 4096),
        st.integers(0, 3),
    ),
    st.binary(max_size=64),
)


@pytest.mark.parametrize("role", ["server", "client"])
@FUZZ
@given(data=page_streams(), chunk=st.integers(1, 5000))
def test_fuzz_page_decoder(role: str, data: bytes, chunk: int) -> None:
    fuzz_page_decoder(data, role, chunk)


@FUZZ
@given(data=page_streams(), chunk=st.integers(1, 9000), login=st.booleans())
def test_fuzz_memserver_connection(data: bytes, chunk: int, login: bool) -> None:
    fuzz_memserver_conn(data, chunk, login)


@FUZZ
@given(data=st.binary(max_size=600), chunk=st.integers(1, 200), prefix=st.booleans())
def test_fuzz_nbd_handshake(data: bytes, chunk: int, prefix: bool) -> None:
    fuzz_nbd_handshake(
        (struct.pack(">I", C.FLAG_C_FIXED_NEWSTYLE) if prefix else b"") + data, chunk
    )


@FUZZ
@given(data=st.lists(_nbd_frames, max_size=8).map(b"".join), chunk=st.integers(1, 5000))
def test_fuzz_nbd_transmission(data: bytes, chunk: int) -> None:
    fuzz_nbd_transmission(data, chunk)


def test_targets_catch_a_planted_bug() -> None:
    """The harness can fail: a decoder that raises something else is reported."""
    orig = Decoder.next_event

    def broken(self):
        raise ValueError("planted")

    Decoder.next_event = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(ValueError, match="planted"):
            fuzz_page_decoder(encode_bytes(pp.Status(1)))
    finally:
        Decoder.next_event = orig  # type: ignore[method-assign]
