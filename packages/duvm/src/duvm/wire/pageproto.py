"""The duvm page protocol between memserver clients and memservers: its constants, payload
layouts, message types, error codes and messages. The wire format itself is specified in
docs/protocol.md; `duvm.wire.pageencode` turns messages into bytes and `duvm.wire.pagedecode`
turns bytes into messages. Nothing in the three opens a socket (sans-io).

- Every frame is a fixed 24-byte little-endian header (magic, type, flags, request id, status,
  payload length) and a payload. The header alone decides how many bytes the frame has, so the
  decoder refuses a frame larger than the negotiated limit before buffering its payload.
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
from collections.abc import Iterable
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
BATCH_HEAD = struct.Struct("<II")  # count, reserved (0)
# The largest frame either side ever needs: a STORE of MAX_BATCH pages.
MAX_FRAME: Final = HEADER_SIZE + BATCH_HEAD.size + MAX_BATCH * (8 + PAGE_SIZE)

# Payload layouts (docs/protocol.md), shared by the encoder and the decoder.
HELLO_HEAD = struct.Struct("<HHHH")  # min version, max version, client id length, reserved
HELLO_V2_TAIL: Final = NONCE_SIZE + KEY_ID_SIZE + TOKEN_SIZE  # after the client id
CHALLENGE_BODY = struct.Struct(f"<HHI{NONCE_SIZE}s{KEY_ID_SIZE}s{PROOF_SIZE}s")  # version,
# flags, reserved, nonce, key id, proof
AUTH_REQUIRED: Final = 1
HELLO_REPLY_BODY = struct.Struct("<HHIIIQQQ")  # version, flags, lease ms, max frame,
# max batch, capacity pages, reserved pages, stored pages
RESUMED: Final = 1
U64 = struct.Struct("<Q")
U64X2 = struct.Struct("<QQ")
FREE_REPLY_BODY = struct.Struct("<II")  # freed, reserved (0)
RDMA_OPEN_BODY = struct.Struct("<II")  # chunk pages, reserved (0)
RDMA_OPEN_REPLY_BODY = struct.Struct(f"<HHI{NONCE_SIZE}s")  # rdma-cm port, reserved (0),
# RDMA READs the server takes in flight, ticket
RDMA_MAP_REPLY_BODY = struct.Struct("<QII")  # remote address, rkey, pages
FENCE_BODY = struct.Struct("<QII")  # epoch, reserved (0), reserved (0): FENCE and its reply
MAX_EPOCH: Final = (1 << 64) - 1
MAX_CHUNK_PAGES: Final = 1 << 20  # 4 GiB: the largest chunk an RDMA_OPEN may ask for


class MsgType(IntEnum):
    HELLO = 1
    RESERVE = 2
    RELEASE = 3
    STORE = 4
    LOAD = 5
    FREE = 6
    STATUS = 7
    AUTH = 8
    RDMA_OPEN = 9
    RDMA_MAP = 10
    FENCE = 11


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
    FENCED = 9  # a newer generation fenced the namespace: this connection may not change it

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
    ErrorCode.FENCED: errno.ESTALE,
}


class ProtocolError(Exception):
    """Base of the two codec error kinds."""


class LocalProtocolError(ProtocolError):
    """This side misused the codec (bad message fields, too much data fed at once)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; close this connection (and only this one)."""


class InvalidRequest(RemoteProtocolError):
    """A whole, well-framed request whose fields are out of range (a FENCE with epoch 0, a
    short body or reserved bits set). The frame is consumed, so a server may answer it with an
    INVALID `ErrorReply` and keep the connection; anything that treats it as the
    `RemoteProtocolError` it also is (closing the connection) stays correct."""

    def __init__(self, message: str, req_id: int, mtype: int) -> None:
        super().__init__(message)
        self.req_id = req_id
        self.type = mtype


def keys_tuple(keys: Iterable[int]) -> tuple[int, ...]:
    """Page keys as a tuple of ints in [0, 2**64); LocalProtocolError otherwise."""
    t = keys if type(keys) is tuple else tuple(keys)
    if t and not all(type(k) is int and 0 <= k < 1 << 64 for k in t):  # bool is no key
        raise LocalProtocolError("page keys must be integers in [0, 2**64)")
    return t


def check_count(n: int, what: str, error: type[ProtocolError]) -> None:
    """A batch of n pages is allowed (1..MAX_BATCH); `error` otherwise."""
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
        check_count(len(self.keys), "STORE", LocalProtocolError)
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
        check_count(len(self.keys), "LOAD", LocalProtocolError)


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
        check_count(len(self.keys), "FREE", LocalProtocolError)


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
class RdmaOpen:
    """Ask for an RDMA connection to this namespace's pages, addressed in chunks of
    `chunk_pages` consecutive keys (the daemon's slab). Only after authentication."""

    req_id: int
    chunk_pages: int

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_pages <= MAX_CHUNK_PAGES:
            raise LocalProtocolError(f"chunk pages must be in [1, {MAX_CHUNK_PAGES}]")


@dataclass(frozen=True, slots=True)
class RdmaOpenReply:
    """Where to connect with rdma-cm (the server's address, `port`) and the one-time `ticket`
    to send as the connect request's private data; `read_depth` RDMA READs in flight."""

    req_id: int
    port: int
    read_depth: int
    ticket: bytes = field(repr=False)

    def __post_init__(self) -> None:
        _check_bytes(self.ticket, NONCE_SIZE, "ticket")


@dataclass(frozen=True, slots=True)
class RdmaMap:
    """Give chunk `chunk` of this namespace its arena slots (idempotent) and say where."""

    req_id: int
    chunk: int

    def __post_init__(self) -> None:
        if not 0 <= self.chunk < 1 << 64:
            raise LocalProtocolError("chunk must be in [0, 2**64)")


@dataclass(frozen=True, slots=True)
class RdmaMapReply:
    """Chunk's `pages` slots start at remote `address`, reachable with `rkey` on this
    connection's queue pair only."""

    req_id: int
    address: int
    rkey: int
    pages: int


@dataclass(frozen=True, slots=True)
class Fence:
    """Raise this namespace's epoch to `epoch` and make it this connection's: from then on
    the memserver refuses (FENCED) every request that changes the namespace, or gives write
    access to it, from a connection whose epoch is lower. Refused FENCED when `epoch` is below
    the namespace's (the caller is a stale generation)."""

    req_id: int
    epoch: int

    def __post_init__(self) -> None:
        if type(self.epoch) is not int or not 1 <= self.epoch <= MAX_EPOCH:
            raise LocalProtocolError("epoch must be in [1, 2**64)")


@dataclass(frozen=True, slots=True)
class FenceReply:
    """The namespace's epoch now (the one just set)."""

    req_id: int
    epoch: int


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


Request = (
    Hello | Auth | Reserve | Release | Store | Load | Free | Status | RdmaOpen | RdmaMap | Fence
)
Reply = (
    Challenge
    | HelloReply
    | ReserveReply
    | ReleaseReply
    | StoreReply
    | LoadReply
    | FreeReply
    | StatusReply
    | RdmaOpenReply
    | RdmaMapReply
    | FenceReply
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
