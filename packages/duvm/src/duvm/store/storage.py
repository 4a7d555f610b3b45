"""The block storage interface the NBD server serves from.

Theory of operation: the NBD layer (`nbdproto`/`nbdserver`) validates every request once
(range, alignment, flags) and then calls one `BlockStore`. Stores only assert. Layers stack
(a remote store over memservers, a fault-injecting store over any store), each calling the next,
the way nbdkit stacks filters over plugins. Errors are errno values inside (`StorageError`);
the NBD layer maps them to wire codes in one place.
"""

from __future__ import annotations

import asyncio
import errno
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from duvm.wire.pageproto import PAGE_SIZE as PAGE_SIZE  # the wire's page, defined once there

EMPTY, DATA, LOST = 0, 1, 2  # per-page state a store keeps: never written or trimmed / holds
# data / lost (reads fail with EIO until the page is written again)


class StorageError(Exception):
    """A failed block operation, carrying an errno value (EIO, ENOSPC, EINVAL, ...)."""

    def __init__(self, err: int, reason: str) -> None:
        super().__init__(f"{errno.errorcode.get(err, err)}: {reason}")
        self.errno = err
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store can do; decides the transmission flags advertised to NBD clients."""

    can_write: bool = True
    can_flush: bool = True
    can_trim: bool = True
    can_zero: bool = True
    can_multi_conn: bool = True


# A fast-path completion: `done(tag, None)` finished; `done(tag, coroutine)` continue with that
# coroutine (it completes the request, or raises StorageError); `done(tag, exception)` failed;
# for a read, `done(tag, memoryview)` finished with the data in that view instead of `out`
# (bytes the store never changes again, so the reply can be sent from them without a copy).
Done = Callable[[object, "Coroutine[Any, Any, None] | BaseException | None"], None]
# start_read / start_write: (offset, buffer, done, tag) -> taken
FastEntry = Callable[[int, memoryview, Done, object], bool]


class Holder(Protocol):
    """What `Batching` holds while corked: a connection whose queued requests it sends."""

    def send_queued(self) -> None: ...


class Batching:
    """Request batching shared by a store's memserver connections and the NBD server in front
    of it, so that the server's requests merge into one frame per memserver and its replies
    leave in one write.

    `cork()`/`uncork()`: the server corks while it dispatches the requests of one read from
    its client; the connections hold what they queue meanwhile (`hold`) and send it at
    `uncork()`, in the same loop iteration, without the extra iteration (and latency) of a
    `call_soon` flush. `after_replies(fn)`: while a connection delivers a batch of replies
    (`delivering`), `fn` runs once they are all delivered, so the server can answer many
    requests in one write.
    """

    __slots__ = ("_after", "_held")

    def __init__(self) -> None:
        self._held: list[Holder] | None = None  # connections with requests held while corked
        self._after: list[Callable[[], None]] | None = None

    def cork(self) -> bool:
        """Hold requests from now on until `uncork()`. False when already corked (nested:
        only the outer caller uncorks)."""
        if self._held is not None:
            return False
        self._held = []
        return True

    def uncork(self) -> None:
        """Send every request held since `cork()`: each holder's `send_queued()`."""
        held, self._held = self._held, None
        if held:
            for conn in held:
                conn.send_queued()

    def hold(self, conn: Holder) -> bool:
        """A connection's new requests wait for `uncork()`; False when not corked."""
        if self._held is None:
            return False
        self._held.append(conn)
        return True

    def after_replies(self, fn: Callable[[], None]) -> bool:
        """Call `fn` once the replies being delivered now are all delivered. False when no
        delivery is in progress: the caller must arrange the call itself."""
        if self._after is None:
            return False
        self._after.append(fn)
        return True

    def delivering(self) -> list[Callable[[], None]]:
        """A connection starts delivering replies; it calls what it gets back afterwards and
        then `delivered()`."""
        self._after = []
        return self._after

    def delivered(self) -> None:
        self._after = None


class SlabRepair(TypedDict):
    """One slab being copied to a new replica."""

    slab: int
    target: str  # the memserver it is copied to
    copied_pages: int
    total_pages: int


class PeerReplication(TypedDict):
    """One memserver as the replicated store sees it."""

    peer: str
    connected: bool
    circuit_open: bool  # the breaker keeps requests away
    consecutive_failures: int
    breaker_trips: int
    namespace_losses: int  # reconnects that found the namespace gone
    transport: str  # asked for: tcp, rdma or auto
    transport_in_use: str | None  # rdma or tcp; None unconnected
    rdma_device: str | None
    rdma_error: str | None
    slabs: int  # slabs with a replica there
    reserved_pages: int  # pages this node reserved there
    pages: int  # this node's written pages held there (one count per replica)


class ReplicationHealth(TypedDict):
    """A replicated store's health (`BlockStore.health`), JSON-ready: what `duvm status`,
    the daemon's control socket and its metrics report."""

    replicas: int  # wanted per slab
    slabs: int
    slab_pages: int
    degraded_slabs: int  # slabs with fewer live replicas than wanted
    degraded: list[int]  # the first of them
    repairing: list[SlabRepair]
    pages_written: int
    pages_lost_now: int  # reads of these return EIO
    peers: list[PeerReplication]


class BlockStore(ABC):
    """A byte-addressed device of `size` bytes. Offsets and lengths arrive already validated."""

    size: int
    capabilities: Capabilities = Capabilities()
    # Optional callback fast path, declared: only a store whose `fast_path` is True is offered
    # requests through `start_read`/`start_write`. It takes one without a coroutine by
    # returning True and calling `done(tag, ...)` exactly once, from the event loop: later,
    # or already before it returns (a store in RAM answers at once); False means it did
    # nothing and the caller awaits `read`/`write` instead. The buffer stays the caller's
    # until `done`. A filter forwards the fast path or declines it.
    fast_path: bool = False
    # Shared with the store's memserver connections (RemoteStore sets its own). Stores without
    # connections share this one: nothing is ever held in it or delivered through it.
    batching: Batching = Batching()

    def describe(self) -> str:
        """What serves the pages, for people ("2 memserver(s), pages encrypted")."""
        return type(self).__name__

    def memserver_clients(self) -> list[Any]:
        """The memserver connections under this store (the daemon re-reads their secret on
        SIGHUP); none for a store in local RAM."""
        return []

    def health(self) -> ReplicationHealth | None:
        """Replication health for `duvm status` and metrics (JSON-ready), None for a store
        without replicas."""
        return None

    def counters(self) -> dict[str, int]:
        """The counters of this store and the layers below it, by name (`store.counters`):
        what status and metrics read. Each component owns and increments its own."""
        return {}

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        return False

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        return False

    def fast_entries(self) -> tuple[FastEntry, FastEntry]:
        """`start_read` and `start_write` as the callables to call per request. A store whose
        fast path is a component of its own returns that component's, so a request does not
        pass through a frame that only forwards it."""
        return self.start_read, self.start_write

    @abstractmethod
    async def read(self, offset: int, out: memoryview) -> None:
        """Fill `out` (len(out) bytes) with the data at `offset`; never-written bytes read as 0."""

    @abstractmethod
    async def write(self, offset: int, data: memoryview) -> None:
        """Store `data` at `offset`; return only once a later read will see it."""

    @abstractmethod
    async def trim(self, offset: int, length: int) -> None:
        """Forget the range (reads then return zeros); frees the backing pages."""

    async def write_zeroes(self, offset: int, length: int) -> None:
        """Make the range read as zeros. Default: trim, since trimmed pages read as zeros."""
        await self.trim(offset, length)

    async def flush(self) -> None:  # noqa: B027 - optional hook, default is a no-op
        """Make completed writes durable. Stores that ack only when stored need nothing."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and buffers."""


class StoreFilter(BlockStore):
    """A store layered over another (`inner`): same size and capabilities, and it passes
    `describe` and `memserver_clients` through. It declines the fast path unless it says
    otherwise."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.size = inner.size
        self.capabilities = inner.capabilities
        self.batching = inner.batching

    def describe(self) -> str:
        return self.inner.describe()

    def memserver_clients(self) -> list[Any]:
        return self.inner.memserver_clients()

    def health(self) -> ReplicationHealth | None:
        return self.inner.health()

    def counters(self) -> dict[str, int]:
        return self.inner.counters()

    async def flush(self) -> None:
        await self.inner.flush()

    async def close(self) -> None:
        await self.inner.close()


class FaultStore(StoreFilter):
    """A layer that delays or fails operations of the store below: fault injection for tests.

    `delay` maps an operation name ("read", "write", "trim", "write_zeroes", "flush") to
    seconds to wait before passing it on; `fail` maps it to an errno to raise instead;
    `only` restricts both to requests whose offset is in that range. Like nbdkit's delay and
    error filters, it calls the next layer and adds nothing else.
    """

    def __init__(
        self,
        inner: BlockStore,
        *,
        delay: dict[str, float] | None = None,
        fail: dict[str, int] | None = None,
        only: range | None = None,
    ) -> None:
        super().__init__(inner)
        self.delay = dict(delay or {})
        self.fail = dict(fail or {})
        self.only = only
        # the fast path is forwarded; a request with a fault to inject is declined, so it
        # takes the coroutine path, where the fault is injected
        self.fast_path = inner.fast_path

    def describe(self) -> str:
        return f"{self.inner.describe()}, faults injected"

    def _faulty(self, op: str, offset: int) -> bool:
        in_range = self.only is None or offset in self.only
        return in_range and (op in self.delay or op in self.fail)

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        return not self._faulty("read", offset) and self.inner.start_read(offset, out, done, tag)

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        return not self._faulty("write", offset) and self.inner.start_write(offset, data, done, tag)

    async def _fault(self, op: str, offset: int) -> None:
        if self.only is not None and offset not in self.only:
            return
        if op in self.delay:
            await asyncio.sleep(self.delay[op])
        if op in self.fail:
            raise StorageError(self.fail[op], f"injected {op} failure")

    async def read(self, offset: int, out: memoryview) -> None:
        await self._fault("read", offset)
        await self.inner.read(offset, out)

    async def write(self, offset: int, data: memoryview) -> None:
        await self._fault("write", offset)
        await self.inner.write(offset, data)

    async def trim(self, offset: int, length: int) -> None:
        await self._fault("trim", offset)
        await self.inner.trim(offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._fault("write_zeroes", offset)
        await self.inner.write_zeroes(offset, length)

    async def flush(self) -> None:
        await self._fault("flush", 0)
        await self.inner.flush()
