# cython: language_level=3
"""The encrypting filter's fast path in C: the compiled twin of `CryptFastPath` in
`duvm.store.crypt_store`, which stays the reference and documents it.

Per request the reference runs the seal or the open, the table update and the completion as
interpreted frames with a `functools.partial` per request; here:

- the compiled cipher seals straight from the request's buffer through its C entry
  (`_pagecipher.pxd`: no Python call, no typed views to validate), into a bytes object
  allocated without zeroing and filled before anyone sees it, which the memory clients send
  to every replica as it is (`memclient_send.wire_part`: no copy, no view made per send);
- the hook that reserves nonces is called before every seal, as the reference does, unless
  it is the base class's, which does nothing (`CryptStore.nonce_hook`);
- the completion is one typed object; the nonce/tag entries enter the table with one
  memcpy; whether a read's pages were ever written is judged on the table in place.

The sealing and opening are the store's cipher; the coroutine continuations and the hook are
the store's own methods, so every rule stays in one place.

tests/test_crypt_path.py holds both to the same behaviour.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t
from libc.string cimport memcmp, memcpy, memset

from duvm.store._pagecipher cimport PageCipher

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

import errno

from duvm.store.storage import StorageError

cdef enum:
    PAGE = 4096
    NONCE = 12
    META = 28

cdef unsigned char ZERO_NONCE[NONCE]
memset(ZERO_NONCE, 0, NONCE)


cdef class SealedWrite:
    """A sealed write waiting for the store below: its completion (the reference's
    `_write_done` bound by a partial)."""

    cdef CryptFastPath path
    cdef Py_ssize_t first
    cdef bytearray metas
    cdef object done

    def __call__(self, tag, cont):
        if cont is None:
            self.path.commit(self.first, self.metas)
            self.done(tag, None)
        elif isinstance(cont, BaseException):
            self.done(tag, cont)
        else:
            self.done(tag, self.path.store.write_after(self.first, self.metas, cont))


cdef class OpenedRead:
    """A read of written pages waiting for the store below: its completion (the reference's
    `_read_done` bound by a partial)."""

    cdef CryptFastPath path
    cdef Py_ssize_t first
    cdef object out, done

    def __call__(self, tag, cont):
        if isinstance(cont, BaseException):
            self.done(tag, cont)
            return
        if cont is not None and not isinstance(cont, memoryview):
            self.done(tag, self.path.store.read_after(self.first, self.out, cont))
            return
        if cont is not None:  # the store's own bytes (never changed again): open a copy
            self.out[:] = cont
        try:
            self.path.store.open_pages(self.first, self.out)
        except StorageError as e:
            self.done(tag, e)
            return
        self.done(tag, None)


cdef class CryptFastPath:
    """The callback fast path of a `CryptStore` (see the reference)."""

    cdef readonly object store
    cdef object cipher, counters, inner_read, inner_write, reserve
    cdef PageCipher sealer  # the cipher when it is the compiled one (its C entry), else None
    cdef unsigned char[::1] meta

    def __init__(self, store):
        self.store = store
        self.cipher = store.cipher
        self.sealer = self.cipher if isinstance(self.cipher, PageCipher) else None
        self.reserve = store.nonce_hook()  # None: the base class's, which does nothing
        self.counters = store.own_counters
        self.inner_read, self.inner_write = store.inner.fast_entries()
        # The store's table itself, never replaced while it is open; not its memoryview,
        # which a PersistentCryptStore releases at close while a connection may still hold
        # this object through its fast entries.
        self.meta = store._meta

    cdef int commit(self, Py_ssize_t first, bytearray metas) except -1:
        cdef Py_ssize_t n = len(metas)
        memcpy(&self.meta[first * META], PyByteArray_AS_STRING(metas), n)
        self.counters.pages_sealed += n // META
        return 0

    def start_write(self, Py_ssize_t offset, data, done, tag):
        cdef Py_ssize_t first = offset // PAGE, size = len(data), n = size // PAGE
        cdef SealedWrite w
        if offset < 0 or first + n > self.meta.shape[0] // META:
            raise ValueError(f"pages {first}.. are outside the export")
        metas = PyByteArray_FromStringAndSize(NULL, n * META)
        if self.reserve is not None:
            self.reserve(n)  # before the seal: the counter it will reach is stored first
        try:
            if self.sealer is None:  # the reference cipher: into a buffer it can write
                sealed = PyByteArray_FromStringAndSize(NULL, size)
                self.cipher.seal(first, data, sealed, metas)
            else:  # every byte written by the seal before the object is handed on
                sealed = PyBytes_FromStringAndSize(NULL, size)
                self._seal(first, data, sealed, metas, n)
        except OverflowError:  # unreachable in practice (2**96 writes)
            raise StorageError(errno.EIO, "nonce space exhausted; restart the daemon") from None
        w = SealedWrite.__new__(SealedWrite)
        w.path, w.first, w.metas, w.done = self, first, metas, done
        if not self.inner_write(offset, memoryview(sealed), w, tag):
            # declined below: the coroutine path finishes it with these bytes, sealed once
            done(tag, self.store.write_sealed(offset, first, sealed, metas))
        return True

    cdef int _seal(self, Py_ssize_t first, data, bytes sealed, bytearray metas,
                   Py_ssize_t n) except -1:
        """The compiled cipher's seal of `data` (n whole pages, as its `seal` requires) into
        the new, unshared bytes object `sealed` and `metas`, from the buffer's memory."""
        cdef Py_buffer view
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            if view.len != n * PAGE:
                raise ValueError("plain and sealed must be the same whole number of pages")
            self.sealer.seal_pages(
                <uint64_t>first,
                <const unsigned char *>view.buf,
                <unsigned char *>PyBytes_AS_STRING(sealed),
                <unsigned char *>PyByteArray_AS_STRING(metas),
                n,
            )
        finally:
            PyBuffer_Release(&view)
        return 0

    def start_read(self, Py_ssize_t offset, out, done, tag):
        cdef Py_ssize_t first = offset // PAGE, n = len(out) // PAGE, i
        cdef OpenedRead r
        if offset < 0 or first + n > self.meta.shape[0] // META:
            raise ValueError(f"pages {first}.. are outside the export")
        for i in range(first, first + n):
            if memcmp(&self.meta[i * META], ZERO_NONCE, NONCE) != 0:
                break
        else:
            return False  # nothing to load: the coroutine path answers zeros
        r = OpenedRead.__new__(OpenedRead)
        r.path, r.first, r.out, r.done = self, first, out, done
        return self.inner_read(offset, out, r, tag)
