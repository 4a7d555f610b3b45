"""Daemon state that survives the daemon: what a restarted daemon needs to keep serving.

Theory of operation
-------------------
With kernel nbd the device outlives the daemon: the kernel keeps ``/dev/nbdN`` and its swapped
pages' slots for the dead-connection timeout and requeues unanswered requests when a new
socket arrives (``NBD_CMD_RECONFIGURE``). A new daemon can only answer them correctly if it
has its predecessor's view of the pages, so that view lives in files, not only in memory:

``daemon-state.json`` (written atomically: temp file, fsync, rename; changes rarely)
    size, slab size, R, client id, peers, the namespace token that owns our namespaces on the
    memservers (a new token is refused for one lease), the slab map (slab -> peers; saved
    again whenever it changes: failover, repair) and the page-encryption key when pages are
    encrypted.
``daemon-pages.bin`` (changes on every write; mapped shared into the daemon)
    a 4 KiB header, then per page: the state byte (never written / data / lost), the
    CRC-32C of the last acknowledged bytes and, with encryption, the 28-byte nonce+tag entry;
    the header holds the encryption's nonce counter. The tables *are* the mapping
    (``MAP_SHARED`` of a file in RAM): a write costs no syscall and a SIGKILL loses nothing,
    because the bytes are in the page cache, not in the process.

A standby daemon (`duvm daemon --standby-fd`) builds the store on these files while the
daemon still serves (`open_standby`: tables mapped shared, connections open) and, once the
daemon is dead, reads the slab map and the nonce counter again and joins its namespaces
(`Standby.take_over`); `open_store` with `resume` is the same two steps at once.

Both are root-only (files 0600 in a 0700 directory) and refused when their permissions, size
or header do not match. `duvm enable` puts the directory on a ramfs of its own
(``/run/duvm/daemon-state``, `duvm.base.ramfs`): the key is never on disk, and no page of the state
can be swapped out to the device while the daemon that would serve it back is dead.

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
import json
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from duvm.store.crypt_store import META, CryptStore
from duvm.store.slab_table import SlabTable
from duvm.store.storage import BlockStore
from duvm.wire.auth import PeerSecurity

STATE_FILE = "daemon-state.json"
PAGES_FILE = "daemon-pages.bin"
FORMAT_VERSION = 1
PAGES_MAGIC = b"DUVMPGT1"
HEADER_SIZE = 4096
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, pages, nonce counter
_COUNTER_OFFSET = 24
FLAG_ENCRYPTED = 1


class StateError(Exception):
    """The persisted state is missing, unreadable, corrupt or unsafe; the message says which."""


class _ByteTable(mmap.mmap):
    """A shared mapping that answers the bytearray methods RemoteStore uses on its page-state
    table (`find` and `count` with an int, as bytearray allows)."""

    def find(self, sub: Any, start: int = 0, end: int | None = None) -> int:  # type: ignore[override]
        if isinstance(sub, int):
            sub = bytes((sub,))
        return super().find(sub, start, len(self) if end is None else end)

    def count(self, sub: int, start: int = 0, end: int | None = None) -> int:
        return self[start : len(self) if end is None else end].count(sub)


def _round(n: int) -> int:
    return -(-n // HEADER_SIZE) * HEADER_SIZE


@dataclass
class SavedDaemon:
    """The slowly changing part (daemon-state.json)."""

    size: int
    slab_pages: int
    replicas: int
    client_id: str
    peers: list[str]
    token: bytes
    sets: list[list[int]] = field(default_factory=list)
    key: bytes | None = None
    export_name: str = ""
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = asdict(self)
        d["token"] = self.token.hex()
        d["key"] = None if self.key is None else self.key.hex()
        return json.dumps(d, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> SavedDaemon:
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("version") != FORMAT_VERSION:
                raise ValueError(f"not format version {FORMAT_VERSION}")
            out = cls(
                size=int(d["size"]),
                slab_pages=int(d["slab_pages"]),
                replicas=int(d["replicas"]),
                client_id=str(d["client_id"]),
                peers=[str(p) for p in d["peers"]],
                token=bytes.fromhex(d["token"]),
                sets=[[int(i) for i in s] for s in d["sets"]],
                key=None if d.get("key") is None else bytes.fromhex(d["key"]),
                export_name=str(d.get("export_name", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"{where} is corrupt ({type(exc).__name__}: {exc}); it cannot be "
                "resumed from (disable and enable again)"
            ) from None
        if out.size <= 0 or out.slab_pages <= 0 or len(out.token) < 16 or not out.sets:
            raise StateError(f"{where} is corrupt (impossible size, slab size, token or map)")
        return out


def _check_private(path: Path, want_mode: int) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StateError(f"{path} is a symbolic link; refusing to use it")
    if st.st_uid != os.geteuid():
        raise StateError(f"{path} belongs to uid {st.st_uid}, not to us ({os.geteuid()})")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise StateError(
            f"{path} has mode {mode:04o}; it holds secrets and must be {want_mode:04o} (root only)"
        )


class StateDir:
    """The daemon's persisted state in `path` (created 0700)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.state_file = self.path / STATE_FILE
        self.pages_file = self.path / PAGES_FILE

    def ensure(self) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(self.path, 0o700)

    def exists(self) -> bool:
        return self.state_file.exists()

    def save(self, saved: SavedDaemon) -> None:
        """Atomically replace daemon-state.json (0600)."""
        self.ensure()
        tmp = self.path / f".{STATE_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, saved.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.state_file)

    def load(self) -> SavedDaemon:
        if not self.state_file.exists():
            raise StateError(f"no saved daemon state in {self.path} (nothing to resume)")
        _check_private(self.path, 0o700)
        _check_private(self.state_file, 0o600)
        try:
            text = self.state_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise StateError(f"{self.state_file} is unreadable: {exc}") from None
        return SavedDaemon.from_json(text, str(self.state_file))

    def remove(self) -> None:
        """Forget the state (clean shutdown: the namespaces were released)."""
        for p in (self.state_file, self.pages_file):
            p.unlink(missing_ok=True)


class PageTables:
    """daemon-pages.bin mapped shared: `state` (1 byte per page), `crc` (uint32 per page) and,
    when encrypted, `meta` (28 bytes per page) and the nonce counter."""

    def __init__(self, path: Path, pages: int, encrypted: bool, *, create: bool) -> None:
        self.path, self.pages, self.encrypted = Path(path), pages, encrypted
        sizes = [_round(pages), _round(4 * pages)] + ([_round(META * pages)] if encrypted else [])
        total = HEADER_SIZE + sum(sizes)
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, total)
            os.pwrite(
                fd,
                _HEADER.pack(
                    PAGES_MAGIC, FORMAT_VERSION, FLAG_ENCRYPTED if encrypted else 0, pages, 0
                ),
                0,
            )
        else:
            if not self.path.exists():
                raise StateError(
                    f"{path} is missing: the page checksums are gone, resuming "
                    "would serve unverifiable pages"
                )
            _check_private(self.path, 0o600)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            if not create:
                self._check(fd, total, pages, encrypted)
            self._maps: list[mmap.mmap] = []
            self._header = mmap.mmap(fd, HEADER_SIZE, offset=0)
            off = HEADER_SIZE
            self.state = _ByteTable(fd, pages, offset=off)
            off += sizes[0]
            crc_map = mmap.mmap(fd, sizes[1], offset=off)
            off += sizes[1]
            self.crc = memoryview(crc_map)[: 4 * pages].cast("I")
            self._maps += [self._header, self.state, crc_map]
            self.meta: mmap.mmap | None = None
            if encrypted:
                self.meta = mmap.mmap(fd, META * pages, offset=off)
                self._maps.append(self.meta)
        finally:
            os.close(fd)

    def _check(self, fd: int, total: int, pages: int, encrypted: bool) -> None:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size:
            raise StateError(f"{self.path} is truncated ({size} bytes)")
        magic, version, flags, file_pages, _ = _HEADER.unpack(head)
        if magic != PAGES_MAGIC or version != FORMAT_VERSION:
            raise StateError(f"{self.path} is not a duvm page table (bad magic or version)")
        if file_pages != pages or bool(flags & FLAG_ENCRYPTED) != encrypted:
            raise StateError(
                f"{self.path} describes {file_pages} pages "
                f"({'encrypted' if flags & FLAG_ENCRYPTED else 'plain'}), not the "
                f"{pages} ({'encrypted' if encrypted else 'plain'}) of this device"
            )
        if size != total:
            raise StateError(
                f"{self.path} is {size} bytes, expected {total} (truncated or corrupt)"
            )

    @classmethod
    def create(cls, path: Path, pages: int, encrypted: bool) -> PageTables:
        return cls(path, pages, encrypted, create=True)

    @classmethod
    def open(cls, path: Path, pages: int, encrypted: bool) -> PageTables:
        return cls(path, pages, encrypted, create=False)

    @property
    def nonce_counter(self) -> int:
        return int(struct.unpack_from("<Q", self._header, _COUNTER_OFFSET)[0])

    @nonce_counter.setter
    def nonce_counter(self, value: int) -> None:
        struct.pack_into("<Q", self._header, _COUNTER_OFFSET, value)

    @property
    def tables(self) -> tuple[_ByteTable, memoryview]:
        """(state, crc), as RemoteStore(tables=...) takes them."""
        return self.state, self.crc

    def touch(self) -> None:
        """Map every page of the tables now (one read per page): a standby that takes over
        then faults in none of them."""
        for m in self._maps:
            for off in range(0, len(m), mmap.PAGESIZE):
                m[off]

    def close(self) -> None:
        self.crc.release()
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still held: the mapping stays
                m.close()


class PersistentCryptStore(CryptStore):
    """CryptStore whose nonce/tag table and nonce counter live in `tables` (daemon-pages.bin),
    with the key from daemon-state.json, so a restarted daemon can open its pages. The counter
    a request's seal will reach is stored before it seals, so no nonce is ever used twice
    under the key."""

    def __init__(self, inner: BlockStore, key: bytes, tables: PageTables) -> None:
        if tables.meta is None:
            raise ValueError("the page tables were created without encryption")
        super().__init__(inner, key=key, meta=tables.meta)
        self._tables = tables
        self.cipher.counter = tables.nonce_counter

    def reserve_nonces(self, n: int) -> None:
        self._tables.nonce_counter = self.cipher.counter + n

    def reload_counter(self) -> None:
        """Continue from the counter in the tables: a standby built this store while the daemon
        it took over from went on sealing pages, so the counter it read then is stale, and
        sealing from it would use the dead daemon's nonces again under the same key."""
        self.cipher.counter = self._tables.nonce_counter

    async def close(self) -> None:
        await super().close()
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
) -> tuple[BlockStore, Persisted]:
    """The daemon's store on persisted state in `state_dir`.

    Fresh (`resume` False): new page tables; the namespace token of a predecessor with the same
    client id is kept (so its leftover namespaces are ours to release, not refused for a lease),
    otherwise a new random one. Resume: the saved token, slab map, tables and key (a standby's
    store, `open_standby`, taken over at once); the arguments must describe the same device.
    Raises StateError, or StorageError from the memservers."""
    import secrets

    from duvm.store.remote_store import RemoteStore

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
    tables = PageTables.create(sd.pages_file, pages, encrypt)
    try:
        store = RemoteStore(
            peers,
            size,
            client_id,
            replicas=replicas,
            slab_pages=256,
            tables=tables.tables,
            repair=repair,
            security=security,
            transports=transports,
        )
        for c in store.clients:
            c.token = token  # the same owner across restarts (memserver namespace isolation)
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
        table = self.remote.table
        # saved again only if the takeover changes it (a memserver lost the namespace):
        # copying and encoding the whole map would allocate for every slab
        table.on_placement_change = self.state.placement_saver(table)
        await self.remote.reattach(mine.sets)

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
) -> Standby:
    """The store a daemon that died would need, built ahead of its death from `state_dir` (the
    saved token, slab map, tables and key; the arguments must describe the same device), with
    its memserver connections open. Raises StateError, or StorageError from the memservers."""
    from duvm.store.remote_store import RemoteStore

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
        store = RemoteStore(
            peers,
            size,
            client_id,
            replicas=replicas,
            slab_pages=old.slab_pages,
            tables=tables.tables,
            repair=repair,
            security=security,
            transports=transports,
        )
        for c in store.clients:
            c.token = old.token  # the same owner across restarts (namespace isolation)
        state = Persisted(sd, tables, _saved(store, peers, old.token, old.key, export_name))
        state.saved.sets = old.sets
        store.table.assign(old.sets)  # built now; the takeover changes only what changed since
        await store.open_connections(old.sets)
    except BaseException:
        tables.close()
        raise
    outer = PersistentCryptStore(store, old.key, tables) if old.key is not None else store
    return Standby(outer, store, state, seen)


def _identity(path: Path) -> int:
    """Which version of a file is there now: it is only ever replaced whole (`StateDir.save`:
    a new file renamed over it), so its inode number changes with every save."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1
