"""Page encryption on the owning node: a BlockStore layer that stores only ciphertext below.

Theory of operation:

- Every 4 KiB page is sealed with AES-256-GCM under a key generated when the layer is built
  (daemon start) and held in this process's memory: it is never logged, sent or derived from
  anything on disk. With `duvm daemon --state-dir` (so a restarted daemon can read its pages
  back) the key is also kept in a root-only 0600 file on the /run tmpfs (RAM, never a disk;
  `daemon_state`); without it the key exists nowhere else. The store below (RemoteStore,
  i.e. the memservers) sees ciphertext of exactly 4096 bytes per page, so nothing else
  changes: the 12-byte nonce and the 16-byte tag stay here, in a preallocated metadata table
  of 28 bytes per page (28 MiB for a 4 GiB device), which the daemon keeps locked in RAM with
  the rest of itself.
- Nonces come from one 96-bit write counter per key, so a nonce is never reused under a key.
  The page number and the nonce (which is the page's write generation) are the associated data,
  so a memserver that returns another page's ciphertext, or an older version of this page,
  fails the tag check: a read is then EIO, never wrong bytes. A never-written or trimmed page
  has no entry (nonce all zeros) and reads as zeros without asking the store below.
- A restarted daemon has a new key and an empty table, so it cannot read what its predecessor
  left on the memservers. For swap that is the right trade: swapped pages belong to processes
  that died with the kernel's swap map (a swap device is rebuilt by mkswap at every enable),
  so nothing after a restart ever needs to read them; and a key that was never on disk cannot
  be stolen from disk.
- The sealing itself is `duvm.store.page_cipher` (compiled over OpenSSL's EVP interface, or
  the pure-Python reference). The layer forwards the callback fast path: a write is sealed
  into a new buffer and handed to the store below, its nonces and tags entering the table
  only when the store acknowledged it; a read is opened in place when the store below
  completes it.
- Requests are page-aligned (the NBD layer advertises a 4096-byte minimum block); concurrent
  overlapping writes of one page are not ordered by NBD, and the kernel never issues them.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from duvm.base import accel
from duvm.store.counters import Counters, merge
from duvm.store.page_cipher import META, NONCE, TAG, TagFailure, page_cipher
from duvm.store.storage import PAGE_SIZE, BlockStore, Done, FastEntry, StorageError, StoreFilter

__all__ = ["META", "NONCE", "TAG", "CryptStore"]


@dataclass(slots=True)
class CryptCounters(Counters):
    pages_sealed: int = 0
    pages_opened: int = 0
    tag_failures: int = 0


class CryptStore(StoreFilter):
    """AES-256-GCM over `inner`, page by page; the key (inside the cipher) and the per-page
    nonce/tag table live only in this object. Forwards the fast path."""

    def __init__(self, inner: BlockStore, *, key: bytes | None = None, meta: Any = None) -> None:
        """`meta`: the nonce/tag table to use (a writable buffer of META bytes per page, all
        zeros for a new export), else a new one in this process's memory."""
        if inner.size % PAGE_SIZE:
            raise ValueError(f"size must be a multiple of {PAGE_SIZE}")
        super().__init__(inner)
        self.pages = inner.size // PAGE_SIZE
        self.cipher = page_cipher(key if key is not None else AESGCM.generate_key(bit_length=256))
        self._meta = bytearray(self.pages * META) if meta is None else meta
        self._meta_mv = memoryview(self._meta)  # nonce | tag per page; zeros = unwritten
        self.fast_path = inner.fast_path
        self.own_counters = CryptCounters()
        self.fast = crypt_path_type()(self)  # the callback fast path

    def counters(self) -> dict[str, int]:
        return merge(self.inner.counters(), self.own_counters.snapshot())

    # --- sealing and opening ---

    def reserve_nonces(self, n: int) -> None:
        """Called before `n` nonces are used (PersistentCryptStore stores the counter)."""

    def nonce_hook(self) -> Callable[[int], None] | None:
        """`reserve_nonces`, or None where it is this class's own, which does nothing: a
        compiled fast path (which asks once, when it is built) then skips the call per write.
        Any override (a subclass's method, or one set on the object) is returned, so it runs
        before every seal."""
        own = getattr(self.reserve_nonces, "__func__", None)
        return None if own is CryptStore.reserve_nonces else self.reserve_nonces

    def seal(self, first: int, data: memoryview) -> tuple[bytearray, bytearray]:
        """The pages sealed, and their nonce|tag entries (not yet in the table)."""
        n = len(data) // PAGE_SIZE
        sealed, metas = bytearray(len(data)), bytearray(n * META)
        self.reserve_nonces(n)
        try:
            self.cipher.seal(first, data, memoryview(sealed), memoryview(metas))
        except OverflowError:  # unreachable in practice (2**96 writes)
            raise StorageError(errno.EIO, "nonce space exhausted; restart the daemon") from None
        return sealed, metas

    def commit(self, first: int, metas: bytearray) -> None:
        """The store below holds the new version: the table points at it from now on. (A
        failed write leaves the old one, which the store below still holds: writes are all or
        nothing per request there too, and a partly applied one fails its tag check, never
        returning other bytes.)"""
        m = first * META
        self._meta[m : m + len(metas)] = metas
        self.own_counters.pages_sealed += len(metas) // META

    def written(self, first: int, n: int) -> int:
        return self.cipher.written(self._meta_mv[first * META : (first + n) * META])

    def open_pages(self, first: int, out: memoryview) -> None:
        """Decrypt `out` in place (unwritten pages as zeros); EIO on a failed tag, with `out`
        zeroed: unauthenticated bytes are never handed back."""
        n = len(out) // PAGE_SIZE
        try:
            opened = self.cipher.open(first, out, self._meta_mv[first * META : (first + n) * META])
        except TagFailure as e:
            self.own_counters.tag_failures += 1
            out[:] = bytes(len(out))
            raise StorageError(
                errno.EIO,
                f"page {first + e.index} failed authentication: the memserver returned bytes "
                "this node did not write there",
            ) from None
        self.own_counters.pages_opened += opened

    # --- the fast path (CryptFastPath, or its compiled twin) ---

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        return self.fast.start_write(offset, data, done, tag)

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        return self.fast.start_read(offset, out, done, tag)

    def fast_entries(self) -> tuple[FastEntry, FastEntry]:
        return self.fast.start_read, self.fast.start_write

    async def write_after(
        self, first: int, metas: bytearray, cont: Coroutine[Any, Any, None]
    ) -> None:
        """A fast write the store below continues on its coroutine path."""
        await cont
        self.commit(first, metas)

    async def read_after(
        self, first: int, out: memoryview, cont: Coroutine[Any, Any, None]
    ) -> None:
        """A fast read the store below continues on its coroutine path."""
        await cont
        self.open_pages(first, out)

    # --- the coroutine path ---

    async def write(self, offset: int, data: memoryview) -> None:
        first = offset // PAGE_SIZE
        await self.write_sealed(offset, first, *self.seal(first, data))

    async def write_sealed(
        self, offset: int, first: int, sealed: bytes | bytearray, metas: bytearray
    ) -> None:
        """Write pages already sealed (`seal`), then commit their nonces and tags."""
        await self.inner.write(offset, memoryview(sealed))
        self.commit(first, metas)

    async def read(self, offset: int, out: memoryview) -> None:
        first = offset // PAGE_SIZE
        if self.written(first, len(out) // PAGE_SIZE):
            await self.inner.read(offset, out)
        self.open_pages(first, out)

    def _forget(self, offset: int, length: int) -> None:
        m = offset // PAGE_SIZE * META
        self._meta[m : m + length // PAGE_SIZE * META] = bytes(length // PAGE_SIZE * META)

    async def trim(self, offset: int, length: int) -> None:
        await self.inner.trim(offset, length)
        self._forget(offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self.inner.write_zeroes(offset, length)
        self._forget(offset, length)  # unwritten pages read as zeros without a load

    def describe(self) -> str:
        return f"{self.inner.describe()}, pages encrypted"

    async def close(self) -> None:
        await self.inner.close()
        # Best effort: drop the cipher (its key) and the table (Python cannot promise to wipe).
        self.cipher = None  # type: ignore[assignment]
        self.fast = None  # type: ignore[assignment]  # it holds the cipher too
        self._meta[:] = bytes(len(self._meta))


class CryptFastPath:
    """The callback fast path of `store` (see BlockStore.start_write): a write is sealed into a
    new buffer and handed to the store below, its nonces and tags entering the table only
    when the store acknowledged it; a read of written pages is opened in place when the store
    below completes it. Compiled twin: `duvm.store._cryptpath` (see `crypt_path_type`)."""

    __slots__ = ("inner_read", "inner_write", "store")

    def __init__(self, store: CryptStore) -> None:
        self.store = store
        self.inner_read, self.inner_write = store.inner.fast_entries()

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        store = self.store
        first = offset // PAGE_SIZE
        if offset < 0 or first + len(data) // PAGE_SIZE > store.pages:  # never from NBD
            raise ValueError(f"pages {first}.. are outside the export")
        sealed, metas = store.seal(first, data)
        cb = partial(self._write_done, first, metas, done)
        if not self.inner_write(offset, memoryview(sealed), cb, tag):
            # declined below: the coroutine path finishes it with these bytes, sealed once
            done(tag, store.write_sealed(offset, first, sealed, metas))
        return True

    def _write_done(self, first: int, metas: bytearray, done: Done, tag: object, cont: Any) -> None:
        if cont is None:
            self.store.commit(first, metas)
            done(tag, None)
        elif isinstance(cont, BaseException):
            done(tag, cont)
        else:
            done(tag, self.store.write_after(first, metas, cont))

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        store = self.store
        first, n = offset // PAGE_SIZE, len(out) // PAGE_SIZE
        if offset < 0 or first + n > store.pages:  # never from NBD
            raise ValueError(f"pages {first}.. are outside the export")
        if not store.written(first, n):
            return False  # nothing to load: the coroutine path answers zeros
        return self.inner_read(offset, out, partial(self._read_done, first, out, done), tag)

    def _read_done(self, first: int, out: memoryview, done: Done, tag: object, cont: Any) -> None:
        if isinstance(cont, BaseException):
            done(tag, cont)
            return
        if cont is not None and not isinstance(cont, memoryview):
            done(tag, self.store.read_after(first, out, cont))
            return
        if cont is not None:  # the store's own bytes (never changed again): open a copy
            out[:] = cont
        try:
            self.store.open_pages(first, out)
        except StorageError as e:
            done(tag, e)
            return
        done(tag, None)


def crypt_path_type() -> type[CryptFastPath]:
    """The compiled `CryptFastPath` (duvm.store._cryptpath) when the compiled path runs here,
    else this one, the reference."""
    compiled = accel.load("duvm.store._cryptpath")
    return compiled.CryptFastPath if compiled is not None else CryptFastPath
