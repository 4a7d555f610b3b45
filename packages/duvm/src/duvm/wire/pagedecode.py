"""Received bytes as page protocol messages (the decoder; the format is in docs/protocol.md).

- Bytes go in through `Decoder.get_buffer`/`buffer_updated` (the zero-copy path asyncio's
  BufferedProtocol drives) or `Decoder.receive_data` (plain bytes); `Decoder.next_event()`
  returns a message or `NEED_DATA`. `next_frame` and `decode_frame` are its two halves, so a
  hot path can serve a frame without building a message (`parse_batch` reads a batch's keys).
- A frame larger than the limit of its type, or than the decoder's `max_frame`, is refused
  from its header, before its payload is buffered: a peer can make the decoder hold at most
  one frame.
- The receive buffer is one preallocated bytearray. Decoded STORE requests and LOAD replies
  carry memoryviews into it ("borrowed" data): they stay valid until the next `get_buffer` or
  `receive_data` call, which is when the buffer may be compacted. Servers copy page data
  straight from there into arena slots, clients straight into the caller's buffer.
"""

from __future__ import annotations

import struct
from typing import Final

from duvm.wire.pageproto import (
    AUTH_REQUIRED,
    BATCH_HEAD,
    CHALLENGE_BODY,
    FENCE_BODY,
    FREE_REPLY_BODY,
    HEADER,
    HEADER_SIZE,
    HELLO_HEAD,
    HELLO_REPLY_BODY,
    HELLO_V2_TAIL,
    KEY_ID_SIZE,
    MAGIC,
    MAX_BATCH,
    MAX_CLIENT_ID,
    MAX_ERROR_MESSAGE,
    MAX_FRAME,
    MAX_STATUS,
    NONCE_SIZE,
    PAGE_SIZE,
    PROOF_SIZE,
    RDMA_MAP_REPLY_BODY,
    RDMA_OPEN_BODY,
    RDMA_OPEN_REPLY_BODY,
    REPLY_BIT,
    RESUMED,
    U64,
    U64X2,
    Auth,
    Challenge,
    ErrorCode,
    ErrorReply,
    Fence,
    FenceReply,
    Free,
    FreeReply,
    Hello,
    HelloReply,
    InvalidRequest,
    Load,
    LoadReply,
    LocalProtocolError,
    Message,
    MsgType,
    RdmaMap,
    RdmaMapReply,
    RdmaOpen,
    RdmaOpenReply,
    Release,
    ReleaseReply,
    RemoteProtocolError,
    Reserve,
    ReserveReply,
    Status,
    StatusReply,
    Store,
    StoreReply,
    check_count,
)


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


_STRUCTS: dict[int, struct.Struct] = {}


def _keys_struct(n: int) -> struct.Struct:
    """n page keys (cached per n; n <= MAX_BATCH)."""
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<{n}Q")
    return st


_REQUEST_LIMITS = {
    MsgType.HELLO: HELLO_HEAD.size + MAX_CLIENT_ID + HELLO_V2_TAIL,
    MsgType.AUTH: PROOF_SIZE,
    MsgType.RESERVE: 8,
    MsgType.RELEASE: 0,
    MsgType.STORE: 8 + MAX_BATCH * (8 + PAGE_SIZE),
    MsgType.LOAD: 8 + MAX_BATCH * 8,
    MsgType.FREE: 8 + MAX_BATCH * 8,
    MsgType.STATUS: 0,
    MsgType.RDMA_OPEN: RDMA_OPEN_BODY.size,
    MsgType.RDMA_MAP: 8,
    MsgType.FENCE: FENCE_BODY.size,
}
_REPLY_LIMITS = {
    MsgType.HELLO: CHALLENGE_BODY.size,
    MsgType.AUTH: HELLO_REPLY_BODY.size,
    MsgType.RESERVE: 16,
    MsgType.RELEASE: 8,
    MsgType.STORE: 0,
    MsgType.LOAD: MAX_BATCH * PAGE_SIZE,
    MsgType.FREE: 8,
    MsgType.STATUS: MAX_STATUS,
    MsgType.RDMA_OPEN: RDMA_OPEN_REPLY_BODY.size,
    MsgType.RDMA_MAP: RDMA_MAP_REPLY_BODY.size,
    MsgType.FENCE: FENCE_BODY.size,
}


# The largest handshake request (HELLO): a server decodes with a buffer this small until the
# peer has authenticated, so an unauthenticated connection costs ~1 KiB, not a frame's 4 MiB.
HANDSHAKE_FRAME: Final = 512
assert HEADER_SIZE + _REQUEST_LIMITS[MsgType.HELLO] <= HANDSHAKE_FRAME


class Decoder:
    """Turns received bytes into messages. `role` is the side that owns this decoder:
    a "server" decodes requests, a "client" decodes replies. The buffer holds one frame of
    `max_frame` bytes plus `slack` bytes that let reads run ahead of decoding.
    """

    def __init__(self, role: str, max_frame: int = MAX_FRAME, slack: int = 256 << 10) -> None:
        if role not in ("server", "client"):
            raise LocalProtocolError(f"role must be 'server' or 'client', not {role!r}")
        if not HEADER_SIZE + CHALLENGE_BODY.size <= max_frame <= MAX_FRAME:
            raise LocalProtocolError(
                f"max_frame must be in [{HEADER_SIZE + CHALLENGE_BODY.size}, {MAX_FRAME}]"
            )
        self._replies = role == "client"
        self.max_frame = max_frame
        room = max_frame - HEADER_SIZE
        table = _REPLY_LIMITS if self._replies else _REQUEST_LIMITS
        bit = REPLY_BIT if self._replies else 0
        # frame type (as on the wire) -> largest payload accepted
        self._limits = {int(t) | bit: min(v, room) for t, v in table.items()}
        # One whole frame always fits after compaction; the slack lets reads run ahead.
        self._buf = bytearray(max_frame + max(0, slack))
        self._mv = memoryview(self._buf)
        self._whole = self._mv[:]
        self._start = 0  # first unconsumed byte
        self._end = 0  # one past the last received byte
        self._need = HEADER_SIZE  # bytes the frame at _start needs in total (when known)
        self._eof = False

    # --- input ---

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return self._end - self._start

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Free space to receive into (BufferedProtocol.get_buffer). Invalidates borrowed data."""
        start, end = self._start, self._end
        if start == end:
            if start:
                self._start = self._end = 0
            return self._whole
        buffered, tail = end - start, len(self._buf) - end
        # Compact when the frame in progress would not fit otherwise, or when the tail is
        # short and moving the few buffered bytes is cheap; never move a big frame needlessly.
        if tail < self._need - buffered or (tail < 65536 and buffered <= 65536):
            self._mv[:buffered] = self._mv[start:end]
            self._start, self._end = 0, buffered
            end = buffered
        return self._mv[end:]

    def buffer_updated(self, nbytes: int) -> None:
        if not 0 <= nbytes <= len(self._buf) - self._end:
            raise LocalProtocolError(f"buffer_updated({nbytes}) exceeds the space handed out")
        self._end += nbytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Copy `data` in. b"" means end of stream. Raises LocalProtocolError when the
        undecoded bytes would exceed the buffer: drain `next_event()` first."""
        if not data:
            self._eof = True
            return
        view = self.get_buffer()
        if len(data) > len(view):
            raise LocalProtocolError(
                f"{len(data)} bytes do not fit ({len(view)} free): call next_event() first"
            )
        view[: len(data)] = data
        self._end += len(data)

    def receive_eof(self) -> None:
        self._eof = True

    def window(self) -> tuple[bytearray, int, int]:
        """(buffer, start, end): the received bytes not decoded yet are buffer[start:end], for
        a loop that decodes frames itself (the memserver's compiled one); it hands back what
        it consumed with `consume`. Borrowed like a payload."""
        return self._buf, self._start, self._end

    def consume(self, start: int) -> None:
        """The bytes before `start` (whole frames, from `window`) were decoded elsewhere."""
        if not self._start <= start <= self._end:
            raise LocalProtocolError(f"consume({start}) outside [{self._start}, {self._end}]")
        if start != self._start:
            self._start = start
            self._need = HEADER_SIZE

    def limit(self, mtype: int) -> int | None:
        """The largest payload this decoder accepts for frame type `mtype` (as on the wire)."""
        return self._limits.get(mtype)

    def take_pending(self) -> bytes:
        """The received bytes not decoded yet, removed (to move them to a new decoder)."""
        rest = bytes(self._mv[self._start : self._end])
        self._start = self._end = 0
        self._need = HEADER_SIZE
        return rest

    # --- output ---

    def next_frame(self) -> tuple[int, int, int, memoryview] | _NeedData:
        """The next complete frame as (type as on the wire, request id, status, payload), or
        NEED_DATA. The header is fully validated (magic, type for this role, flags, status,
        payload length within the limit of its type); the payload is borrowed. Raises
        RemoteProtocolError on a bad header or a frame cut short by end of stream."""
        avail = self._end - self._start
        if avail < HEADER_SIZE:
            return self._need_data(avail)
        start = self._start
        magic, mtype, flags, req_id, status, length = HEADER.unpack_from(self._buf, start)
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
        limit = self._limits.get(mtype)
        if limit is None:
            side = "reply" if self._replies else "request"
            raise RemoteProtocolError(f"unexpected frame type 0x{mtype:04x} (expected a {side})")
        if flags:
            raise RemoteProtocolError(f"reserved flags set: 0x{flags:04x}")
        if status:
            if not self._replies:
                raise RemoteProtocolError("a request carries a non-zero status")
            if status not in _CODES:
                raise RemoteProtocolError(f"unknown error code {status}")
            limit = MAX_ERROR_MESSAGE
        if length > limit:
            name = MsgType(mtype & ~REPLY_BIT).name
            raise RemoteProtocolError(
                f"{name} frame of {length} payload bytes exceeds the limit {limit}"
            )
        total = HEADER_SIZE + length
        if avail < total:
            self._need = total
            return self._need_data(avail)
        self._need = HEADER_SIZE
        self._start = start + total
        return mtype, req_id, status, self._mv[start + HEADER_SIZE : start + total]

    def next_event(self) -> Message | _NeedData:
        """The next complete message, or NEED_DATA (see next_frame for errors)."""
        frame = self.next_frame()
        if frame is NEED_DATA:
            return NEED_DATA
        return decode_frame(*frame)  # type: ignore[misc]

    def _need_data(self, avail: int) -> _NeedData:
        if self._eof and avail:
            raise RemoteProtocolError(f"connection closed inside a frame ({avail} bytes pending)")
        return NEED_DATA


def _expect(body: memoryview, size: int, name: str) -> None:
    if body.nbytes != size:
        raise RemoteProtocolError(f"{name} payload is {body.nbytes} bytes, expected {size}")


def decode_frame(mtype: int, req_id: int, status: int, body: memoryview) -> Message:
    """A frame from `Decoder.next_frame` as a message (payload fields validated)."""
    if status:
        return ErrorReply(
            req_id,
            MsgType(mtype & ~REPLY_BIT),
            ErrorCode(status),
            bytes(body).decode("utf-8", "replace"),
        )
    return _DECODERS[mtype](req_id, body)


def parse_batch(mtype: int, body: memoryview) -> tuple[tuple[int, ...], memoryview | None]:
    """Keys (and, for STORE, the borrowed page data) of a STORE, LOAD or FREE payload."""
    name = _NAMES[mtype]
    if body.nbytes < BATCH_HEAD.size:
        raise RemoteProtocolError(f"{name} payload too short for its count")
    n, reserved = BATCH_HEAD.unpack_from(body)
    check_count(n, name, RemoteProtocolError)
    if reserved:
        raise RemoteProtocolError(f"{name} reserved field is {reserved}, expected 0")
    end = 8 + 8 * n
    if mtype == MsgType.STORE:
        _expect(body, end + n * PAGE_SIZE, name)
        return _keys_struct(n).unpack_from(body, 8), body[end:]
    _expect(body, end, name)
    return _keys_struct(n).unpack_from(body, 8), None


def _d_hello(req_id: int, body: memoryview) -> Hello:
    if body.nbytes < HELLO_HEAD.size:
        raise RemoteProtocolError("HELLO payload too short")
    lo, hi, idlen, reserved = HELLO_HEAD.unpack_from(body)
    end = HELLO_HEAD.size + idlen
    if body.nbytes != end + HELLO_V2_TAIL:  # else a version-1 HELLO: the id alone
        _expect(body, end, "HELLO")
    if reserved:
        raise RemoteProtocolError("HELLO reserved field is not 0")
    try:
        client_id = bytes(body[HELLO_HEAD.size : end]).decode("utf-8")
        if body.nbytes == end:
            if hi >= 2:
                raise LocalProtocolError("a version-2 HELLO needs a nonce, key id and token")
            return Hello(req_id, client_id, lo, hi, b"", b"", b"")
        tail = bytes(body[end:])
        return Hello(
            req_id,
            client_id,
            lo,
            hi,
            tail[:NONCE_SIZE],
            tail[NONCE_SIZE : NONCE_SIZE + KEY_ID_SIZE],
            tail[NONCE_SIZE + KEY_ID_SIZE :],
        )
    except (UnicodeDecodeError, LocalProtocolError) as e:
        raise RemoteProtocolError(f"bad HELLO: {e}") from None


def _d_auth(req_id: int, body: memoryview) -> Auth:
    _expect(body, PROOF_SIZE, "AUTH")
    return Auth(req_id, bytes(body))


def _d_challenge(req_id: int, body: memoryview) -> Challenge:
    _expect(body, CHALLENGE_BODY.size, "HELLO reply")
    version, flags, reserved, nonce, kid, proof = CHALLENGE_BODY.unpack(body)
    if flags & ~AUTH_REQUIRED or reserved:
        raise RemoteProtocolError(f"HELLO reply has unknown flags 0x{flags:x}")
    return Challenge(req_id, version, bool(flags & AUTH_REQUIRED), nonce, kid, proof)


def _d_reserve(req_id: int, body: memoryview) -> Reserve:
    _expect(body, 8, "RESERVE")
    try:
        return Reserve(req_id, U64.unpack(body)[0])
    except LocalProtocolError as e:
        raise RemoteProtocolError(str(e)) from None


def _d_release(req_id: int, body: memoryview) -> Release:
    _expect(body, 0, "RELEASE")
    return Release(req_id)


def _d_status(req_id: int, body: memoryview) -> Status:
    _expect(body, 0, "STATUS")
    return Status(req_id)


def _d_store(req_id: int, body: memoryview) -> Store:
    keys, data = parse_batch(MsgType.STORE, body)
    return Store(req_id, keys, data)  # type: ignore[arg-type]


def _d_load(req_id: int, body: memoryview) -> Load:
    return Load(req_id, parse_batch(MsgType.LOAD, body)[0])


def _d_free(req_id: int, body: memoryview) -> Free:
    return Free(req_id, parse_batch(MsgType.FREE, body)[0])


def _d_hello_reply(req_id: int, body: memoryview) -> HelloReply:
    _expect(body, HELLO_REPLY_BODY.size, "AUTH reply")
    version, flags, lease, max_frame, max_batch, cap, res, stored = HELLO_REPLY_BODY.unpack(body)
    if flags & ~RESUMED:
        raise RemoteProtocolError(f"AUTH reply has unknown flags 0x{flags:x}")
    return HelloReply(
        req_id, version, bool(flags & RESUMED), lease, max_frame, max_batch, cap, res, stored
    )


def _d_reserve_reply(req_id: int, body: memoryview) -> ReserveReply:
    _expect(body, 16, "RESERVE reply")
    return ReserveReply(req_id, *U64X2.unpack(body))


def _d_release_reply(req_id: int, body: memoryview) -> ReleaseReply:
    _expect(body, 8, "RELEASE reply")
    return ReleaseReply(req_id, U64.unpack(body)[0])


def _d_store_reply(req_id: int, body: memoryview) -> StoreReply:
    _expect(body, 0, "STORE reply")
    return StoreReply(req_id)


def _d_load_reply(req_id: int, body: memoryview) -> LoadReply:
    if body.nbytes == 0 or body.nbytes % PAGE_SIZE:
        raise RemoteProtocolError(f"LOAD reply of {body.nbytes} bytes is not whole pages")
    return LoadReply(req_id, body)


def _d_free_reply(req_id: int, body: memoryview) -> FreeReply:
    _expect(body, 8, "FREE reply")
    return FreeReply(req_id, FREE_REPLY_BODY.unpack(body)[0])


def _d_status_reply(req_id: int, body: memoryview) -> StatusReply:
    return StatusReply(req_id, bytes(body))


def _d_rdma_open(req_id: int, body: memoryview) -> RdmaOpen:
    _expect(body, RDMA_OPEN_BODY.size, "RDMA_OPEN")
    chunk_pages, reserved = RDMA_OPEN_BODY.unpack(body)
    if reserved:
        raise RemoteProtocolError(f"RDMA_OPEN reserved field is {reserved}, expected 0")
    try:
        return RdmaOpen(req_id, chunk_pages)
    except LocalProtocolError as e:
        raise RemoteProtocolError(str(e)) from None


def _d_rdma_open_reply(req_id: int, body: memoryview) -> RdmaOpenReply:
    _expect(body, RDMA_OPEN_REPLY_BODY.size, "RDMA_OPEN reply")
    port, reserved, depth, ticket = RDMA_OPEN_REPLY_BODY.unpack(body)
    if reserved:
        raise RemoteProtocolError(f"RDMA_OPEN reply reserved field is {reserved}, expected 0")
    return RdmaOpenReply(req_id, port, depth, ticket)


def _d_rdma_map(req_id: int, body: memoryview) -> RdmaMap:
    _expect(body, 8, "RDMA_MAP")
    return RdmaMap(req_id, U64.unpack(body)[0])


def _d_rdma_map_reply(req_id: int, body: memoryview) -> RdmaMapReply:
    _expect(body, RDMA_MAP_REPLY_BODY.size, "RDMA_MAP reply")
    return RdmaMapReply(req_id, *RDMA_MAP_REPLY_BODY.unpack(body))


def _d_fence(req_id: int, body: memoryview) -> Fence:
    """A bad FENCE (short, epoch 0, reserved fields set) is an `InvalidRequest`: the server
    answers it INVALID and keeps the connection (a longer one is refused from its header)."""
    if body.nbytes != FENCE_BODY.size:
        raise InvalidRequest(
            f"FENCE payload is {body.nbytes} bytes, expected {FENCE_BODY.size}",
            req_id,
            MsgType.FENCE,
        )
    epoch, r1, r2 = FENCE_BODY.unpack(body)
    if r1 or r2:
        raise InvalidRequest("FENCE reserved fields are not 0", req_id, MsgType.FENCE)
    if epoch == 0:
        raise InvalidRequest("FENCE epoch must be at least 1", req_id, MsgType.FENCE)
    return Fence(req_id, epoch)


def _d_fence_reply(req_id: int, body: memoryview) -> FenceReply:
    _expect(body, FENCE_BODY.size, "FENCE reply")
    epoch, r1, r2 = FENCE_BODY.unpack(body)
    if r1 or r2:
        raise RemoteProtocolError("FENCE reply reserved fields are not 0")
    return FenceReply(req_id, epoch)


_CODES = frozenset(int(c) for c in ErrorCode if c)
_NAMES = {int(t): t.name for t in MsgType}
_DECODERS = {
    MsgType.HELLO: _d_hello,
    MsgType.AUTH: _d_auth,
    MsgType.RESERVE: _d_reserve,
    MsgType.RELEASE: _d_release,
    MsgType.STORE: _d_store,
    MsgType.LOAD: _d_load,
    MsgType.FREE: _d_free,
    MsgType.STATUS: _d_status,
    MsgType.HELLO | REPLY_BIT: _d_challenge,
    MsgType.AUTH | REPLY_BIT: _d_hello_reply,
    MsgType.RESERVE | REPLY_BIT: _d_reserve_reply,
    MsgType.RELEASE | REPLY_BIT: _d_release_reply,
    MsgType.STORE | REPLY_BIT: _d_store_reply,
    MsgType.LOAD | REPLY_BIT: _d_load_reply,
    MsgType.FREE | REPLY_BIT: _d_free_reply,
    MsgType.STATUS | REPLY_BIT: _d_status_reply,
    MsgType.RDMA_OPEN: _d_rdma_open,
    MsgType.RDMA_MAP: _d_rdma_map,
    MsgType.RDMA_OPEN | REPLY_BIT: _d_rdma_open_reply,
    MsgType.RDMA_MAP | REPLY_BIT: _d_rdma_map_reply,
    MsgType.FENCE: _d_fence,
    MsgType.FENCE | REPLY_BIT: _d_fence_reply,
}
