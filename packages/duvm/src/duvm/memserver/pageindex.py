"""A namespace's page index (key -> arena slot) that never allocates while pages arrive.

Theory of operation: a memserver holds the pages a node swaps out, so it receives them when
the node it serves, and often the node it runs on, is short of memory. A Python dict grows
by about 104 bytes per page held (a key and a value object, an entry, and the table rebuilt
at every doubling), all faulted in while pages arrive: in a guest whose own memservers serve
its swap, that growth was part of the stall of docs/ARCHITECTURE.md "What remains". This
index is sized once, when the reservation is (`resize`), and then only overwrites its own
memory:

- an open-addressing table of `size` buckets (1.5 times the capacity, so it is at most
  two-thirds full): two parallel arrays, the keys (8 bytes) and the slots (4 bytes; EMPTY
  marks a free bucket), 18 bytes per reserved page, touched when made, so a locked process
  (mlockall) holds them resident from then on. Not rounded up to a power of two, which would
  cost up to twice that, all of it taken when the device is enabled;
- linear probing from a Fibonacci hash of the key scaled to the table (the high half of
  hash x size), so consecutive keys spread;
- removal by backward shift (Knuth's algorithm R): no tombstones, so probes stay short
  however many pages come and go;
- an insert beyond `capacity` raises `IndexFull`: the page store refuses a STORE beyond the
  reservation before it gets here, so this never happens in service.

This is the reference; `duvm.memserver._hotloop.PageIndex` is its compiled twin (the same
table in C, which the compiled serving loop probes directly), and
tests/test_page_index.py drives both with the same operations.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator, MutableMapping, Sequence

from duvm.base import accel

EMPTY = 0xFFFFFFFF  # a free bucket's slot (an arena has fewer slots)
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: Fibonacci hashing
_MASK64 = (1 << 64) - 1
MIN_BUCKETS = 8


def table(nbytes: int) -> mmap.mmap:
    """`nbytes` of fresh memory for a table, faulted in now (MAP_POPULATE, then written:
    resident, and locked under mlockall, before any page arrives), all bytes 0xFF. Its own
    mapping, so a table given back (`resize`) goes back to the kernel, not to a heap."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    try:
        m = mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, OverflowError) as e:
        raise MemoryError(f"cannot map a page index of {nbytes} bytes: {e}") from None
    m.write(b"\xff" * nbytes)
    return m


class IndexFull(Exception):
    """An insert beyond the index's capacity (its namespace's reservation)."""


def buckets_for(capacity: int) -> int:
    """The table size for `capacity` entries: 1.5 times it, at least MIN_BUCKETS (0 for
    none)."""
    if capacity < 0:
        raise ValueError(f"capacity {capacity} is negative")
    if capacity == 0:
        return 0
    return max(MIN_BUCKETS, capacity + (capacity + 1) // 2)


class PageIndex(MutableMapping[int, int]):
    """key (a client's page number, 0 <= key < 2**64) -> arena slot (< EMPTY), holding at
    most `capacity` entries in memory allocated by `resize` alone."""

    __slots__ = ("_capacity", "_count", "_keys", "_map", "_size", "_slots")

    def __init__(self, capacity: int = 0) -> None:
        self._count = 0
        self._capacity = 0
        self._map: mmap.mmap | None = None
        self._keys: memoryview | Sequence[int] = ()
        self._slots: memoryview | Sequence[int] = ()
        self._size = 0
        self.resize(capacity)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def nbytes(self) -> int:
        """The table's memory (what `resize` allocated)."""
        return len(self._slots) * 12

    def resize(self, capacity: int) -> None:
        """Hold up to `capacity` entries (a reservation made or changed): the table is rebuilt
        when its size changes, keeping every entry. ValueError when more are held."""
        if capacity < self._count:
            raise ValueError(f"{self._count} entries do not fit a capacity of {capacity}")
        size = buckets_for(capacity)
        self._capacity = capacity
        if size == len(self._slots):
            return
        old = list(self.items())
        self._unmap()
        if size:
            self._map = table(size * 12)
            self._keys = memoryview(self._map)[: size * 8].cast("Q")
            self._slots = memoryview(self._map)[size * 8 :].cast("I")
        self._size = size
        self._count = 0
        for key, slot in old:
            self[key] = slot

    def _unmap(self) -> None:
        if self._map is not None:
            for view in (self._keys, self._slots):
                if isinstance(view, memoryview):
                    view.release()
            self._keys = self._slots = ()
            self._map.close()
            self._map = None

    def _home(self, key: int) -> int:
        return (((key * GOLDEN) & _MASK64) * self._size) >> 64

    def _find(self, key: int) -> int:
        """The bucket holding `key`, else -1."""
        if not self._count:
            return -1
        keys, slots, size = self._keys, self._slots, self._size
        i = self._home(key)
        while slots[i] != EMPTY:
            if keys[i] == key:
                return i
            i = i + 1 if i + 1 < size else 0
        return -1

    def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
        i = self._find(key)
        return default if i < 0 else self._slots[i]

    def __getitem__(self, key: int) -> int:
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return self._slots[i]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self._find(key) >= 0

    def __setitem__(self, key: int, slot: int) -> None:
        if not 0 <= key <= _MASK64 or not 0 <= slot < EMPTY:
            raise ValueError(f"key {key} or slot {slot} out of range")
        keys, slots, size = self._keys, self._slots, self._size
        if self._capacity:
            i = self._home(key)
            while slots[i] != EMPTY:
                if keys[i] == key:
                    slots[i] = slot
                    return
                i = i + 1 if i + 1 < size else 0
            if self._count < self._capacity:
                keys[i], slots[i] = key, slot
                self._count += 1
                return
        raise IndexFull(f"the index holds its capacity of {self._capacity} pages")

    def __delitem__(self, key: int) -> None:
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        self._remove(i)

    def pop(self, key: int, *default: int | None) -> int | None:  # type: ignore[override]
        i = self._find(key)
        if i < 0:
            if default:
                return default[0]
            raise KeyError(key)
        slot = self._slots[i]
        self._remove(i)
        return slot

    def _remove(self, i: int) -> None:
        """Empty bucket `i`, moving back each later entry of its run that may sit there."""
        keys, slots, size = self._keys, self._slots, self._size
        j = i
        while True:
            j = j + 1 if j + 1 < size else 0
            if slots[j] == EMPTY:
                break
            home = self._home(keys[j])
            # the entry at j stays when its home lies cyclically in (i, j]
            if (i < home <= j) if i <= j else (i < home or home <= j):
                continue
            keys[i], slots[i] = keys[j], slots[j]
            i = j
        slots[i] = EMPTY
        self._count -= 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        keys, slots = self._keys, self._slots
        return (keys[i] for i in range(len(slots)) if slots[i] != EMPTY)

    def items(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        keys, slots = self._keys, self._slots
        return ((keys[i], s) for i, s in enumerate(slots) if s != EMPTY)

    def values(self) -> list[int]:  # type: ignore[override]
        return [s for s in self._slots if s != EMPTY]

    def clear(self) -> None:
        if self._count and self._map is not None:
            size = len(self._slots)
            self._map[size * 8 :] = b"\xff" * (size * 4)
            self._count = 0

    def insert_run(self, first_key: int, first_slot: int, n: int) -> None:
        """Map keys first_key.. to slots first_slot.., `n` of them (an RDMA chunk)."""
        for i in range(n):
            self[first_key + i] = first_slot + i

    def update_from(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Insert every (key, slot)."""
        for key, slot in pairs:
            self[key] = slot

    def __repr__(self) -> str:
        return f"PageIndex({dict(self.items())!r}, capacity={self._capacity})"


def page_index_type() -> type[PageIndex]:
    """The compiled `PageIndex` (duvm.memserver._hotloop) when the compiled path runs here,
    else this one, the reference."""
    compiled = accel.load("duvm.memserver._hotloop")
    return compiled.PageIndex if compiled is not None else PageIndex
