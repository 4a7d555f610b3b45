"""The files of a daemon's state (`duvm.store.daemon_state` says how a daemon uses them).

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

Both are root-only (files 0600 in a 0700 directory) and refused when their permissions, size
or header do not match. `duvm enable` puts the directory on a ramfs of its own
(``/run/duvm/daemon-state``, `duvm.base.ramfs`): the key is never on disk, and no page of the state
can be swapped out to the device while the daemon that would serve it back is dead.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from duvm.store.crypt_store import META

STATE_FILE = "daemon-state.json"
PAGES_FILE = "daemon-pages.bin"
STAGING_PREFIX = "rdma-staging-"  # then the memserver, .bin: one RDMA staging buffer each
FORMAT_VERSION = 1
PAGES_MAGIC = b"DUVMPGT1"
HEADER_SIZE = 4096
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, pages, nonce counter
_COUNTER_OFFSET = 24
_GENERATION_OFFSET = 32  # u64 after the header: the serving daemon's generation (FENCE epoch)
# then one u64 nonce counter per worker 1..MAX_WORKERS-1 (`duvm daemon --workers`); worker 0's
# is the header's own, so tables of a one-worker daemon read the same as before workers existed
_WORKER_COUNTERS_OFFSET = 40
MAX_WORKERS = 64
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

    def staging_file(self, host: str, port: int) -> Path:
        """The RDMA staging buffer for the memserver at `host`:`port`, which the daemon and its
        standby map shared (`duvm.store.rdma_link.new_staging`)."""
        name = "".join(c if c.isalnum() else "_" for c in f"{host}_{port}")
        return self.path / f"{STAGING_PREFIX}{name}.bin"

    def remove(self) -> None:
        """Forget the state (clean shutdown: the namespaces were released)."""
        for p in (self.state_file, self.pages_file, *self.path.glob(f"{STAGING_PREFIX}*.bin")):
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
        """Worker 0's nonce counter (the only one of a one-worker daemon)."""
        return self.worker_counter(0)

    @nonce_counter.setter
    def nonce_counter(self, value: int) -> None:
        self.set_worker_counter(0, value)

    def worker_counter(self, worker: int) -> int:
        """The last nonce counter value worker `worker` stored (its low 64 bits: the worker's
        index is the nonce's high 32, `daemon_state.PersistentCryptStore`). Each worker owns
        its own slot, so no two processes ever write one."""
        return int(struct.unpack_from("<Q", self._header, _counter_offset(worker))[0])

    def set_worker_counter(self, worker: int, value: int) -> None:
        struct.pack_into("<Q", self._header, _counter_offset(worker), value)

    @property
    def generation(self) -> int:
        """The generation of the daemon that serves these tables: each daemon that starts or
        takes over serves one above its predecessor, and fences the memservers' namespaces
        with it (FENCE), so a dead predecessor's writes still on their way are refused. 0 in
        tables written before generations existed."""
        return int(struct.unpack_from("<Q", self._header, _GENERATION_OFFSET)[0])

    @generation.setter
    def generation(self, value: int) -> None:
        struct.pack_into("<Q", self._header, _GENERATION_OFFSET, value)

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


def _counter_offset(worker: int) -> int:
    if not 0 <= worker < MAX_WORKERS:
        raise ValueError(f"worker must be 0..{MAX_WORKERS - 1}, not {worker}")
    return _COUNTER_OFFSET if worker == 0 else _WORKER_COUNTERS_OFFSET + 8 * (worker - 1)


def next_generation(previous: int) -> int:
    """The generation after `previous`: above it, and above every generation an earlier
    lineage of this device could have left on a memserver (a fresh enable after a crash finds
    its old namespaces there for a lease): the wall clock in microseconds, when that is higher."""
    return max(previous + 1, time.time_ns() // 1000)


def generation_of(path: Path) -> int:
    """The generation recorded in the page tables at `path`, 0 when there are none (or not
    readable: the clock then orders the new one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_GENERATION_OFFSET + 8)
    except OSError:
        return 0
    if len(head) < _GENERATION_OFFSET + 8 or not head.startswith(PAGES_MAGIC):
        return 0
    return int(struct.unpack_from("<Q", head, _GENERATION_OFFSET)[0])
