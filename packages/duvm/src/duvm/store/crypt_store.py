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
- Requests are page-aligned (the NBD layer advertises a 4096-byte minimum block); concurrent
  overlapping writes of one page are not ordered by NBD, and the kernel never issues them.
"""

from __future__ import annotations

import errno
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from duvm.store.storage import PAGE_SIZE, BlockStore, StorageError, StoreFilter

NONCE = 12
TAG = 16
META = NONCE + TAG  # bytes of metadata per page
_AAD = struct.Struct("<8sQ")  # label, page number; the nonce itself is the generation
_LABEL = b"duvmpage"
_NO_NONCE = bytes(NONCE)


class CryptStore(StoreFilter):
    """AES-256-GCM over `inner`, page by page; the key and the per-page nonce/tag table live
    only in this object. It declines the fast path: sealing and opening run on the coroutine
    path."""

    def __init__(self, inner: BlockStore, *, key: bytes | None = None) -> None:
        if inner.size % PAGE_SIZE:
            raise ValueError(f"size must be a multiple of {PAGE_SIZE}")
        super().__init__(inner)
        self.pages = inner.size // PAGE_SIZE
        self._aead = AESGCM(key if key is not None else AESGCM.generate_key(bit_length=256))
        self._meta = bytearray(self.pages * META)  # nonce | tag per page; zeros = unwritten
        self._meta_mv = memoryview(self._meta)
        self._counter = 0  # last nonce used (as an integer)
        self.stats = {"pages_sealed": 0, "pages_opened": 0, "tag_failures": 0}

    def _next_nonce(self) -> bytes:
        self._counter += 1
        if self._counter >= 1 << 96:  # unreachable in practice (2**96 writes)
            raise StorageError(errno.EIO, "nonce space exhausted; restart the daemon")
        return self._counter.to_bytes(NONCE, "little")

    async def write(self, offset: int, data: memoryview) -> None:
        first = offset // PAGE_SIZE
        n = data.nbytes // PAGE_SIZE
        seal = self._aead.encrypt
        out = bytearray(data.nbytes)
        metas = []
        for i in range(n):
            nonce = self._next_nonce()
            a = i * PAGE_SIZE
            sealed = seal(nonce, data[a : a + PAGE_SIZE], _AAD.pack(_LABEL, first + i) + nonce)
            out[a : a + PAGE_SIZE] = sealed[:PAGE_SIZE]
            metas.append(nonce + sealed[PAGE_SIZE:])
        await self.inner.write(offset, memoryview(out))
        # Only now does the table point at the new version: a failed write leaves the old one,
        # which the store below still holds (writes are all or nothing per request there too,
        # and a partly applied one fails its tag check, never returning other bytes).
        m = first * META
        self._meta[m : m + n * META] = b"".join(metas)
        self.stats["pages_sealed"] += n

    async def read(self, offset: int, out: memoryview) -> None:
        first = offset // PAGE_SIZE
        n = out.nbytes // PAGE_SIZE
        meta = self._meta_mv
        written = [
            meta[(first + i) * META : (first + i) * META + NONCE] != _NO_NONCE for i in range(n)
        ]
        if any(written):
            await self.inner.read(offset, out)
        opened = self._aead.decrypt
        for i in range(n):
            a = i * PAGE_SIZE
            if not written[i]:
                out[a : a + PAGE_SIZE] = bytes(PAGE_SIZE)
                continue
            m = (first + i) * META
            nonce = bytes(meta[m : m + NONCE])
            try:
                plain = opened(
                    nonce,
                    bytes(out[a : a + PAGE_SIZE]) + meta[m + NONCE : m + META],
                    _AAD.pack(_LABEL, first + i) + nonce,
                )
            except InvalidTag:
                self.stats["tag_failures"] += 1
                out[:] = bytes(out.nbytes)  # never hand back unauthenticated bytes
                raise StorageError(
                    errno.EIO,
                    f"page {first + i} failed authentication: the "
                    "memserver returned bytes this node did not write "
                    "there",
                ) from None
            out[a : a + PAGE_SIZE] = plain
        self.stats["pages_opened"] += sum(written)

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
        # Best effort: drop the key object and the table (Python cannot promise to wipe).
        self._aead = None  # type: ignore[assignment]
        self._meta[:] = bytes(len(self._meta))
