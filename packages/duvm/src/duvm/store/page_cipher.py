"""AES-256-GCM over whole pages: the format, the pure-Python reference and the choice of path.

Theory of operation:

- A page is sealed under a 96-bit nonce taken from one counter per key (the last nonce used;
  the next page gets counter + 1, little-endian), so a nonce is never reused under a key. The
  associated data is b"duvmpage", the page number (u64, little-endian) and the nonce: a
  memserver that returns another page's ciphertext, or an older version of this page, fails
  the tag check. The ciphertext is exactly 4096 bytes; the nonce and the 16-byte tag are the
  page's 28 bytes of metadata, kept by the caller (CryptStore's table). A page whose nonce is
  zero was never written and opens as zeros.
- `PurePageCipher` (the `cryptography` package, one AESGCM call per page) is the reference;
  `duvm.store._pagecipher.PageCipher` (Cython over OpenSSL's EVP interface, no Python object
  per page) is its compiled twin with the same bytes. `page_cipher()` returns the compiled one
  unless it is not built or DUVM_PURE_PYTHON=1 (duvm.base.accel).
"""

from __future__ import annotations

from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from duvm.base import accel
from duvm.wire.pageproto import PAGE_SIZE

NONCE = 12
TAG = 16
META = NONCE + TAG  # bytes of metadata per page
KEY_SIZE = 32
LABEL = b"duvmpage"
_NO_NONCE = bytes(NONCE)
_MAX_COUNTER = (1 << 96) - 1


class TagFailure(Exception):
    """A page failed authentication; `index` is its position in the request."""

    def __init__(self, index: int) -> None:
        super().__init__(f"page {index} of the request failed authentication")
        self.index = index


class PageCipher(Protocol):
    """Seals and opens runs of whole pages under one key; owns the nonce counter."""

    counter: int

    def seal(self, first: int, plain: memoryview, sealed: memoryview, meta: memoryview) -> None:
        """Encrypt the pages of `plain` (numbered from `first`) into `sealed` (same size),
        their nonce and tag into `meta` (META bytes per page). OverflowError, having sealed
        nothing, when the counter cannot give that many nonces."""
        ...

    def written(self, meta: memoryview) -> int:
        """How many of the pages `meta` describes were ever written (nonce not zero)."""
        ...

    def open(self, first: int, data: memoryview, meta: memoryview) -> int:
        """Decrypt `data` in place (never-written pages become zeros); the number of pages
        opened. TagFailure at the first page that fails; `data` must then not be used."""
        ...


def _aad(page: int, nonce: bytes) -> bytes:
    return LABEL + page.to_bytes(8, "little") + nonce


class PurePageCipher:
    """The reference implementation (see the module docstring)."""

    def __init__(self, key: bytes, counter: int = 0) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self._aead = AESGCM(bytes(key))
        self.counter = counter

    @property
    def counter(self) -> int:
        return self._counter

    @counter.setter
    def counter(self, value: int) -> None:
        if not 0 <= value <= _MAX_COUNTER:
            raise ValueError("the nonce counter is a 96-bit unsigned integer")
        self._counter = value

    def seal(self, first: int, plain: memoryview, sealed: memoryview, meta: memoryview) -> None:
        n = len(plain) // PAGE_SIZE
        if len(plain) != n * PAGE_SIZE or len(sealed) != n * PAGE_SIZE:
            raise ValueError("plain and sealed must be the same whole number of pages")
        if len(meta) != n * META:
            raise ValueError("meta must hold 28 bytes per page")
        if self._counter + n > _MAX_COUNTER:
            raise OverflowError("nonce space exhausted")
        encrypt = self._aead.encrypt
        for i in range(n):
            self._counter += 1
            nonce = self._counter.to_bytes(NONCE, "little")
            a = i * PAGE_SIZE
            out = encrypt(nonce, plain[a : a + PAGE_SIZE], _aad(first + i, nonce))
            sealed[a : a + PAGE_SIZE] = out[:PAGE_SIZE]
            meta[i * META : (i + 1) * META] = nonce + out[PAGE_SIZE:]

    def written(self, meta: memoryview) -> int:
        return sum(
            1 for m in range(0, len(meta) - META + 1, META) if meta[m : m + NONCE] != _NO_NONCE
        )

    def open(self, first: int, data: memoryview, meta: memoryview) -> int:
        n = len(data) // PAGE_SIZE
        if len(data) != n * PAGE_SIZE or len(meta) != n * META:
            raise ValueError("data must be whole pages and meta 28 bytes per page")
        decrypt, opened = self._aead.decrypt, 0
        for i in range(n):
            a, m = i * PAGE_SIZE, i * META
            nonce = bytes(meta[m : m + NONCE])
            if nonce == _NO_NONCE:
                data[a : a + PAGE_SIZE] = bytes(PAGE_SIZE)
                continue
            try:
                plain = decrypt(
                    nonce,
                    bytes(data[a : a + PAGE_SIZE]) + meta[m + NONCE : m + META],
                    _aad(first + i, nonce),
                )
            except InvalidTag:
                raise TagFailure(i) from None
            data[a : a + PAGE_SIZE] = plain
            opened += 1
        return opened


def page_cipher(key: bytes, counter: int = 0) -> PageCipher:
    """The compiled cipher when it runs here, else the reference (accel.report() says which)."""
    compiled = accel.load("duvm.store._pagecipher")
    if compiled is not None:
        return compiled.PageCipher(key, counter)
    return PurePageCipher(key, counter)
