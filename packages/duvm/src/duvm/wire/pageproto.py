"""The duvm page protocol: a sans-io codec between memserver clients and memservers.

Theory of operation (the wire format itself is specified in docs/protocol.md):

- Nothing here opens a socket. Bytes go in (`Decoder.get_buffer`/`buffer_updated`, the
  zero-copy path asyncio's BufferedProtocol drives, or `Decoder.receive_data` for plain bytes),
  messages come out (`Decoder.next_event()` returns a message or `NEED_DATA`), and messages turn
  into bytes with `encode(msg)` (a list of buffers for `transport.writelines`, so page data is
  never joined into a new bytes object on the send side).
- Every frame is a fixed 24-byte little-endian header (magic, type, flags, request id, status,
  payload length) and a payload. The header alone decides how many bytes the frame has, so a
  frame larger than the negotiated limit is refused before its payload is buffered: a peer can
  make the decoder hold at most one frame.
- The receive buffer is one preallocated bytearray. Decoded STORE requests and LOAD replies
  carry memoryviews into it ("borrowed" data): they stay valid until the next `get_buffer` or
  `receive_data` call, which is when the buffer may be compacted. Servers copy page data
  straight from there into arena slots, clients straight into the caller's buffer.
- Version 2 opens every connection with a mutual challenge-response (HELLO, its CHALLENGE
  reply, AUTH, its WELCOME reply carrying the namespace state; see duvm.wire.auth). The codec only
  frames the fields; the proofs are computed and checked by the endpoints. A version-1 HELLO
  (no nonce) still decodes, so a server can answer an old client with a VERSION refusal.
- Two error kinds, as in h11: `LocalProtocolError` means this side misused the API (building a
  message with bad fields, feeding more bytes than fit); `RemoteProtocolError` means the peer
  sent something the protocol forbids. The right reaction to the latter is to close that one
  connection. Requests the server refuses for a reason (full, absent page, bad version) are not
  protocol errors: they are `ErrorReply` messages carrying an `ErrorCode`.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

PAGE_SIZE: Final = 4096
MAGIC: Final = 0x4D565544  # b"DUVM" as a little-endian u32
PROTOCOL_VERSION: Final = 2
MIN_VERSION: Final = 2  # oldest version this codec speaks (1 had no authentication)
NONCE_SIZE: Final = 32
KEY_ID_SIZE: Final = 8
PROOF_SIZE: Final = 32
TOKEN_SIZE: Final = 32

HEADER = struct.Struct("<IHHQII")  # magic, type, flags, request id, status, payload length
HEADER_SIZE: Final = HEADER.size  # 24
REPLY_BIT: Final = 0x8000

MAX_BATCH: Final = 1024  # pages per STORE/LOAD/FREE
MAX_CLIENT_ID: Final = 255  # bytes of UTF-8
MAX_ERROR_MESSAGE: Final = 1024  # bytes of UTF-8
MAX_STATUS: Final = 1 << 20  # bytes of JSON in a STATUS reply
_BATCH_HEAD = struct.Struct("<II")  # count, reserved (0)
# The largest frame either side ever needs: a STORE of MAX_BATCH pages.
MAX_FRAME: Final = HEADER_SIZE + _BATCH_HEAD.size + MAX_BATCH * (8 + PAGE_SIZE)


class MsgType(IntEnum):
    HELLO = 1
    RESERVE = 2
    RELEASE = 3
    STORE = 4
    LOAD = 5
    FREE = 6
    STATUS = 7
    AUTH = 8


class ErrorCode(IntEnum):
    """Reply status values. 0 is success; each refusal maps to one errno in `to_errno`."""

    OK = 0
    INVALID = 1  # a field is out of range (count 0, reservation too large, ...)
    NO_SPACE = 2  # the namespace's reservation or the arena cannot take it
    NOT_FOUND = 3  # LOAD of a page the namespace does not hold
    VERSION = 4  # no protocol version both sides speak
    BUSY = 5  # RESERVE would shrink below the pages stored
    INTERNAL = 6  # the server failed; the request had no effect
    AUTH = 7  # authentication failed or is required (the connection then closes)
    DENIED = 8  # the namespace belongs to another client (its token differs)

    def to_errno(self) -> int:
        return _ERRNO[self]


_ERRNO = {
    ErrorCode.OK: 0,
    ErrorCode.INVALID: errno.EINVAL,
    ErrorCode.NO_SPACE: errno.ENOSPC,
    ErrorCode.NOT_FOUND: errno.ENOENT,
    ErrorCode.VERSION: errno.EPROTONOSUPPORT,
    ErrorCode.BUSY: errno.EBUSY,
    ErrorCode.INTERNAL: errno.EIO,
    ErrorCode.AUTH: errno.EACCES,
    ErrorCode.DENIED: errno.EPERM,
}


class ProtocolError(Exception):
    """Base of the two codec error kinds."""


class LocalProtocolError(ProtocolError):
    """This side misused the codec (bad message fields, too much data fed at once)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; close this connection (and only this one)."""


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


def keys_tuple(keys: Iterable[int]) -> tuple[int, ...]:
    """Page keys as a tuple of ints in [0, 2**64); LocalProtocolError otherwise."""
    t = keys if type(keys) is tuple else tuple(keys)
    if t and not all(type(k) is int and 0 <= k < 1 << 64 for k in t):  # bool is no key
        raise LocalProtocolError("page keys must be integers in [0, 2**64)")
    return t


_STRUCTS: dict[int, struct.Struct] = {}


def _batch_struct(n: int) -> struct.Struct:
    """Header, count, reserved and n keys in one Struct (cached per n; n <= MAX_BATCH)."""
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<IHHQIIII{n}Q")
    return st


def _keys_struct(n: int) -> struct.Struct:
    st = _STRUCTS.get(-n)
    if st is None:
        st = _STRUCTS[-n] = struct.Struct(f"<{n}Q")
    return st


def _check_count(n: int, what: str, error: type[ProtocolError]) -> None:
    if not 1 <= n <= MAX_BATCH:
        raise error(f"{what} carries {n} pages; allowed 1..{MAX_BATCH}")


# --- messages -------------------------------------------------------------------------------


def _check_bytes(value: bytes, size: int, name: str) -> None:
    if type(value) is not bytes or len(value) != size:
        raise LocalProtocolError(f"{name} must be {size} bytes")


@dataclass(frozen=True, slots=True)
class Hello:
    """First request on a connection: which versions the client speaks, whose pages it means,
    its challenge nonce, the key id of the secret it proves itself with (zeros: none) and the
    namespace token that owns `client_id` on this server. `nonce` is b"" only in a decoded
    version-1 HELLO (answered with a VERSION refusal)."""

    req_id: int
    client_id: str
    min_version: int = MIN_VERSION
    max_version: int = PROTOCOL_VERSION
    nonce: bytes = field(default=bytes(NONCE_SIZE), repr=False)
    key_id: bytes = bytes(KEY_ID_SIZE)
    token: bytes = field(default=bytes(TOKEN_SIZE), repr=False)

    def __post_init__(self) -> None:
        if self.nonce or self.max_version >= 2:
            _check_bytes(self.nonce, NONCE_SIZE, "nonce")
            _check_bytes(self.key_id, KEY_ID_SIZE, "key id")
            _check_bytes(self.token, TOKEN_SIZE, "namespace token")
        try:
            raw = self.client_id.encode("utf-8")
        except UnicodeEncodeError:
            raise LocalProtocolError("client id is not encodable as UTF-8") from None
        if not 1 <= len(raw) <= MAX_CLIENT_ID:
            raise LocalProtocolError(f"client id must be 1..{MAX_CLIENT_ID} UTF-8 bytes")
        if not 1 <= self.min_version <= self.max_version <= 0xFFFF:
            raise LocalProtocolError("need 1 <= min_version <= max_version <= 65535")


@dataclass(frozen=True, slots=True)
class Challenge:
    """The reply to HELLO: the chosen version, the server's nonce and its proof (all zeros and
    `auth_required` False when the server has no secret)."""

    req_id: int
    version: int
    auth_required: bool
    nonce: bytes = field(repr=False)
    key_id: bytes
    proof: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_bytes(self.nonce, NONCE_SIZE, "nonce")
        _check_bytes(self.key_id, KEY_ID_SIZE, "key id")
        _check_bytes(self.proof, PROOF_SIZE, "proof")


@dataclass(frozen=True, slots=True)
class Auth:
    """The client's proof, answering the CHALLENGE (zeros when neither side has a secret)."""

    req_id: int
    proof: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_bytes(self.proof, PROOF_SIZE, "proof")


@dataclass(frozen=True, slots=True)
class HelloReply:
    """The reply to AUTH ("welcome"): the connection is authenticated and joined its namespace."""

    req_id: int
    version: int
    resumed: bool  # the namespace existed (a reconnect within its lease)
    lease_ms: int
    max_frame: int
    max_batch: int
    capacity_pages: int
    reserved_pages: int  # this namespace's reservation
    stored_pages: int  # pages this namespace holds


@dataclass(frozen=True, slots=True)
class Reserve:
    """Set this namespace's reservation to `pages` (absolute, so a retry is harmless)."""

    req_id: int
    pages: int

    def __post_init__(self) -> None:
        if not 0 <= self.pages < 1 << 63:
            raise LocalProtocolError("reservation must be in [0, 2**63) pages")


@dataclass(frozen=True, slots=True)
class ReserveReply:
    req_id: int
    reserved_pages: int
    stored_pages: int


@dataclass(frozen=True, slots=True)
class Release:
    """Free every page and the reservation of this namespace."""

    req_id: int


@dataclass(frozen=True, slots=True)
class ReleaseReply:
    req_id: int
    freed_pages: int


@dataclass(frozen=True, slots=True)
class Store:
    """Store `len(keys)` pages; `data` holds them back to back, PAGE_SIZE bytes each."""

    req_id: int
    keys: tuple[int, ...]
    data: memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_count(len(self.keys), "STORE", LocalProtocolError)
        if self.data.nbytes != len(self.keys) * PAGE_SIZE:
            raise LocalProtocolError(
                f"STORE of {len(self.keys)} pages needs {len(self.keys) * PAGE_SIZE} bytes, "
                f"got {self.data.nbytes}"
            )


@dataclass(frozen=True, slots=True)
class StoreReply:
    req_id: int


@dataclass(frozen=True, slots=True)
class Load:
    req_id: int
    keys: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_count(len(self.keys), "LOAD", LocalProtocolError)


@dataclass(frozen=True, slots=True)
class LoadReply:
    """The pages asked for, in request order; `data` is borrowed from the receive buffer."""

    req_id: int
    data: memoryview = field(repr=False)


@dataclass(frozen=True, slots=True)
class Free:
    req_id: int
    keys: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_count(len(self.keys), "FREE", LocalProtocolError)


@dataclass(frozen=True, slots=True)
class FreeReply:
    req_id: int
    freed: int  # how many of the keys were present


@dataclass(frozen=True, slots=True)
class Status:
    req_id: int


@dataclass(frozen=True, slots=True)
class StatusReply:
    req_id: int
    json: bytes  # UTF-8 JSON object, fields in docs/protocol.md


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A refused request. `type` is the request's type; the request had no effect."""

    req_id: int
    type: MsgType
    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        if self.code == ErrorCode.OK:
            raise LocalProtocolError("an error reply needs a non-zero code")


Request = Hello | Auth | Reserve | Release | Store | Load | Free | Status
Reply = (
    Challenge
    | HelloReply
    | ReserveReply
    | ReleaseReply
    | StoreReply
    | LoadReply
    | FreeReply
    | StatusReply
    | ErrorReply
)
Message = Request | Reply


def make_store(req_id: int, keys: Iterable[int], data: bytes | bytearray | memoryview) -> Store:
    """Build a STORE, converting keys to a tuple and data to a byte memoryview."""
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return Store(req_id, keys_tuple(keys), mv)


def make_load(req_id: int, keys: Iterable[int]) -> Load:
    return Load(req_id, keys_tuple(keys))


def make_free(req_id: int, keys: Iterable[int]) -> Free:
    return Free(req_id, keys_tuple(keys))


# --- encoding -------------------------------------------------------------------------------

_HELLO = struct.Struct("<HHHH")  # min version, max version, client id length, reserved
_HELLO_V2_TAIL = NONCE_SIZE + KEY_ID_SIZE + TOKEN_SIZE  # after the client id
_CHALLENGE = struct.Struct(f"<HHI{NONCE_SIZE}s{KEY_ID_SIZE}s{PROOF_SIZE}s")  # version, flags,
# reserved, nonce, key id, proof
AUTH_REQUIRED: Final = 1
_HELLO_REPLY = struct.Struct("<HHIIIQQQ")  # version, flags, lease ms, max frame, max batch,
# capacity pages, reserved pages, stored pages
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
_FREE_REPLY = struct.Struct("<II")
RESUMED: Final = 1


def frame_header(mtype: int, req_id: int, length: int, status: int = 0) -> bytes:
    """A frame header (hot paths build replies with this, without message objects)."""
    return HEADER.pack(MAGIC, mtype, 0, req_id, status, length)


def batch_prefix(mtype: int, req_id: int, keys: Sequence[int]) -> bytes:
    """Header, count and keys of a STORE, LOAD or FREE (a STORE's page data follows).
    Callers guarantee 1 <= len(keys) <= MAX_BATCH and keys in range (see keys_tuple)."""
    n = len(keys)
    length = 8 + n * (8 + PAGE_SIZE) if mtype == MsgType.STORE else 8 + n * 8
    try:
        return _batch_struct(n).pack(MAGIC, mtype, 0, req_id, 0, length, n, 0, *keys)
    except struct.error as e:
        raise LocalProtocolError(f"bad page keys: {e}") from None


def encode(msg: Message) -> list[bytes | memoryview]:
    """Frame `msg` as a list of buffers to write in order (page data is not copied)."""
    match msg:
        case Store(req_id, keys, data):
            return [batch_prefix(MsgType.STORE, req_id, keys), data]
        case Load(req_id, keys):
            return [batch_prefix(MsgType.LOAD, req_id, keys)]
        case Free(req_id, keys):
            return [batch_prefix(MsgType.FREE, req_id, keys)]
        case LoadReply(req_id, data):
            return [frame_header(MsgType.LOAD | REPLY_BIT, req_id, data.nbytes), data]
        case StoreReply(req_id):
            return [frame_header(MsgType.STORE | REPLY_BIT, req_id, 0)]
        case FreeReply(req_id, freed):
            return [frame_header(MsgType.FREE | REPLY_BIT, req_id, 8) + _FREE_REPLY.pack(freed, 0)]
        case Hello(req_id, client_id, lo, hi, nonce, kid, token):
            raw = client_id.encode("utf-8")
            body = _HELLO.pack(lo, hi, len(raw), 0) + raw
            if nonce:
                body += nonce + kid + token
            return [frame_header(MsgType.HELLO, req_id, len(body)) + body]
        case Challenge(req_id, version, required, nonce, kid, proof):
            body = _CHALLENGE.pack(version, AUTH_REQUIRED if required else 0, 0, nonce, kid, proof)
            return [frame_header(MsgType.HELLO | REPLY_BIT, req_id, len(body)) + body]
        case Auth(req_id, proof):
            return [frame_header(MsgType.AUTH, req_id, len(proof)) + proof]
        case HelloReply():
            body = _HELLO_REPLY.pack(
                msg.version,
                RESUMED if msg.resumed else 0,
                msg.lease_ms,
                msg.max_frame,
                msg.max_batch,
                msg.capacity_pages,
                msg.reserved_pages,
                msg.stored_pages,
            )
            return [frame_header(MsgType.AUTH | REPLY_BIT, msg.req_id, len(body)) + body]
        case Reserve(req_id, pages):
            return [frame_header(MsgType.RESERVE, req_id, 8) + _U64.pack(pages)]
        case ReserveReply(req_id, reserved, stored):
            body = _U64X2.pack(reserved, stored)
            return [frame_header(MsgType.RESERVE | REPLY_BIT, req_id, 16) + body]
        case Release(req_id):
            return [frame_header(MsgType.RELEASE, req_id, 0)]
        case ReleaseReply(req_id, freed):
            return [frame_header(MsgType.RELEASE | REPLY_BIT, req_id, 8) + _U64.pack(freed)]
        case Status(req_id):
            return [frame_header(MsgType.STATUS, req_id, 0)]
        case StatusReply(req_id, body):
            if len(body) > MAX_STATUS:
                raise LocalProtocolError(f"STATUS reply over {MAX_STATUS} bytes")
            return [frame_header(MsgType.STATUS | REPLY_BIT, req_id, len(body)) + body]
        case ErrorReply(req_id, mtype, code, message):
            raw = message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE]
            return [frame_header(mtype | REPLY_BIT, req_id, len(raw), code) + raw]
    raise LocalProtocolError(f"not a page protocol message: {msg!r}")


def encode_bytes(msg: Message) -> bytes:
    """`encode` joined into one bytes object (tests, small messages)."""
    return b"".join(bytes(part) for part in encode(msg))


# --- decoding -------------------------------------------------------------------------------


_REQUEST_LIMITS = {
    MsgType.HELLO: _HELLO.size + MAX_CLIENT_ID + _HELLO_V2_TAIL,
    MsgType.AUTH: PROOF_SIZE,
    MsgType.RESERVE: 8,
    MsgType.RELEASE: 0,
    MsgType.STORE: 8 + MAX_BATCH * (8 + PAGE_SIZE),
    MsgType.LOAD: 8 + MAX_BATCH * 8,
    MsgType.FREE: 8 + MAX_BATCH * 8,
    MsgType.STATUS: 0,
}
_REPLY_LIMITS = {
    MsgType.HELLO: _CHALLENGE.size,
    MsgType.AUTH: _HELLO_REPLY.size,
    MsgType.RESERVE: 16,
    MsgType.RELEASE: 8,
    MsgType.STORE: 0,
    MsgType.LOAD: MAX_BATCH * PAGE_SIZE,
    MsgType.FREE: 8,
    MsgType.STATUS: MAX_STATUS,
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
        if not HEADER_SIZE + _CHALLENGE.size <= max_frame <= MAX_FRAME:
            raise LocalProtocolError(
                f"max_frame must be in [{HEADER_SIZE + _CHALLENGE.size}, {MAX_FRAME}]"
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
    if body.nbytes < _BATCH_HEAD.size:
        raise RemoteProtocolError(f"{name} payload too short for its count")
    n, reserved = _BATCH_HEAD.unpack_from(body)
    _check_count(n, name, RemoteProtocolError)
    if reserved:
        raise RemoteProtocolError(f"{name} reserved field is {reserved}, expected 0")
    end = 8 + 8 * n
    if mtype == MsgType.STORE:
        _expect(body, end + n * PAGE_SIZE, name)
        return _keys_struct(n).unpack_from(body, 8), body[end:]
    _expect(body, end, name)
    return _keys_struct(n).unpack_from(body, 8), None


def _d_hello(req_id: int, body: memoryview) -> Hello:
    if body.nbytes < _HELLO.size:
        raise RemoteProtocolError("HELLO payload too short")
    lo, hi, idlen, reserved = _HELLO.unpack_from(body)
    end = _HELLO.size + idlen
    if body.nbytes != end + _HELLO_V2_TAIL:  # else a version-1 HELLO: the id alone
        _expect(body, end, "HELLO")
    if reserved:
        raise RemoteProtocolError("HELLO reserved field is not 0")
    try:
        client_id = bytes(body[_HELLO.size : end]).decode("utf-8")
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
    _expect(body, _CHALLENGE.size, "HELLO reply")
    version, flags, reserved, nonce, kid, proof = _CHALLENGE.unpack(body)
    if flags & ~AUTH_REQUIRED or reserved:
        raise RemoteProtocolError(f"HELLO reply has unknown flags 0x{flags:x}")
    return Challenge(req_id, version, bool(flags & AUTH_REQUIRED), nonce, kid, proof)


def _d_reserve(req_id: int, body: memoryview) -> Reserve:
    _expect(body, 8, "RESERVE")
    try:
        return Reserve(req_id, _U64.unpack(body)[0])
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
    _expect(body, _HELLO_REPLY.size, "AUTH reply")
    version, flags, lease, max_frame, max_batch, cap, res, stored = _HELLO_REPLY.unpack(body)
    if flags & ~RESUMED:
        raise RemoteProtocolError(f"AUTH reply has unknown flags 0x{flags:x}")
    return HelloReply(
        req_id, version, bool(flags & RESUMED), lease, max_frame, max_batch, cap, res, stored
    )


def _d_reserve_reply(req_id: int, body: memoryview) -> ReserveReply:
    _expect(body, 16, "RESERVE reply")
    return ReserveReply(req_id, *_U64X2.unpack(body))


def _d_release_reply(req_id: int, body: memoryview) -> ReleaseReply:
    _expect(body, 8, "RELEASE reply")
    return ReleaseReply(req_id, _U64.unpack(body)[0])


def _d_store_reply(req_id: int, body: memoryview) -> StoreReply:
    _expect(body, 0, "STORE reply")
    return StoreReply(req_id)


def _d_load_reply(req_id: int, body: memoryview) -> LoadReply:
    if body.nbytes == 0 or body.nbytes % PAGE_SIZE:
        raise RemoteProtocolError(f"LOAD reply of {body.nbytes} bytes is not whole pages")
    return LoadReply(req_id, body)


def _d_free_reply(req_id: int, body: memoryview) -> FreeReply:
    _expect(body, 8, "FREE reply")
    return FreeReply(req_id, _FREE_REPLY.unpack(body)[0])


def _d_status_reply(req_id: int, body: memoryview) -> StatusReply:
    return StatusReply(req_id, bytes(body))


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
}
