"""The memserver's state: one `Arena` of preallocated 4 KiB slots and one `Namespace` per
client id, mapping the client's page numbers to slots, and the requests on them. No I/O.

- Reservations are promises: the sum of all namespaces' reservations never exceeds the arena,
  and a namespace never stores more pages than it reserved, so a STORE within a reservation
  always finds a free slot and receiving a page never allocates page memory. Nor any other:
  a namespace's page index (`duvm.memserver.pageindex`) is sized when its reservation is.
- Each request method is synchronous (every request is served from RAM) and refuses by
  raising `Refused`, having changed nothing.
- A namespace belongs to the token of the client that created it (`attach` refuses another
  token with DENIED), and outlives its connections for a lease (default 60 s): a client that
  reconnects with the same client id within the lease finds its pages and reservation; when
  the lease runs out both are freed.
- An RDMA namespace (`open_rdma`) owns its slots: its reservation is held as runs of whole
  chunks of consecutive slots (`extents`, each registered with the NIC by the RDMA service)
  and a chunk of `chunk_pages` consecutive keys maps to one chunk of slots (`map_chunk`), so
  the client reads and writes them by address. Its slots return to the arena only when the
  namespace is released or its lease expires, never page by page: a FREE changes nothing, and
  no slot a client can still address is ever given to another namespace.
- Releasing a namespace (RELEASE, or its lease expiring) first calls the release hooks
  (`add_release_hook`), then returns its slots: the RDMA service deregisters the namespace's
  regions there, so no rkey ever reaches a slot that went back to the arena.
- Fencing (FENCE, docs/protocol.md): a namespace has an `epoch` (0 until a FENCE), which only
  rises, and each connection the epoch it last fenced with. `fence` raises it and calls the
  fence hooks (`add_fence_hook`: the RDMA service drops the regions of older connections
  there); `check_epoch` is what every request that changes a namespace, or gives write access
  to it, passes first: a connection of an older epoch is refused FENCED. The epoch lives on
  the namespace, so it outlives connections for the lease, like the pages (a namespace that
  holds nothing, not even a reservation, goes with its last connection, epoch and all).
- No namespace ever reads bytes another one left in a slot. A TCP namespace cannot: a slot
  becomes one of its pages only through a STORE that writes all its bytes at once, and a key
  never stored answers NOT_FOUND. An RDMA namespace could, since its whole extents are
  registered with the NIC at RESERVE and a mapped chunk's keys count as stored: so the runs an
  RDMA reservation takes are cleared there (`Arena.zero`), before any region covers them.
  Measured (AMD EPYC, 2 cores, `ctypes.memset`): clearing costs 16 ms per GiB reserved (58 ms
  for 4 GiB), once per reservation, within a whole RDMA RESERVE of 64 ms per GiB (259 ms for
  4 GiB; `Arena.alloc_runs` is most of it). Clearing on release instead would have to cover
  every slot any namespace frees, since a TCP-freed slot may join a later RDMA reservation:
  226 ms per GiB released slot by slot (790 ms for 4 GiB), and +480 ns per page on TCP FREE,
  the swap path's hot request (106 -> 588 ns per page), in the compiled loop too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duvm.memserver.arena import PAGE_SIZE, Arena, ArenaFull
from duvm.memserver.pageindex import PageIndex, page_index_type
from duvm.wire import auth
from duvm.wire import pageproto as pp

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0


@dataclass(slots=True, eq=False)
class Namespace:
    """One attached device of one node: its pages (key -> arena slot) and its reservation."""

    client_id: str
    owner: bytes = b""  # digest of the creating client's namespace token
    reserved: int = 0
    # sized with the reservation, never while pages arrive (duvm.memserver.pageindex)
    pages: PageIndex = field(default_factory=PageIndex)
    connections: int = 0
    expires_at: float | None = None  # monotonic time; set while no connection holds it
    timer: asyncio.TimerHandle | None = None
    # RDMA namespaces only (chunk_pages > 0): runs of slots held, chunks mapped, chunks free
    chunk_pages: int = 0
    extents: list[tuple[int, int]] = field(default_factory=list)  # (first slot, slots)
    chunks: dict[int, int] = field(default_factory=dict)  # chunk index -> first slot
    spare: list[int] = field(default_factory=list)  # first slots of unmapped chunks held
    # the highest FENCE epoch (0: never fenced); connections of a lower epoch may not write
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """One client namespace's share of the arena, as metrics report it."""

    client_id: str
    stored_pages: int
    reserved_pages: int
    connections: int  # 0: the namespace is in its lease


@dataclass(frozen=True, slots=True)
class StoreUsage:
    """What a `PageStore` holds and has served (`PageStore.usage`), read on its loop."""

    capacity_pages: int
    used_pages: int  # arena slots holding pages
    reserved_pages: int  # promised to namespaces
    arena_locked: bool
    connections: int  # open client connections
    counters: dict[str, int]  # requests and pages served, by kind
    namespaces: tuple[NamespaceUsage, ...]


class Refused(Exception):
    """A request the server declines (the reply carries `code`); it changed nothing."""

    def __init__(self, code: pp.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _no_room(new: int, ns: Namespace) -> Refused:
    return Refused(
        pp.ErrorCode.NO_SPACE,
        f"STORE of {new} new pages exceeds the reservation "
        f"({len(ns.pages)} of {ns.reserved} pages used)",
    )


class PageStore:
    """Arena, namespaces, reservations and the requests on them. No I/O."""

    def __init__(
        self,
        capacity_pages: int,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        lock: bool = True,
        index_type: type[PageIndex] | None = None,
    ) -> None:
        """`index_type`: the namespaces' page index (default: the compiled one where it runs,
        which the compiled serving loop needs)."""
        self.arena = Arena(capacity_pages, lock=lock)
        self.index_type = index_type or page_index_type()
        self.lease_s = lease_s
        self.namespaces: dict[str, Namespace] = {}
        self.reserved_total = 0
        self.connections = 0
        self.started = time.monotonic()
        # the server's fields of STATUS (security, RDMA), set by the server that owns this store
        self.extra_status: Callable[[], dict[str, Any]] | None = None
        # called with a namespace before its slots go back to the arena (add_release_hook)
        self._release_hooks: list[Callable[[Namespace], None]] = []
        # called with a namespace whose epoch just rose (add_fence_hook)
        self._fence_hooks: list[Callable[[Namespace], None]] = []
        # requests and pages served, by kind (STATUS reports them)
        self.counters = {
            "store_requests": 0,
            "load_requests": 0,
            "free_requests": 0,
            "pages_stored": 0,
            "pages_loaded": 0,
            "pages_freed": 0,
            "refused": 0,
            "fences": 0,  # FENCE requests granted
            "fence_refused": 0,  # FENCE with a stale epoch
            "fenced_refused": 0,  # changes refused from a connection of an older epoch
        }

    @property
    def capacity_pages(self) -> int:
        return self.arena.slots

    def connection_opened(self) -> None:
        """A client connection opened (counted for STATUS and metrics)."""
        self.connections += 1

    def connection_closed(self) -> None:
        self.connections -= 1

    def refused(self) -> None:
        """A request was refused (`Refused`), having changed nothing."""
        self.counters["refused"] += 1

    def attach(self, client_id: str, owner: bytes = b"") -> tuple[Namespace, bool]:
        """An authenticated connection joins its namespace: found (resumed=True) or created.
        Refused (DENIED) when it exists and belongs to another token."""
        ns = self.namespaces.get(client_id)
        resumed = ns is not None
        if ns is not None and not auth.verify(ns.owner, owner):
            raise Refused(
                pp.ErrorCode.DENIED,
                f"namespace {client_id!r} belongs to another client (namespace token differs)",
            )
        if ns is None:
            ns = self.namespaces[client_id] = Namespace(client_id, owner, pages=self.index_type())
        if ns.timer is not None:
            ns.timer.cancel()
            ns.timer = None
        ns.expires_at = None
        ns.connections += 1
        return ns, resumed

    def detach(self, ns: Namespace, loop: asyncio.AbstractEventLoop) -> None:
        """A connection of `ns` ended: start the lease when it was the last one."""
        ns.connections -= 1
        if ns.connections > 0 or self.namespaces.get(ns.client_id) is not ns:
            return
        if not ns.pages and not ns.reserved:
            del self.namespaces[ns.client_id]
            return
        ns.expires_at = time.monotonic() + self.lease_s
        ns.timer = loop.call_later(self.lease_s, self._expire, ns)

    def _expire(self, ns: Namespace) -> None:
        if ns.connections or self.namespaces.get(ns.client_id) is not ns:
            return
        freed = self._release(ns)
        del self.namespaces[ns.client_id]
        log.info("lease of %r expired: freed %d pages", ns.client_id, freed)

    def add_release_hook(self, hook: Callable[[Namespace], None]) -> None:
        """Call `hook(ns)` whenever a namespace is released (RELEASE or lease expiry), before
        any of its slots goes back to the arena (the RDMA service drops its regions there)."""
        self._release_hooks.append(hook)

    def remove_release_hook(self, hook: Callable[[Namespace], None]) -> None:
        """Stop calling `hook` (nothing happens when it is not there)."""
        if hook in self._release_hooks:
            self._release_hooks.remove(hook)

    def add_fence_hook(self, hook: Callable[[Namespace], None]) -> None:
        """Call `hook(ns)` whenever `ns.epoch` rises, after the fencing connection took the
        new epoch: the RDMA service drops there the regions of connections of older epochs,
        which could otherwise still RDMA WRITE into the namespace."""
        self._fence_hooks.append(hook)

    def remove_fence_hook(self, hook: Callable[[Namespace], None]) -> None:
        """Stop calling `hook` (nothing happens when it is not there)."""
        if hook in self._fence_hooks:
            self._fence_hooks.remove(hook)

    def fence(self, ns: Namespace, epoch: int, conn: Any) -> int:
        """FENCE: make `epoch` the epoch of `ns` and of `conn` (the connection asking, any
        object with an `epoch` attribute), then, when it rose, call the fence hooks. Refused
        FENCED, changing nothing, when `epoch` is below the namespace's (a stale generation).
        Returns the namespace's epoch."""
        if epoch < ns.epoch:
            self.counters["fence_refused"] += 1
            raise Refused(
                pp.ErrorCode.FENCED,
                f"epoch {epoch} is stale: namespace {ns.client_id!r} is at epoch {ns.epoch}",
            )
        rose = epoch > ns.epoch
        ns.epoch = conn.epoch = epoch
        self.counters["fences"] += 1
        if rose:
            for hook in self._fence_hooks:
                hook(ns)
        return ns.epoch

    def check_epoch(self, ns: Namespace, epoch: int, what: pp.MsgType) -> None:
        """Refuse (FENCED) a request that changes `ns` (or gives write access to it) from a
        connection of epoch `epoch`, when a newer generation fenced the namespace."""
        if epoch < ns.epoch:
            self.counters["fenced_refused"] += 1
            raise Refused(
                pp.ErrorCode.FENCED,
                f"{what.name} refused: namespace {ns.client_id!r} was fenced at epoch "
                f"{ns.epoch}, this connection is at epoch {epoch}",
            )

    def _release(self, ns: Namespace) -> int:
        for hook in self._release_hooks:  # first: nothing may still reach a freed slot
            hook(ns)
        n = len(ns.pages)
        if ns.chunk_pages:
            for first, count in reversed(ns.extents):
                self.arena.free_run(first, count)
            ns.extents.clear()
            ns.chunks.clear()
            ns.spare.clear()
        else:
            free = self.arena.free
            for slot in sorted(ns.pages.values(), reverse=True):  # reused in ascending order
                free(slot)
        ns.pages.clear()
        ns.pages.resize(0)
        self.reserved_total -= ns.reserved
        ns.reserved = 0
        return n

    # --- requests (hot ones first). Refusals raise Refused; nothing changes then. ---

    def store(self, ns: Namespace, keys: tuple[int, ...], data: memoryview) -> None:
        """Write the pages. A new key of a TCP namespace gets a slot here, written whole
        below before anything else runs: no reader ever sees what the slot held before."""
        if ns.chunk_pages:  # every key's slot exists once its chunk is mapped
            cp = ns.chunk_pages
            new_chunks = sorted({k // cp for k in keys}.difference(ns.chunks))
            if len(new_chunks) > len(ns.spare):  # refused before any chunk is mapped
                raise Refused(
                    pp.ErrorCode.NO_SPACE,
                    f"STORE needs {len(new_chunks)} new chunks of {cp} pages, "
                    f"{len(ns.spare)} left in the reservation",
                )
            for chunk in new_chunks:
                self.map_chunk(ns, chunk)
        pages, mem, c = ns.pages, self.arena.memory, self.counters
        c["store_requests"] += 1
        c["pages_stored"] += len(keys)
        if len(keys) == 1:  # the swap path's common case, kept short
            k = keys[0]
            slot = pages.get(k)
            if slot is None:
                if len(pages) >= ns.reserved:
                    raise _no_room(1, ns)
                slot = pages[k] = self.arena.alloc()
            off = slot * PAGE_SIZE
            mem[off : off + PAGE_SIZE] = data
            return
        # The per-page work below runs in C (map, list methods) where it can: a STORE of
        # 64 or 128 pages is the swap-out path's common request.
        slots = list(map(pages.get, keys))
        new = slots.count(None)
        if new and len(pages) + new > ns.reserved:
            new = sum(k not in pages for k in set(keys))  # exact (keys repeated in the batch)
            if len(pages) + new > ns.reserved:
                raise _no_room(new, ns)
        if new == len(keys) and len(set(keys)) == new:  # all new, no key twice
            slots = self.arena.alloc_many(new)
            pages.update_from(zip(keys, slots, strict=True))
        elif new:
            alloc = self.arena.alloc
            for i, k in enumerate(keys):
                if slots[i] is None:
                    slot = pages.get(k)  # a key repeated in the batch keeps its first slot
                    if slot is None:
                        slot = pages[k] = alloc()
                    slots[i] = slot
        first = slots[0]
        if slots[-1] - first == len(slots) - 1 and slots == list(
            range(first, first + len(slots))
        ):  # consecutive slots: one copy
            mem[first * PAGE_SIZE : (first + len(slots)) * PAGE_SIZE] = data
            return
        src = 0
        for slot in slots:
            off = slot * PAGE_SIZE
            mem[off : off + PAGE_SIZE] = data[src : src + PAGE_SIZE]
            src += PAGE_SIZE

    def load_views(self, ns: Namespace, keys: tuple[int, ...]) -> list[memoryview]:
        """The pages as views of the arena (one per run of consecutive slots), not copied:
        only for a reply written out before anything else runs (`Connection._send`)."""
        pages, mem, c = ns.pages, self.arena.memory, self.counters
        c["load_requests"] += 1
        c["pages_loaded"] += len(keys)
        try:
            if len(keys) == 1:
                off = pages[keys[0]] * PAGE_SIZE
                return [mem[off : off + PAGE_SIZE]]
            slots = [pages[k] for k in keys]
        except KeyError as e:
            missing = sum(1 for k in keys if k not in pages)
            raise Refused(
                pp.ErrorCode.NOT_FOUND,
                f"{missing} of {len(keys)} pages not stored, first: {e.args[0]}",
            ) from None
        views, start, prev = [], slots[0], slots[0]
        for slot in itertools.islice(slots, 1, None):
            if slot != prev + 1:
                views.append(mem[start * PAGE_SIZE : (prev + 1) * PAGE_SIZE])
                start = slot
            prev = slot
        views.append(mem[start * PAGE_SIZE : (prev + 1) * PAGE_SIZE])
        return views

    def load(self, ns: Namespace, keys: tuple[int, ...]) -> bytes:
        """The pages, copied: a view of the arena could change under a reply the transport
        still buffers (the slot freed and reused, even by another namespace)."""
        views = self.load_views(ns, keys)
        return views[0].tobytes() if len(views) == 1 else b"".join(views)

    def free(self, ns: Namespace, keys: tuple[int, ...]) -> int:
        if ns.chunk_pages:  # slots stay with the namespace (its client may address them)
            self.counters["free_requests"] += 1
            return sum(1 for k in keys if k in ns.pages)
        pages, freed = ns.pages, []
        for k in keys:
            slot = pages.pop(k, None)
            if slot is not None:
                freed.append(slot)
        # Pushed in reverse, so the next batch of new pages pops them in ascending order and
        # a sequential batch again gets consecutive slots (one copy instead of one per page).
        free = self.arena.free
        for slot in reversed(freed):
            free(slot)
        n = len(freed)
        self.counters["free_requests"] += 1
        self.counters["pages_freed"] += n
        return n

    def reserve(self, ns: Namespace, want: int) -> int:
        if ns.chunk_pages:
            return self._reserve_chunks(ns, want)
        stored = len(ns.pages)
        if want < stored:
            raise Refused(
                pp.ErrorCode.BUSY,
                f"cannot reserve {want} pages: {stored} are stored; FREE them first",
            )
        available = self.capacity_pages - self.reserved_total + ns.reserved
        if want > available:
            raise Refused(
                pp.ErrorCode.NO_SPACE,
                f"cannot reserve {want} pages "
                f"({want * PAGE_SIZE >> 20} MiB): {available} available of "
                f"{self.capacity_pages}",
            )
        self._size_index(ns, want)
        self.reserved_total += want - ns.reserved
        ns.reserved = want
        return stored

    @staticmethod
    def _size_index(ns: Namespace, capacity: int) -> None:
        """Size the page index for `capacity` pages now, at RESERVE, so that storing pages
        within the reservation never allocates."""
        try:
            ns.pages.resize(capacity)
        except MemoryError:
            raise Refused(
                pp.ErrorCode.NO_SPACE,
                f"cannot allocate the page index for {capacity} pages",
            ) from None

    def release(self, ns: Namespace) -> int:
        return self._release(ns)

    # --- RDMA namespaces ---

    def open_rdma(self, ns: Namespace, chunk_pages: int) -> None:
        """Make `ns` an RDMA namespace addressed in chunks of `chunk_pages` keys (again, on a
        resume: the same size). Refused when it holds pages stored the other way."""
        if ns.chunk_pages == chunk_pages:
            return
        if ns.chunk_pages:
            raise Refused(
                pp.ErrorCode.INVALID,
                f"namespace {ns.client_id!r} is addressed in chunks of {ns.chunk_pages} "
                f"pages, not {chunk_pages}",
            )
        if ns.pages or ns.reserved:
            raise Refused(
                pp.ErrorCode.BUSY,
                f"namespace {ns.client_id!r} holds a reservation made without RDMA; "
                "RELEASE it first",
            )
        if chunk_pages > self.capacity_pages:
            raise Refused(
                pp.ErrorCode.INVALID,
                f"chunks of {chunk_pages} pages exceed the arena ({self.capacity_pages})",
            )
        ns.chunk_pages = chunk_pages

    def _reserve_chunks(self, ns: Namespace, want: int) -> int:
        """Hold at least `want` pages as whole chunks; an RDMA namespace never shrinks (its
        client may still address what it holds) until it is released."""
        cp = ns.chunk_pages
        held = len(ns.chunks) + len(ns.spare)
        need = -(-want // cp)
        if need > held:
            add = (need - held) * cp
            available = self.capacity_pages - self.reserved_total
            if add > available:
                raise Refused(
                    pp.ErrorCode.NO_SPACE,
                    f"cannot reserve {want} pages ({need} chunks of {cp}): "
                    f"{available} pages available of {self.capacity_pages}",
                )
            self._size_index(ns, ns.reserved + add)
            try:
                runs = self.arena.alloc_runs(add, cp)
            except ArenaFull as e:
                ns.pages.resize(ns.reserved)
                raise Refused(pp.ErrorCode.NO_SPACE, str(e)) from None
            for first, count in runs:
                # cleared before the RDMA service registers them (after this returns): its
                # client may read every slot of its extents, mapped or not
                self.arena.zero(first, count)
                ns.extents.append((first, count))
                ns.spare.extend(range(first + count - cp, first - 1, -cp))  # lowest on top
            self.reserved_total += add
            ns.reserved += add
        return len(ns.pages)

    def map_chunk(self, ns: Namespace, chunk: int) -> int:
        """The first slot of chunk `chunk` of RDMA namespace `ns`, mapping it from the held
        chunks when it is new (its keys then count as stored: the client may write them at
        any moment; until then they read as zeros, cleared at RESERVE). Refused NO_SPACE
        beyond the reservation."""
        first = ns.chunks.get(chunk)
        if first is not None:
            return first
        if not ns.spare:
            raise Refused(
                pp.ErrorCode.NO_SPACE,
                f"chunk {chunk} is beyond the reservation ({len(ns.chunks)} chunks of "
                f"{ns.chunk_pages} pages mapped)",
            )
        first = ns.chunks[chunk] = ns.spare.pop()
        cp = ns.chunk_pages
        ns.pages.insert_run(chunk * cp, first, cp)
        return first

    def usage(self) -> StoreUsage:
        """The arena's use, the counters and every namespace's share (for metrics)."""
        return StoreUsage(
            self.capacity_pages,
            self.arena.used_slots,
            self.reserved_total,
            self.arena.locked,
            self.connections,
            dict(self.counters),
            tuple(
                NamespaceUsage(ns.client_id, len(ns.pages), ns.reserved, ns.connections)
                for ns in self.namespaces.values()
            ),
        )

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "version": pp.PROTOCOL_VERSION,
            "page_size": PAGE_SIZE,
            "capacity_pages": self.capacity_pages,
            "used_pages": self.arena.used_slots,
            "reserved_pages": self.reserved_total,
            "free_pages": self.arena.free_slots,
            "unreserved_pages": self.capacity_pages - self.reserved_total,
            "locked": self.arena.locked,
            "lock_error": self.arena.lock_error,
            "lease_seconds": self.lease_s,
            "connections": self.connections,
            "uptime_seconds": round(now - self.started, 3),
            "counters": dict(self.counters),
            "namespaces": [
                {
                    "client_id": ns.client_id,
                    "reserved_pages": ns.reserved,
                    "stored_pages": len(ns.pages),
                    "connections": ns.connections,
                    "rdma_chunk_pages": ns.chunk_pages or None,
                    "lease_expires_in": None
                    if ns.expires_at is None
                    else round(max(0.0, ns.expires_at - now), 3),
                }
                for ns in list(self.namespaces.values())[:1000]
            ],
            "namespaces_total": len(self.namespaces),
            **(self.extra_status() if self.extra_status else {}),
        }

    def close(self) -> None:
        for ns in self.namespaces.values():
            if ns.timer is not None:
                ns.timer.cancel()
        self.arena.close()
