"""A preallocated page arena: fixed 4 KiB slots in one anonymous mapping.

Theory of operation: a memserver must never swap because it received a page (DESIGN rule 2).
So all page memory is mapped once at start (`MAP_POPULATE` touches every page now, not on the
first STORE) and locked with mlock(2) when the process may; when it may not, a warning says why
and how to allow it, and the arena still works. A slot is a page-sized window of the mapping
addressed by its index; free slots sit on a stack (`array('I')`, preallocated) so allocating and
freeing are O(1) and never touch the allocator. Callers copy bytes in and out through
`view(slot)` memoryviews; the arena never interprets page contents.

A freed slot keeps its bytes: the arena does not clear it. Whoever hands a slot to a reader
that may see it before writing it clears it first (`zero`): the page store does so for the
runs an RDMA reservation takes (duvm.memserver.pagestore says why there, and not on free).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from array import array

from duvm.base.libc import libc
from duvm.wire.pageproto import PAGE_SIZE  # the one definition: the wire's page

log = logging.getLogger(__name__)


class ArenaFull(Exception):
    """No free slot left."""


class Arena:
    """`slots` page slots of PAGE_SIZE bytes, preallocated and (when permitted) locked.

    `lock`: True locks when permitted and warns otherwise; False never locks (tests, or an
    operator who knows). `locked` says what happened, `lock_error` why not.
    """

    def __init__(self, slots: int, *, lock: bool = True) -> None:
        if slots < 1:
            raise ValueError("an arena needs at least one slot")
        self.slots = slots
        self.nbytes = slots * PAGE_SIZE
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        flags |= getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        except (OSError, OverflowError) as e:
            raise MemoryError(f"cannot map an arena of {self.nbytes} bytes: {e}") from None
        self._mv = memoryview(self._map)
        self.locked = False
        self.lock_error: str | None = None
        if lock:
            self._lock()
        else:
            self.lock_error = "locking disabled"
        # Free-slot stack, lowest slot on top so a fresh arena fills from the start.
        self._free = array("I", range(slots - 1, -1, -1))

    def _lock(self) -> None:
        try:
            c = libc()
        except OSError:
            self.lock_error = "libc not found"
        else:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
            if c.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(self.nbytes)) == 0:
                self.locked = True
                return
            err = ctypes.get_errno()
            self.lock_error = f"mlock failed: {os.strerror(err)}"
        log.warning(
            "arena of %d MiB is NOT locked in RAM (%s): under memory pressure this server's "
            "pages may be swapped out. Run as root, grant CAP_IPC_LOCK, or raise the memlock "
            "limit (ulimit -l / LimitMEMLOCK=infinity) to at least the capacity.",
            self.nbytes >> 20,
            self.lock_error,
        )

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.slots - len(self._free)

    def alloc(self) -> int:
        """Take a free slot. Raises ArenaFull (callers check capacity first)."""
        try:
            return self._free.pop()
        except IndexError:
            raise ArenaFull(f"all {self.slots} slots in use") from None

    def alloc_many(self, n: int) -> list[int]:
        """Take `n` free slots: the same ones, in the same order, as `n` calls of `alloc`
        (consecutive while the free list is), without a Python loop. Raises ArenaFull."""
        free = self._free
        if n > len(free):
            raise ArenaFull(f"{n} slots asked, {len(free)} free of {self.slots}")
        cut = len(free) - n
        taken = free[cut:]
        del free[cut:]
        taken.reverse()
        return taken.tolist()

    def alloc_runs(self, n: int, unit: int, max_runs: int = 64) -> list[tuple[int, int]]:
        """Take `n` free slots (a multiple of `unit`) as runs of consecutive slots, each a
        multiple of `unit` long, the longest first: [(first slot, slots), ...]. For memory
        registered with a NIC, where each run is one region. O(free slots log free slots):
        a control-plane call (a reservation), never per page. Raises ArenaFull when the free
        slots cannot make `n` in at most `max_runs` runs (too fragmented)."""
        if n % unit:
            raise ValueError(f"{n} slots is not a multiple of {unit}")
        free = sorted(self._free)
        runs: list[tuple[int, int]] = []  # (length, first) of each maximal run of free slots
        start = prev = -2
        for s in free:
            if s != prev + 1:
                if start >= 0:
                    runs.append((prev + 1 - start, start))
                start = s
            prev = s
        if start >= 0:
            runs.append((prev + 1 - start, start))
        runs.sort(key=lambda r: (-r[0], r[1]))
        taken: list[tuple[int, int]] = []
        left = n
        for length, first in runs:
            if not left or len(taken) == max_runs:
                break
            use = min(length - length % unit, left)
            if use:
                taken.append((first, use))
                left -= use
        if left:
            raise ArenaFull(
                f"{n} slots asked in runs of {unit}: {len(free)} free of {self.slots}, "
                "but not in few enough runs (fragmented)"
            )
        gone = bytearray(self.slots)
        for first, count in taken:
            gone[first : first + count] = b"\x01" * count
        # the rest stays free, lowest slot on top as in a fresh arena
        self._free = array("I", (s for s in reversed(free) if not gone[s]))
        return taken

    def free_run(self, first: int, count: int) -> None:
        """Return a run taken by `alloc_runs` (pushed so its lowest slot comes out first)."""
        self._free.extend(range(first + count - 1, first - 1, -1))

    def zero(self, first: int, count: int) -> None:
        """Clear `count` slots from `first` (memset over the mapping: nothing allocated)."""
        if first < 0 or count < 0 or first + count > self.slots:
            raise ValueError(f"slots {first}..{first + count} are outside the arena")
        ctypes.memset(self.address + first * PAGE_SIZE, 0, count * PAGE_SIZE)

    @property
    def address(self) -> int:
        """The mapping's virtual address (for registering it with a NIC)."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def free(self, slot: int) -> None:
        """Return a slot. The caller guarantees it was allocated and is freed once."""
        self._free.append(slot)

    def view(self, slot: int) -> memoryview:
        """The slot's PAGE_SIZE bytes, writable."""
        off = slot * PAGE_SIZE
        return self._mv[off : off + PAGE_SIZE]

    @property
    def memory(self) -> memoryview:
        """The whole arena, for callers that slice it themselves on hot paths."""
        return self._mv

    def close(self) -> None:
        """Unmap (munmap also unlocks). Views handed out must have been released."""
        self._mv.release()
        try:
            self._map.close()
        except BufferError:
            log.debug("arena still has exported views; leaving the mapping to the GC")
