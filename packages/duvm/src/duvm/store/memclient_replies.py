"""How a memserver's replies reach the requests waiting for them.

- `ReplyProtocol` receives into the page-protocol decoder's buffer and hands each reply to the
  waiter its request id names: a Future, a `Callback` (the fast path: the caller's function
  runs right from the receive path) or a `Batch` (requests merged into one frame, whose LOAD
  reply is scattered straight into the callers' buffers: the one copy from socket to caller).
- A merged batch refused with a per-key error is sent again one request at a time, so only the
  requests that are really refused fail.
- Replies of one receive are delivered inside the store's `Batching.delivering()` bracket, so
  the NBD replies they complete leave in one write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from duvm.base import accel
from duvm.base.sockets import tune_socket
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.storage import Batching
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import NEED_DATA, Decoder, decode_frame
from duvm.wire.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)

_LOAD_REPLY = int(pp.MsgType.LOAD) | pp.REPLY_BIT
_STORE_REPLY = int(pp.MsgType.STORE) | pp.REPLY_BIT
_PER_KEY_ERRORS = (pp.ErrorCode.NOT_FOUND, pp.ErrorCode.NO_SPACE)


class Callback:
    """Stands in for a Future on the callback fast path (`load_cb`/`store_cb`): completing it
    calls `cb(None)` or `cb(exception)` at once, from the receive path, without a Task, a
    Future or a loop iteration in between."""

    __slots__ = ("cb", "finished")

    def __init__(self, cb: Callable[[BaseException | None], None]) -> None:
        self.cb = cb
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_result(self, _: object) -> None:
        self._call(None)

    def set_exception(self, exc: BaseException) -> None:
        self._call(exc)

    def _call(self, exc: BaseException | None) -> None:
        self.finished = True
        try:
            self.cb(exc)
        except Exception:  # a caller's bug must not break this connection's other replies
            log.exception("memserver request callback failed")


def callback_type() -> type[Callback]:
    """The compiled `Callback` (duvm.store._replies) when the compiled path runs here, else
    this one, the reference."""
    compiled = accel.load("duvm.store._replies")
    return compiled.Callback if compiled is not None else Callback


class Batch:
    """STOREs (or LOADs) queued back to back in one loop iteration, sent as one frame.

    The memserver then handles one request for many pages instead of many requests, which is
    where its time goes at high queue depth. STORE data is not copied: the frame's parts are
    the callers' buffers. A LOAD reply is scattered straight into the callers' buffers."""

    __slots__ = ("keys", "mtype", "parts", "waiters")

    def __init__(self, mtype: int) -> None:
        self.mtype = mtype
        self.keys: list[int] = []
        self.parts: list[memoryview] = []
        # (future, keys, data, out) per request
        self.waiters: list[
            tuple[asyncio.Future, tuple[int, ...], memoryview | None, memoryview | None]
        ] = []


class ReplyOwner(Protocol):
    """What `ReplyProtocol` needs from the client that owns the connection (`MemClient`): the
    declared seam between the sending and the receiving half of one connection."""

    peer: str
    batching: Batching
    pending: dict[int, Any]  # request id -> Future, Callback or Batch; replies pop from it
    last_rx: float  # when bytes last arrived (monotonic): the stall watchdog reads it

    def resend_each(self, batch: Batch) -> None:
        """Queue each request of a merged batch refused with a per-key error on its own."""

    def reply_connection_lost(self, proto: ReplyProtocol, exc: Exception | None) -> None:
        """The connection `proto` received on is gone: fail what waits on it."""


def fail_requests(entries: list, err: Exception) -> None:
    """Fail every waiter of these queued or pending entries (a Batch or a Future;
    encoded bytes, whose waiters are in the pending table, are skipped)."""
    for entry in entries:
        if isinstance(entry, Batch):
            futs = [w[0] for w in entry.waiters]
        elif isinstance(entry, asyncio.Future):
            futs = [entry]
        else:
            continue  # encoded bytes: their futures are in pending
        for fut in futs:
            if not fut.done():
                fut.set_exception(err)


def compiled_deliver() -> Callable[..., Any] | None:
    """The compiled loop that completes the plain replies (`duvm.store._replies.deliver`)
    when the compiled path runs here, else None."""
    compiled = accel.load("duvm.store._replies")
    return compiled.deliver if compiled is not None else None


class ReplyProtocol(asyncio.BufferedProtocol):
    """The receive side of one memserver connection: frames decoded in place, each reply
    handed to the request that waits for it in its owner's `pending` table."""

    def __init__(
        self,
        client: ReplyOwner,
        deliver: Callable[[], Callable[..., Any] | None] = compiled_deliver,
    ) -> None:
        """`deliver` gives the compiled reply loop to use (None: the reference loop only)."""
        self.client = client
        self.decoder = Decoder("client")
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hot = deliver()
        self._load_limit = self.decoder.limit(_LOAD_REPLY)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # uvloop: not a subclass
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        dec, pending = self.decoder, self.client.pending
        self.client.last_rx = time.monotonic()  # progress: the stall watchdog reads it
        dec.buffer_updated(nbytes)
        batching = self.client.batching
        after = batching.delivering()
        try:
            self._deliver(dec, pending)
        finally:
            batching.delivered()
            for fn in after:
                try:
                    fn()
                except Exception:  # one caller's failure must not keep the others' replies
                    log.exception("after-replies callback failed")

    def _deliver(self, dec: Decoder, pending: dict) -> None:
        entry = None
        hot = self._hot
        try:
            while True:
                entry = None
                if hot is not None:
                    # the compiled loop completes the plain replies at the front; the frame
                    # it stops at (any error or refusal among them) is this loop's, below
                    hot(dec, pending, self._load_limit)
                frame = dec.next_frame()
                if frame is NEED_DATA:
                    return
                mtype, req_id, status, _ = frame
                entry = pending.pop(req_id, None)
                if entry is None:
                    raise pp.RemoteProtocolError(f"reply to unknown request id {req_id}")
                if isinstance(entry, Batch):
                    self._batch_reply(entry, mtype, frame)
                    continue
                fut = entry
                if fut.done():  # the caller was cancelled; drop the reply
                    continue
                if status:
                    msg = decode_frame(*frame)
                    fut.set_exception(PageServerError(msg.code, msg.message, self.client.peer))
                else:
                    fut.set_result(decode_frame(*frame))
        except pp.RemoteProtocolError as e:
            log.warning("memserver %s broke the protocol: %s; closing", self.client.peer, e)
            if entry is not None:  # popped already, so the lost connection would not fail it
                fail_requests(
                    [entry],
                    MemserverUnreachable(f"memserver {self.client.peer} broke the protocol: {e}"),
                )
            self.transport.abort()

    def _batch_reply(self, batch: Batch, mtype: int, frame: tuple) -> None:
        waiters = batch.waiters
        if frame[2]:  # refused
            msg = decode_frame(*frame)
            if len(waiters) > 1 and msg.code in _PER_KEY_ERRORS:
                # Merged requests share the refusal; ask again one by one so that only the
                # requests that are really refused fail.
                self.client.resend_each(batch)
                return
            err = PageServerError(msg.code, msg.message, self.client.peer)
            for fut, _, _, _ in waiters:
                if not fut.done():
                    fut.set_exception(err)
        elif mtype == _LOAD_REPLY:
            body = frame[3]
            if body.nbytes != len(batch.keys) * PAGE_SIZE:
                raise pp.RemoteProtocolError("LOAD reply does not match its request")
            off = 0
            for fut, _, _, out in waiters:
                n = out.nbytes
                if not fut.done():
                    out[:] = body[off : off + n]  # the one copy: receive buffer -> caller
                    fut.set_result(None)
                off += n
        elif mtype == _STORE_REPLY:  # its payload is empty (the decoder checked)
            for fut, _, _, _ in waiters:
                if not fut.done():
                    fut.set_result(None)
        else:
            raise pp.RemoteProtocolError(f"reply type 0x{mtype:04x} to a STORE/LOAD")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.client.reply_connection_lost(self, exc)
