"""One memory client's RDMA connection: pages go to and from the memserver's arena by
one-sided RDMA WRITE and READ, with no memserver CPU per page.

Theory of operation
-------------------
- `open_link` runs after the TCP handshake (the memserver has proved the cluster secret and
  so has this client): RDMA_OPEN gets a one-time ticket, rdma-cm resolves the memserver's
  address and route, the queue pair is created (its own protection domain, a completion
  channel, the client's staging buffer registered in it) and connects with the ticket as
  private data. Every step has a deadline; any failure closes what was made and raises
  `LinkError`. The staging buffer (`new_staging`) is the memory client's: mapped, populated
  and locked at its first RDMA connection, before swap runs through it, and registered again
  by each reconnect, which so allocates no page memory under memory pressure.
- `post` hands a STORE or LOAD to the compiled queue (`duvm.rdma._verbs.Queue`): one chain of
  work requests per request, the bytes through the staging buffer. A chunk not yet mapped
  (the first write to a slab, or any access after a reconnect: rkeys belong to one queue pair)
  is mapped over TCP first (RDMA_MAP, one round trip per chunk per connection); a full staging
  buffer makes the request take TCP, which reaches the same slots.
- Completions arrive on the completion channel's fd (an asyncio reader). A failed completion
  (a forged or stale key, a memserver gone, a port down) or a DISCONNECTED event breaks the
  link: every request in flight fails with `MemserverUnreachable`, as on a lost TCP
  connection, and `on_broken` tells the client, which drops the connection; the store then
  fails over and repairs as for TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.wire import pageproto as pp

log = logging.getLogger(__name__)

STAGING_PAGES = 4096  # 16 MiB of locked, registered staging per memserver connection
QUEUE_DEPTH = 256  # work requests in flight on one queue pair
SETUP_TIMEOUT_S = 5.0


class LinkError(Exception):
    """The RDMA connection could not be made; the message says which step and why."""


def new_staging(verbs: ModuleType, pages: int = STAGING_PAGES, path: str | None = None) -> Any:
    """A memory client's staging buffer (`duvm.rdma._verbs.Staging`), warning when it could
    not be locked. With `path` (a file on the daemon's ramfs state directory, created 0600 and
    sized here), its pages are that file's: the daemon, its standby and a restarted daemon
    share one staging buffer per memserver instead of each holding its own (D48). Raises
    LinkError when it cannot be mapped."""
    try:
        if path is None:
            staging = verbs.Staging(pages)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
                if os.fstat(fd).st_size < pages * 4096:
                    os.ftruncate(fd, pages * 4096)
                staging = verbs.Staging(pages, fd)
            finally:
                os.close(fd)
    except OSError as e:
        raise LinkError(f"no staging buffer: {e}") from None
    if not staging.locked:
        log.warning(
            "the RDMA staging buffer is not locked in RAM (raise the memlock limit: "
            "LimitMEMLOCK=infinity, or CAP_IPC_LOCK)"
        )
    return staging


@dataclass(frozen=True, slots=True)
class RdmaOwner:
    """What a link needs from the memory client that owns it."""

    request: Callable[[pp.Request], Awaitable[Any]]  # one control request over TCP
    tcp_cb: Callable[[bool, tuple[int, ...], Any, Callable], None]  # a STORE/LOAD by TCP
    tcp_batch: Callable[[bool, tuple[int, ...], Any], Awaitable[Any]]  # ... as an awaitable
    broken: Callable[[str], None]  # the link broke (why)


class RdmaLink:
    """A connected queue pair to one memserver, its chunk map and its completions."""

    def __init__(
        self, verbs: ModuleType, channel: Any, cm: Any, queue: Any, peer: str, owner: RdmaOwner
    ) -> None:
        self.verbs = verbs
        self._channel = channel
        self._cm = cm
        self.queue = queue
        self.peer = peer
        self.device: str | None = cm.device
        self.owner = owner
        self.chunks: dict[int, tuple[int, int]] = {}  # chunk -> (remote address, rkey)
        self.mapping: dict[int, asyncio.Future] = {}  # chunks being mapped
        self._tasks: set[asyncio.Task] = set()  # requests waiting for their chunk's map
        self.closed = False
        self.last_completion = time.monotonic()
        self.busy_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(queue.fd, self._on_completions)
        self._loop.add_reader(channel.fd, self._on_cm_events)

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    def send(self, write: bool, keys: tuple[int, ...], buf: Any, cb: Callable) -> bool:
        """Post a STORE (`buf` the pages) or LOAD (`buf` the destination) of `keys`; `cb(None)`
        or `cb(error)` at completion. False when TCP must take it (staging full, or more runs
        of keys than one chain holds). A chunk not mapped yet is mapped first, then posted."""
        if not self.queue.in_flight:
            self.busy_since = time.monotonic()
        try:
            posted = self.queue.post(write, keys, buf, cb, self.chunks)
        except ValueError:
            return False
        if posted == 0:  # the chunk is read now: another post may set `missing` before it runs
            chunk = self.queue.missing
            task = asyncio.ensure_future(self._map_then_send(chunk, write, keys, buf, cb))
            self._tasks.add(task)  # kept until done (the loop holds tasks weakly)
            task.add_done_callback(self._tasks.discard)
            return True
        return posted == 1

    def call(self, write: bool, keys: tuple[int, ...], buf: Any) -> Awaitable[Any]:
        """`send` as an awaitable (the TCP request's when RDMA cannot take it)."""
        fut = self._loop.create_future()

        def done(exc: BaseException | None) -> None:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

        if not self.send(write, keys, buf, done):
            return self.owner.tcp_batch(write, keys, buf)
        return fut

    async def _map_then_send(
        self, chunk: int, write: bool, keys: tuple[int, ...], buf: Any, cb: Callable
    ) -> None:
        try:
            await self.map(chunk)
        except (PageServerError, MemserverUnreachable) as e:
            cb(e)
            return
        if self.closed:
            cb(MemserverUnreachable(f"RDMA connection to {self.peer} closed"))
        elif not self.send(write, keys, buf, cb):
            self.owner.tcp_cb(write, keys, buf, cb)

    async def map(self, chunk: int) -> None:
        """Learn chunk `chunk`'s address and rkey (one RDMA_MAP, shared by concurrent asks)."""
        task = self.mapping.get(chunk)
        if task is None:
            task = self.mapping[chunk] = asyncio.ensure_future(
                self.owner.request(pp.RdmaMap(0, chunk))
            )
        try:
            reply = await asyncio.shield(task)
        finally:
            if self.mapping.get(chunk) is task and task.done():
                del self.mapping[chunk]
        if reply.pages != self.queue.chunk_pages:
            raise PageServerError(
                pp.ErrorCode.INVALID,
                f"memserver {self.peer} mapped {reply.pages} pages, not {self.queue.chunk_pages}",
            )
        self.chunks[chunk] = (reply.address, reply.rkey)

    def _on_completions(self) -> None:
        failed = self.queue.poll()
        self.last_completion = time.monotonic()
        if failed is not None:
            self.break_link(f"a request failed ({failed})")

    def _on_cm_events(self) -> None:
        v = self.verbs
        while not self.closed:
            try:
                ev = self._channel.get_event()
            except OSError as e:
                self.break_link(f"rdma-cm: {e}")
                return
            if ev is None:
                return
            kind = ev[0]
            if kind in (v.DISCONNECTED, v.DEVICE_REMOVAL, v.CONNECT_ERROR, v.UNREACHABLE):
                self.break_link(v.event_name(kind))
                return

    def break_link(self, why: str) -> None:
        """Fail every request in flight, close, and tell the owner (once)."""
        if self.closed:
            return
        self.close()
        self.owner.broken(why)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.queue.fail_all(MemserverUnreachable(f"RDMA connection to {self.peer} closed"))
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.queue.fd)
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._channel.fd)
        self.mapping.clear()  # their TCP requests fail with the connection, or complete unused
        self._cm.disconnect()
        self._cm.close()  # the queue pair, its regions and the domain
        self._channel.close()


async def open_link(
    verbs: ModuleType,
    host: str,
    reply: pp.RdmaOpenReply,
    chunk_pages: int,
    peer: str,
    owner: RdmaOwner,
    staging: Any,
    timeout: float = SETUP_TIMEOUT_S,
) -> RdmaLink:
    """Connect a queue pair to the memserver that answered RDMA_OPEN with `reply`."""
    loop = asyncio.get_running_loop()
    try:
        channel = verbs.EventChannel()
        cm = verbs.CmId.create(channel)
    except OSError as e:
        raise LinkError(f"no RDMA here: {e.strerror or e}") from None
    events: asyncio.Queue = asyncio.Queue()

    def readable() -> None:
        while True:
            try:
                ev = channel.get_event()
            except OSError as e:
                events.put_nowait((None, str(e)))
                return
            if ev is None:
                return
            events.put_nowait(ev)

    async def expect(want: int, step: str) -> None:
        try:
            ev = await asyncio.wait_for(events.get(), timeout)
        except TimeoutError:
            raise LinkError(f"{step}: no answer within {timeout:g} s") from None
        if ev[0] != want:
            what = ev[1] if ev[0] is None else f"{verbs.event_name(ev[0])} (status {ev[1]})"
            raise LinkError(f"{step}: {what}")

    loop.add_reader(channel.fd, readable)
    queue = None
    try:
        try:
            cm.resolve_addr(host, reply.port, int(timeout * 1000))
            await expect(verbs.ADDR_RESOLVED, "address resolution")
            cm.resolve_route(int(timeout * 1000))
            await expect(verbs.ROUTE_RESOLVED, "route resolution")
            cm.create_domain(QUEUE_DEPTH, True)
            queue = verbs.Queue(cm, staging, chunk_pages)
            depth = max(1, min(reply.read_depth, cm.max_read_depth()))
            cm.connect(reply.ticket, depth)
            await expect(verbs.ESTABLISHED, "connect")
        except OSError as e:
            raise LinkError(str(e)) from None
    except BaseException:
        loop.remove_reader(channel.fd)
        cm.close()
        channel.close()
        raise
    loop.remove_reader(channel.fd)
    return RdmaLink(verbs, channel, cm, queue, peer, owner)
