# cython: language_level=3
"""The compiled page cipher's C interface (`duvm.store._pagecipher`): what another compiled
module may call without a Python call per request (the encrypting filter's fast path seals a
write's pages through `seal_pages`)."""

from libc.stdint cimport uint32_t, uint64_t


cdef extern from "openssl/evp.h":
    ctypedef struct EVP_CIPHER_CTX:
        pass


cdef class PageCipher:
    cdef EVP_CIPHER_CTX *_enc
    cdef EVP_CIPHER_CTX *_dec
    cdef uint64_t _lo  # the 96-bit nonce counter: low 64 bits ...
    cdef uint32_t _hi  # ... and high 32 bits (the last nonce used)

    cdef int seal_pages(self, uint64_t first, const unsigned char *plain,
                        unsigned char *sealed, unsigned char *meta,
                        Py_ssize_t n) except -1
