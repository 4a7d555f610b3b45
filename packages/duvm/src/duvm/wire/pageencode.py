"""Page protocol messages as bytes (the encoder; the format is in docs/protocol.md).

`encode(msg)` returns a list of buffers for `transport.writelines`, so page data is never
joined into a new bytes object on the send side. The hot paths skip message objects:
`batch_prefix` frames a STORE, LOAD or FREE straight from its keys, `frame_header` a reply.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from duvm.wire.pageproto import (
    AUTH_REQUIRED,
    CHALLENGE_BODY,
    FENCE_BODY,
    FREE_REPLY_BODY,
    HEADER,
    HELLO_HEAD,
    HELLO_REPLY_BODY,
    MAGIC,
    MAX_ERROR_MESSAGE,
    MAX_STATUS,
    PAGE_SIZE,
    RDMA_MAP_REPLY_BODY,
    RDMA_OPEN_BODY,
    RDMA_OPEN_REPLY_BODY,
    REPLY_BIT,
    RESUMED,
    U64,
    U64X2,
    Auth,
    Challenge,
    ErrorReply,
    Fence,
    FenceReply,
    Free,
    FreeReply,
    Hello,
    HelloReply,
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
    Reserve,
    ReserveReply,
    Status,
    StatusReply,
    Store,
    StoreReply,
)

_STRUCTS: dict[int, struct.Struct] = {}


def _batch_struct(n: int) -> struct.Struct:
    """Header, count, reserved and n keys in one Struct (cached per n; n <= MAX_BATCH)."""
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<IHHQIIII{n}Q")
    return st


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
            body = FREE_REPLY_BODY.pack(freed, 0)
            return [frame_header(MsgType.FREE | REPLY_BIT, req_id, 8) + body]
        case Hello(req_id, client_id, lo, hi, nonce, kid, token):
            raw = client_id.encode("utf-8")
            body = HELLO_HEAD.pack(lo, hi, len(raw), 0) + raw
            if nonce:
                body += nonce + kid + token
            return [frame_header(MsgType.HELLO, req_id, len(body)) + body]
        case Challenge(req_id, version, required, nonce, kid, proof):
            flags = AUTH_REQUIRED if required else 0
            body = CHALLENGE_BODY.pack(version, flags, 0, nonce, kid, proof)
            return [frame_header(MsgType.HELLO | REPLY_BIT, req_id, len(body)) + body]
        case Auth(req_id, proof):
            return [frame_header(MsgType.AUTH, req_id, len(proof)) + proof]
        case HelloReply():
            body = HELLO_REPLY_BODY.pack(
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
            return [frame_header(MsgType.RESERVE, req_id, 8) + U64.pack(pages)]
        case ReserveReply(req_id, reserved, stored):
            body = U64X2.pack(reserved, stored)
            return [frame_header(MsgType.RESERVE | REPLY_BIT, req_id, 16) + body]
        case Release(req_id):
            return [frame_header(MsgType.RELEASE, req_id, 0)]
        case ReleaseReply(req_id, freed):
            return [frame_header(MsgType.RELEASE | REPLY_BIT, req_id, 8) + U64.pack(freed)]
        case Status(req_id):
            return [frame_header(MsgType.STATUS, req_id, 0)]
        case StatusReply(req_id, body):
            if len(body) > MAX_STATUS:
                raise LocalProtocolError(f"STATUS reply over {MAX_STATUS} bytes")
            return [frame_header(MsgType.STATUS | REPLY_BIT, req_id, len(body)) + body]
        case RdmaOpen(req_id, chunk_pages):
            body = RDMA_OPEN_BODY.pack(chunk_pages, 0)
            return [frame_header(MsgType.RDMA_OPEN, req_id, len(body)) + body]
        case RdmaOpenReply(req_id, port, depth, ticket):
            body = RDMA_OPEN_REPLY_BODY.pack(port, 0, depth, ticket)
            return [frame_header(MsgType.RDMA_OPEN | REPLY_BIT, req_id, len(body)) + body]
        case RdmaMap(req_id, chunk):
            return [frame_header(MsgType.RDMA_MAP, req_id, 8) + U64.pack(chunk)]
        case RdmaMapReply(req_id, address, rkey, pages):
            body = RDMA_MAP_REPLY_BODY.pack(address, rkey, pages)
            return [frame_header(MsgType.RDMA_MAP | REPLY_BIT, req_id, len(body)) + body]
        case Fence(req_id, epoch):
            body = FENCE_BODY.pack(epoch, 0, 0)
            return [frame_header(MsgType.FENCE, req_id, len(body)) + body]
        case FenceReply(req_id, epoch):
            body = FENCE_BODY.pack(epoch, 0, 0)
            return [frame_header(MsgType.FENCE | REPLY_BIT, req_id, len(body)) + body]
        case ErrorReply(req_id, mtype, code, message):
            raw = message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE]
            return [frame_header(mtype | REPLY_BIT, req_id, len(raw), code) + raw]
    raise LocalProtocolError(f"not a page protocol message: {msg!r}")


def encode_bytes(msg: Message) -> bytes:
    """`encode` joined into one bytes object (tests, small messages)."""
    return b"".join(bytes(part) for part in encode(msg))
