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
from typing import Any

from duvm.pageproto import PAGE_SIZE as PAGE_SIZE  # the wire's page, defined once there

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


class BlockStore(ABC):
    """A byte-addressed device of `size` bytes. Offsets and lengths arrive already validated."""

    size: int
    capabilities: Capabilities = Capabilities()

    # Optional callback fast path. A store may take a read or write without a coroutine:
    # it returns True and later calls `done(tag, ...)` exactly once, from the event loop;
    # False means it did nothing and the caller awaits `read`/`write` instead. The buffer
    # stays the caller's until `done`.

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        return False

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        return False

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


class FaultStore(BlockStore):
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
        self.inner = inner
        self.size = inner.size
        self.capabilities = inner.capabilities
        self.delay = dict(delay or {})
        self.fail = dict(fail or {})
        self.only = only

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

    async def close(self) -> None:
        await self.inner.close()
