"""Daemon state that survives the daemon: what a restarted daemon needs to keep serving.

Theory of operation
-------------------
With kernel nbd the device outlives the daemon: the kernel keeps ``/dev/nbdN`` and its swapped
pages' slots for the dead-connection timeout and requeues unanswered requests when a new
socket arrives (``NBD_CMD_RECONFIGURE``). A new daemon can only answer them correctly if it
has its predecessor's view of the pages, so that view lives in files, not only in memory:

``daemon-state.json`` and ``daemon-pages.bin`` (`duvm.store.state_files`: what each holds,
root-only, on a ramfs).

A standby daemon (`duvm daemon --standby-fd`) builds the store on these files while the
daemon still serves (`open_standby`: tables mapped shared, connections open) and, once the
daemon is dead, reads the slab map and the nonce counter again and joins its namespaces
(`Standby.take_over`); `open_store` with `resume` is the same two steps at once.

Generations: the tables' header also holds the serving daemon's generation. A fresh daemon
serves one above what the old tables said (or the clock in microseconds, if higher: a lineage
before a `duvm disable --force` may have left its namespaces on the memservers), a standby or a
resumed daemon one above its predecessor's, written into the header before use. Every
connection of the serving daemon sends FENCE with it (docs/protocol.md, Fencing), so once a
successor fenced, the memservers refuse every change from the dead daemon's connections: its
STOREs still in their send buffers at the SIGKILL can never land after the same pages written
again by the successor (the kernel resends the requests in flight at a crash within two seconds,
DECISIONS.md D48). A standby joins as the serving generation and changes nothing until it fences.

Ordering with the kernel's requeue (why a crash never serves wrong bytes)
-------------------------------------------------------------------------
A write updates the memservers first, then the CRC, then the state byte, then answers the
kernel. The kernel resends every request the dead daemon had not answered. So a crash

* before the memservers stored the write: the old CRC matches the old bytes; the resend writes.
* after they stored it, before the CRC: CRC (old) and bytes (new) disagree, so a read would be
  EIO, never the wrong bytes; the resend rewrites the page and its CRC first anyway.
* after the CRC, before the answer: the resend rewrites the same bytes: idempotent.

A trim clears the state byte before the memservers free the pages; a crash in between leaves
stale copies that read as zeros (the state says so) and are overwritten by the next write.
If the dead-connection timeout expires first, the kernel fails those requests with EIO: a
failed swap write keeps the page dirty in RAM, a failed read is an I/O error; in no case are
other bytes returned. With encryption the nonce counter is stored before a page is sealed,
so a restarted daemon never reuses a nonce under the same key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duvm.base import ramfs
from duvm.store import state_files
from duvm.store.crypt_store import CryptStore
from duvm.store.memclient_group import fence_all
from duvm.store.memserver_errors import PageServerError
from duvm.store.slab_table import SlabTable
from duvm.store.state_files import (
    PageTables,
    SavedDaemon,
    StateDir,
    StateError,
)
from duvm.store.storage import BlockStore
from duvm.wire.auth import PeerSecurity
from duvm.wire.pageproto import ErrorCode

if TYPE_CHECKING:
    from duvm.store.remote_store import RemoteStore


_LOW64 = (1 << 64) - 1


class PersistentCryptStore(CryptStore):
    """CryptStore whose nonce/tag table and nonce counter live in `tables` (daemon-pages.bin),
    with the key from daemon-state.json, so a restarted daemon can open its pages. The counter
    a request's seal will reach is stored before it seals, so no nonce is ever used twice
    under the key. Worker `worker` of a daemon with several (`duvm daemon --workers`) seals
    with nonces whose high 32 bits are its index, counting in its own slot of the tables: the
    workers share the key and never a nonce."""

    def __init__(self, inner: BlockStore, key: bytes, tables: PageTables, worker: int = 0) -> None:
        if tables.meta is None:
            raise ValueError("the page tables were created without encryption")
        super().__init__(inner, key=key, meta=tables.meta)
        self._tables = tables
        self._worker = worker
        self.reload_counter()

    def reserve_nonces(self, n: int) -> None:
        end = self.cipher.counter + n
        if end >> 64 != self._worker:  # 2**64 pages sealed by one worker: never in practice
            raise OverflowError("this worker's nonce space is exhausted")
        self._tables.set_worker_counter(self._worker, end & _LOW64)

    def reload_counter(self) -> None:
        """Continue from the counter in the tables: a standby built this store while the daemon
        it took over from went on sealing pages, so the counter it read then is stale, and
        sealing from it would use the dead daemon's nonces again under the same key."""
        self.cipher.counter = self._worker << 64 | self._tables.worker_counter(self._worker)

    async def close(self) -> None:
        await super().close()
        self._meta_mv.release()

    def unmap(self) -> None:
        """Let go of the tables' mapping without closing the store below (a worker leaving)."""
        self._meta_mv.release()


class Persisted:
    """A daemon's open state: the directory, the mapped tables and the saved fields."""

    def __init__(self, sd: StateDir, tables: PageTables, saved: SavedDaemon) -> None:
        self.dir, self.tables, self.saved = sd, tables, saved

    def save_placement(self, sets: list[list[int]]) -> None:
        self.saved.sets = [list(s) for s in sets]
        self.dir.save(self.saved)

    def placement_saver(self, table: SlabTable) -> Callable[[], None]:
        """A SlabTable.on_placement_change hook that saves once per event-loop iteration: a
        failing memserver drops a replica of every slab it holds, thousands of calls in a row.
        A crash before the save leaves a map that still names a dropped replica, which is safe:
        its stale bytes fail their checksum and the next replica is read."""
        pending = False

        def save() -> None:
            nonlocal pending
            pending = False
            self.save_placement(table.sets)

        def changed() -> None:
            nonlocal pending
            if not pending:
                pending = True
                asyncio.get_running_loop().call_soon(save)

        return changed

    def discard(self) -> None:
        """Clean shutdown (the namespaces were released): nothing left to resume."""
        self.tables.close()
        self.dir.remove()


async def open_store(
    state_dir: Path,
    peers: list[tuple[str, int]],
    size: int,
    client_id: str,
    replicas: int,
    *,
    encrypt: bool,
    resume: bool,
    export_name: str = "",
    repair: bool = True,
    security: PeerSecurity | None = None,
    transports: list[str] | None = None,
    readahead: bool = True,
) -> tuple[BlockStore, Persisted]:
    """The daemon's store on persisted state in `state_dir`.

    Fresh (`resume` False): new page tables; the namespace token of a predecessor with the same
    client id is kept (so its leftover namespaces are ours to release, not refused for a lease),
    otherwise a new random one. Resume: the saved token, slab map, tables and key (a standby's
    store, `open_standby`, taken over at once); the arguments must describe the same device.
    `readahead` is False for worker 0 of a daemon with several (`Standby.join` says why).
    Raises StateError, or StorageError from the memservers."""
    import secrets

    if resume:
        standby = await open_standby(
            state_dir,
            peers,
            size,
            client_id,
            replicas,
            export_name=export_name,
            repair=repair,
            security=security,
            transports=transports,
        )
        standby.remote.reads.readahead.enabled = readahead
        try:
            await standby.take_over()
        except BaseException:
            await standby.abandon()
            raise
        return standby.store, standby.state
    sd = StateDir(state_dir)
    sd.ensure()
    pages = size // 4096
    old: SavedDaemon | None = None
    with contextlib.suppress(StateError):
        old = sd.load() if sd.exists() else None
    token = old.token if old is not None and old.client_id == client_id else secrets.token_bytes(32)
    key = secrets.token_bytes(32) if encrypt else None
    before = state_files.generation_of(sd.pages_file)  # read before the new tables replace the file
    tables = PageTables.create(sd.pages_file, pages, encrypt)
    tables.generation = state_files.next_generation(before)
    try:
        # FENCE on every connection as the new generation (see `next_generation`)
        store = _remote_store(
            sd,
            peers,
            size,
            client_id,
            replicas,
            256,
            tables,
            token,
            tables.generation,
            repair=repair,
            security=security,
            transports=transports,
        )
        store.reads.readahead.enabled = readahead
        state = Persisted(sd, tables, _saved(store, peers, token, key, export_name))
        await store.connect()
        state.save_placement(store.table.sets)
        store.table.on_placement_change = state.placement_saver(store.table)
    except BaseException:
        tables.close()
        raise
    if key is not None:
        return PersistentCryptStore(store, key, tables), state
    return store, state


def _remote_store(
    sd: StateDir,
    peers: list[tuple[str, int]],
    size: int,
    client_id: str,
    replicas: int,
    slab_pages: int,
    tables: PageTables,
    token: bytes,
    epoch: int | None,
    **options: Any,
) -> RemoteStore:
    """The RemoteStore of a daemon or a standby on `tables`: every connection owned by `token`
    (the same owner across restarts: memserver namespace isolation), serving as generation
    `epoch`, its RDMA staging in the state directory when that is a ramfs (shared by the
    daemon, its standby and a restarted daemon: `StateDir.staging_file`). `options`:
    RemoteStore's repair, security and transports."""
    from duvm.store.remote_store import RemoteStore

    store = RemoteStore(
        peers,
        size,
        client_id,
        replicas=replicas,
        slab_pages=slab_pages,
        tables=tables.tables,
        **options,
    )
    # only on the ramfs `duvm enable` mounts: a staging file elsewhere could be swapped out
    # (tmpfs) or written back to a disk, and its pages are the ones the NIC reads and writes
    shared = ramfs.filesystem_of(sd.path) == "ramfs"
    for c in store.clients:
        c.token = token
        c.epoch = epoch
        c.staging_file = str(sd.staging_file(c.host, c.port)) if shared else None
    return store


def _saved(
    store: Any, peers: list[tuple[str, int]], token: bytes, key: bytes | None, export_name: str
) -> SavedDaemon:
    return SavedDaemon(
        size=store.size,
        slab_pages=store.table.slab_pages,
        replicas=store.replicas,
        client_id=store.client_id,
        peers=[f"{h}:{p}" for h, p in peers],
        token=token,
        key=key,
        export_name=export_name,
    )


class Standby:
    """A dead daemon's store, built before it died (`open_standby`): the page tables mapped,
    the store and its encryption built, a connection open to every memserver, nothing begun.
    `take_over` finishes the resume once the daemon is gone."""

    def __init__(self, store: BlockStore, remote: Any, state: Persisted, seen: int) -> None:
        self.store, self.remote, self.state = store, remote, state
        self._seen = seen  # daemon-state.json's identity when it was read (`_identity`)

    async def take_over(self) -> None:
        """Serve from here on: the slab map as the dead daemon last saved it, its nonce counter,
        the namespaces joined (connections lost meanwhile opened again) and the reservations
        restored. Only once the daemon that wrote the tables is gone: two writers of one page
        table would corrupt it. StateError when the state now belongs to another device.
        The map is read again only when the file was replaced since (it is saved as a new file,
        after a failover or a repair): parsing it allocates for every slab."""
        mine = self.state.saved
        if _identity(self.state.dir.state_file) != self._seen:
            saved = self.state.dir.load()  # daemon-state.json on the ramfs: never swapped out
            if (saved.token, saved.size, saved.client_id) != (
                mine.token,
                mine.size,
                mine.client_id,
            ):
                raise StateError(
                    f"{self.state.dir.state_file} now describes another device (enabled again "
                    "since this standby started); it cannot take over"
                )
            mine.sets = saved.sets
        if isinstance(self.store, PersistentCryptStore):
            self.store.reload_counter()
        await self._fence()
        table = self.remote.table
        # saved again only if the takeover changes it (a memserver lost the namespace):
        # copying and encoding the whole map would allocate for every slab
        table.on_placement_change = self.state.placement_saver(table)
        await self.remote.reattach(mine.sets)

    async def _fence(self) -> None:
        """Serve as the next generation: the memservers refuse, from now on, every change from
        the dead daemon's connections, so its writes still on their way (in its sockets' send
        buffers when it died) never land after the same pages written again here. Saved in
        the tables first, so a later successor counts on from it even if this one dies now."""
        tables = self.state.tables
        tables.generation = state_files.next_generation(tables.generation)
        results = await fence_all(self.remote.clients, tables.generation)
        refused = [
            f"{c.peer}: {r}"
            for c, r in zip(self.remote.clients, results, strict=True)
            if isinstance(r, PageServerError) and r.code == ErrorCode.FENCED
        ]
        if refused:  # a newer generation serves these namespaces: never write beside it
            raise StateError("a newer daemon holds the namespaces: " + "; ".join(refused))

    async def join(self, generation: int) -> None:
        """Serve beside the daemon that serves as `generation`, as one more of its workers
        (`duvm daemon --workers`): its slab map as it saved it, reservations as they are (a
        RESERVE of the same size changes nothing), no repair and no readahead (another
        worker's write could not drop a window here), the placement never saved from here.
        StateError when the tables now name another generation: a successor took over and
        this worker would write beside it."""
        if self.state.tables.generation != generation:
            raise StateError(
                f"the daemon serving generation {generation} is no longer the one the tables "
                f"name ({self.state.tables.generation}): not joining"
            )
        self.remote.reads.readahead.enabled = False
        await self.remote.reattach(self.state.dir.load().sets)

    async def leave(self) -> None:
        """Stop serving as a worker: connections closed, nothing released (worker 0 releases
        the pages when the daemon stops), the tables unmapped."""
        await self.remote.detach()
        if isinstance(self.store, PersistentCryptStore):
            self.store.unmap()
        self.state.tables.close()

    async def abandon(self) -> None:
        """Stop standing by: close the connections, unmap the tables; release nothing (the
        pages belong to the device the daemon serves)."""
        for c in self.remote.clients:
            await c.close()
        self.state.tables.close()


async def open_standby(
    state_dir: Path,
    peers: list[tuple[str, int]],
    size: int,
    client_id: str,
    replicas: int,
    *,
    export_name: str = "",
    repair: bool = True,
    security: PeerSecurity | None = None,
    transports: list[str] | None = None,
    worker: int = 0,
) -> Standby:
    """The store a daemon that died would need, built ahead of its death from `state_dir` (the
    saved token, slab map, tables and key; the arguments must describe the same device), with
    its memserver connections open. Raises StateError, or StorageError from the memservers."""
    sd = StateDir(state_dir)
    sd.ensure()
    seen = _identity(sd.state_file)
    old = sd.load()
    mismatch = [
        f"{what} {a!r} (saved {b!r})"
        for what, a, b in (
            ("size", size, old.size),
            ("client id", client_id, old.client_id),
            ("replicas", replicas, old.replicas),
            ("peers", [f"{h}:{p}" for h, p in peers], old.peers),
        )
        if a != b
    ]
    if mismatch:
        raise StateError(
            f"cannot resume from {sd.state_file}: it was saved for another "
            "device: " + "; ".join(mismatch)
        )
    # the memservers hold what the saved key sealed: encrypted exactly when it was
    tables = PageTables.open(sd.pages_file, size // 4096, old.key is not None)
    try:
        # joins as the serving daemon's generation (its RDMA set-up is allowed then); it
        # changes nothing before `take_over`, which fences with the next one
        store = _remote_store(
            sd,
            peers,
            size,
            client_id,
            replicas,
            old.slab_pages,
            tables,
            old.token,
            tables.generation or None,
            repair=repair,
            security=security,
            transports=transports,
        )
        state = Persisted(sd, tables, _saved(store, peers, old.token, old.key, export_name))
        state.saved.sets = old.sets
        store.table.assign(old.sets)  # built now; the takeover changes only what changed since
        await store.open_connections(old.sets)
    except BaseException:
        tables.close()
        raise
    outer = PersistentCryptStore(store, old.key, tables, worker) if old.key is not None else store
    return Standby(outer, store, state, seen)


def _identity(path: Path) -> int:
    """Which version of a file is there now: it is only ever replaced whole (`StateDir.save`:
    a new file renamed over it), so its inode number changes with every save."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1
