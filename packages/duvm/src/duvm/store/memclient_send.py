"""The send side of one memory client (`memclient.MemClient`): its requests on their way out,
and the table of those sent that wait for their reply.

- Every request queued in one event-loop iteration leaves in one `writelines` (one syscall):
  a `call_soon` flush, or `Batching.uncork` when the NBD server has corked the store's
  connections while it dispatches one read of its client.
- Consecutive STOREs (or LOADs) merge into one frame (`Batch`) up to `MERGE_PAGES` pages
  (never beyond the memserver's `max_batch`): the memserver handles one request for many
  pages. A merged request gets its id when it is sent; other requests (FREE, RESERVE, HELLO
  ...) get theirs when queued and are encoded at once. A STORE's pages are sent from the
  caller's buffer, never copied; a view of a whole bytes object (the encrypting filter's
  sealed pages) is sent as that object (`wire_part`).
- `pending` (request id -> Future, `Callback` or `Batch`) is what the receive side
  (`memclient_replies.ReplyProtocol`) completes; `fail_all` empties it and the queue before
  failing their waiters, so a waiter that sends again finds its new request kept.

The per-request work runs compiled where the compiled path is built: `SendQueue` has a twin
in `duvm.store._sendqueue` (`send_queue_type` chooses), held to the same behaviour by
tests/test_memclient_send.py. This module stays the reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from duvm.base import accel
from duvm.store.memclient_replies import Batch, callback_type, fail_requests
from duvm.store.memserver_errors import MemserverUnreachable
from duvm.store.storage import Batching
from duvm.wire import pageproto as pp
from duvm.wire.pageencode import batch_prefix, encode

# Requests merge into one frame up to this many pages: enough to spare the memserver its
# per-request cost for small requests, small enough that a reply can be delivered (and the
# next frame received) while others are still in flight.
MERGE_PAGES = 64

STORE, LOAD = int(pp.MsgType.STORE), int(pp.MsgType.LOAD)


def wire_part(data: memoryview) -> bytes | memoryview:
    """What a frame sends of a STORE's `data`: the bytes object it views whole, else `data`
    itself. The event loop (uvloop) sends a bytes object as it is and makes a new cast view
    of anything else, which costs about as much as queueing the page did. The same bytes go
    out either way; each replica's frame sends the same object."""
    if isinstance(data, memoryview):
        obj = data.obj
        if isinstance(obj, bytes) and data.c_contiguous and data.nbytes == len(obj):
            return obj
    return data


class _Corked:
    """Stands in for the flush handle of a queue whose requests are held (`Batching.hold`)."""

    __slots__ = ()

    def cancel(self) -> None:  # flush() sends at once anyway
        pass


CORKED = _Corked()


class SendQueue:
    """The requests of one memory client on their way out (see the module docstring)."""

    __slots__ = (
        "_callback",
        "_flush_handle",
        "_loop",
        "_next_id",
        "_open",
        "_outq",
        "batching",
        "busy_since",
        "max_batch",
        "peer",
        "pending",
        "transport",
    )

    def __init__(self, peer: str, batching: Batching) -> None:
        self.peer = peer
        self.batching = batching  # shared with the store's other connections
        self.pending: dict[int, Any] = {}  # request id -> Future, Callback or Batch
        self.max_batch = pp.MAX_BATCH  # pages per request the memserver accepts
        self.busy_since = 0.0  # when requests were last queued with none pending
        self.transport: asyncio.Transport | None = None  # the connection's, while it lasts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open: Batch | None = None  # the batch at the tail of _outq, still growing
        self._outq: list[Any] = []  # Batch, or encoded bytes whose waiters are in pending
        self._next_id = 0
        self._flush_handle: Any = None  # the loop's handle, CORKED, or None: nothing due
        self._callback = callback_type()  # the fast path's stand-in for a Future

    def connected(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        """Requests go out on `transport` from now on."""
        self._loop, self.transport = loop, transport

    def disconnected(self) -> None:
        """No connection from now on: what is sent fails (`fail_all` fails what waits)."""
        self.transport = None

    @property
    def idle(self) -> bool:
        """Nothing queued and no flush due."""
        return self._flush_handle is None and not self._outq

    def queue(
        self,
        mtype: int,
        keys: tuple[int, ...] | None,
        data: memoryview | None,
        out: memoryview | None,
        msg: pp.Request | None = None,
        fut: Any = None,
    ) -> Any:
        """Queue one request; returns what its reply completes (`fut`, else a new Future).
        STORE and LOAD (`keys` valid, 1..max_batch of them, `data`/`out` exactly their pages)
        merge; any other request is `msg`, or a FREE of `keys`."""
        loop = self._loop
        assert loop is not None, "queued before the connection was made"
        if fut is None:
            fut = loop.create_future()
        if not self.pending:  # the stall watchdog measures from here
            self.busy_since = time.monotonic()
        if mtype in (STORE, LOAD):
            assert keys is not None
            b = self._open
            if (
                b is None
                or b.mtype != mtype
                or len(b.keys) + len(keys) > min(MERGE_PAGES, self.max_batch)
            ):
                b = self._open = Batch(mtype)
                self._outq.append(b)
            b.keys += keys
            if data is not None:
                b.parts.append(wire_part(data))
            b.waiters.append((fut, keys, data, out))
        else:
            self._next_id += 1
            rid = self._next_id
            self.pending[rid] = fut
            if msg is not None:
                self._outq += encode(dataclasses.replace(msg, req_id=rid))
            else:
                assert keys is not None
                self._outq.append(batch_prefix(mtype, rid, keys))
            self._open = None
        if self._flush_handle is None:
            if self.batching.hold(self):
                self._flush_handle = CORKED
            else:
                self._flush_handle = loop.call_soon(self.send_queued)
        return fut

    def store_cb(self, keys: tuple[int, ...], data: memoryview, cb: Any) -> None:
        """A STORE whose completion calls `cb(None)` or `cb(exception)` from the receive path."""
        self.queue(STORE, keys, data, None, None, self._callback(cb))

    def load_cb(self, keys: tuple[int, ...], out: memoryview, cb: Any) -> None:
        """A LOAD whose completion calls `cb(None)` or `cb(exception)` from the receive path."""
        self.queue(LOAD, keys, None, out, None, self._callback(cb))

    def resend_each(self, batch: Batch) -> None:
        """Queue every still-waiting request of a refused merged batch on its own."""
        for fut, keys, data, out in batch.waiters:
            if fut.done():
                continue
            solo = Batch(batch.mtype)
            solo.keys += keys
            if data is not None:
                solo.parts.append(wire_part(data))
            solo.waiters.append((fut, keys, data, out))
            self._outq.append(solo)
        self._open = None
        if self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_soon(self.send_queued)

    def send_queued(self) -> None:
        """Send every request queued since the last send, in one writelines (the loop calls
        it at the end of the iteration that queued them; `Batching.uncork` when corked)."""
        self._flush_handle = None
        self._open = None
        q, self._outq = self._outq, []
        if not q:
            return
        t = self.transport
        if t is None or t.is_closing():
            err = MemserverUnreachable(f"not connected to memserver {self.peer}")
            if t is None and self.pending:
                # Requests (not merged page requests: those are in q) queued after the lost
                # connection had already failed its table: a caller that resumed after its
                # reconnect, when that new connection was gone again. No connection is left
                # to answer or fail them, so fail them here.
                q = [*q, *self.pending.values()]
                self.pending = {}
            fail_requests(q, err)
            return
        wire: list[bytes | memoryview] = []
        pending = self.pending
        for item in q:
            if isinstance(item, Batch):
                self._next_id += 1
                pending[self._next_id] = item
                wire.append(batch_prefix(item.mtype, self._next_id, item.keys))
                if item.parts:
                    wire += item.parts
            else:
                wire.append(item)
        t.writelines(wire)

    def flush(self) -> None:
        """Send what is queued now (the connection is closing)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self.send_queued()

    def fail_all(self, err: Exception) -> None:
        """The connection is gone: no transport from now on, and every request queued or
        waiting for its reply fails with `err`. The tables are emptied before anyone hears
        of the failure: a waiter that reacts by sending again must find its new request
        kept, not wiped with the failed ones."""
        self.transport = None
        failed = [*self.pending.values(), *self._outq]
        self.pending = {}
        self._outq = []
        self._open = None
        fail_requests(failed, err)


def send_queue_type() -> type[SendQueue]:
    """The compiled `SendQueue` (duvm.store._sendqueue) when the compiled path runs here, else
    this one, the reference."""
    compiled = accel.load("duvm.store._sendqueue")
    return compiled.SendQueue if compiled is not None else SendQueue
