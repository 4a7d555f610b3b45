"""How `RemoteStore`'s request paths treat a failed replica: which exceptions are replica
failures (anything else is a bug or a cancellation and propagates), the `StorageError` each
becomes, and the wait while no replica of a slab answers (for swap a stall beats an error,
up to `unreachable_wait`)."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.storage import PAGE_SIZE, StorageError
from duvm.wire.pageproto import ErrorCode

# When no replica of a slab can be reached, requests wait this long for one to come back
# (a restart, a flapping link, a memserver's host too busy to answer) before failing: for swap
# a stall beats an I/O error, which kills the program whose page it was (SIGBUS). Waiting
# longer stops helping at 60 s: the kernel's nbd client gives up a request after 60 s
# (`node.attach.attach.DEFAULT_NBD_TIMEOUT_S`), and a memserver frees a lost client's pages 60 s
# after its connection died (`memserver.pagestore.DEFAULT_LEASE_S`). So 50 s: 60 less the 5 s a
# stalled connection takes to be noticed (`remote_health.DEFAULT_OP_TIMEOUT`), less 5 s to
# spare. tests/test_unreachable_wait.py holds these to each other.
DEFAULT_UNREACHABLE_WAIT = 50.0
RETRY_MIN_S, RETRY_MAX_S = 0.05, 1.0
REPLICA_FAILURES = (PageServerError, MemserverUnreachable)
_MASK = PAGE_SIZE - 1


def storage_error(e: Exception, what: str) -> StorageError:
    """ENOSPC for a memserver's refusal for space, else EIO."""
    if isinstance(e, PageServerError) and e.code == ErrorCode.NO_SPACE:
        return StorageError(errno.ENOSPC, f"{what}: {e}")
    return StorageError(errno.EIO, f"{what}: {e}")


def refused_everywhere(failures: list[BaseException], replicas: int) -> bool:
    """Every one of a write's `replicas` replicas refused it for space (NO_SPACE): it reached
    none of them, and the bytes from before it remain everywhere."""
    return len(failures) == replicas and all(
        isinstance(e, PageServerError) and e.code == ErrorCode.NO_SPACE for e in failures
    )


def check_request(offset: int, length: int, is_open: bool) -> None:
    """Raise for a request the hot paths' quick test flagged. Bounds and alignment are the
    NBD layer's to validate (`nbdproto.validate`, EINVAL to the client); here a request that
    is not page-aligned is a caller's bug, so only asserted."""
    assert not (offset | length) & _MASK, f"unaligned request ({offset}, {length})"
    if not is_open:
        raise StorageError(errno.EIO, "store is not open")


class CountsWaits(Protocol):
    """The counters of a request path that waits while no replica answers."""

    unreachable_waits: int


class UnreachableWait:
    """Backoff for one request while no replica answers, up to `limit` seconds in all."""

    def __init__(self, limit: float, counters: CountsWaits) -> None:
        self._limit = limit
        self._counters = counters  # each wait is counted there
        self._deadline: float | None = None
        self._delay = RETRY_MIN_S

    async def again(self) -> bool:
        """Sleep and return True while the limit has not passed; else False."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._limit
        if now >= self._deadline:
            return False
        self._counters.unreachable_waits += 1
        await asyncio.sleep(self._delay)
        self._delay = min(2 * self._delay, RETRY_MAX_S)
        return True


async def all_parts(parts: list[Coroutine[Any, Any, None]]) -> None:
    """Await every part of a request split at slab boundaries, then raise the first failure
    (no part outlives the request)."""
    if len(parts) == 1:
        await parts[0]
        return
    for r in await asyncio.gather(*parts, return_exceptions=True):
        if isinstance(r, BaseException):
            raise r
