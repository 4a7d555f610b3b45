# cython: language_level=3
"""AES-256-GCM over whole pages through OpenSSL's EVP interface: the compiled twin of
`duvm.store.page_cipher.PurePageCipher`, which is the reference and documents the format.

The same key, counter, nonces, associated data and layout, so both produce the same bytes and
either opens what the other sealed (tests/test_page_cipher.py compares them). One EVP context
per direction is keyed once; each page then costs one IV set, one AAD update, one update over
the page and the tag, with no Python object per page. `seal_pages` (declared in
`_pagecipher.pxd`) is the seal over raw buffers, which the encrypting filter's compiled fast
path calls without a Python call per request.
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from duvm.store.page_cipher import TagFailure

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

cdef extern from "openssl/evp.h":
    ctypedef struct EVP_CIPHER:
        pass
    ctypedef struct ENGINE:
        pass
    const EVP_CIPHER *EVP_aes_256_gcm()
    EVP_CIPHER_CTX *EVP_CIPHER_CTX_new()
    void EVP_CIPHER_CTX_free(EVP_CIPHER_CTX *ctx)
    int EVP_EncryptInit_ex(EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, ENGINE *impl,
                           const unsigned char *key, const unsigned char *iv)
    int EVP_EncryptUpdate(EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl,
                          const unsigned char *inp, int inl)
    int EVP_EncryptFinal_ex(EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl)
    int EVP_DecryptInit_ex(EVP_CIPHER_CTX *ctx, const EVP_CIPHER *cipher, ENGINE *impl,
                           const unsigned char *key, const unsigned char *iv)
    int EVP_DecryptUpdate(EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl,
                          const unsigned char *inp, int inl)
    int EVP_DecryptFinal_ex(EVP_CIPHER_CTX *ctx, unsigned char *out, int *outl)
    int EVP_CIPHER_CTX_ctrl(EVP_CIPHER_CTX *ctx, int type, int arg, void *ptr)
    enum:
        EVP_CTRL_GCM_SET_TAG

cdef extern from "openssl/params.h":
    ctypedef struct OSSL_PARAM:
        void *data
    OSSL_PARAM OSSL_PARAM_construct_octet_string(const char *key, void *buf, size_t bsize)
    OSSL_PARAM OSSL_PARAM_construct_end()

cdef extern from "openssl/core_names.h":
    const char *OSSL_CIPHER_PARAM_AEAD_TAG

cdef extern from "openssl/evp.h":
    int EVP_CIPHER_CTX_get_params(EVP_CIPHER_CTX *ctx, OSSL_PARAM *params)

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

cdef enum:
    PAGE = 4096
    NONCE = 12
    TAG = 16
    META = 28  # nonce, tag
    AAD = 28  # label (8), page number (8, little-endian), nonce (12)

cdef const unsigned char *LABEL = b"duvmpage"
cdef unsigned char ZERO_NONCE[NONCE]
memset(ZERO_NONCE, 0, NONCE)


cdef inline void _aad(unsigned char *aad, uint64_t page, const unsigned char *nonce) noexcept:
    cdef int b
    memcpy(aad, LABEL, 8)
    for b in range(8):
        aad[8 + b] = <unsigned char>((page >> (8 * b)) & 0xFF)
    memcpy(aad + 16, nonce, NONCE)


cdef class PageCipher:
    """Seal and open runs of whole pages under one key (see PurePageCipher for the contract).
    Its fields are declared in _pagecipher.pxd: the two EVP contexts and the nonce counter."""

    def __cinit__(self, const unsigned char[::1] key not None, counter=0):
        if key.shape[0] != 32:
            raise ValueError("AES-256-GCM needs a 32-byte key")
        self.counter = counter
        self._enc = EVP_CIPHER_CTX_new()
        self._dec = EVP_CIPHER_CTX_new()
        if self._enc == NULL or self._dec == NULL:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        if EVP_EncryptInit_ex(self._enc, EVP_aes_256_gcm(), NULL, &key[0], NULL) != 1:
            raise RuntimeError("EVP_EncryptInit_ex failed")
        if EVP_DecryptInit_ex(self._dec, EVP_aes_256_gcm(), NULL, &key[0], NULL) != 1:
            raise RuntimeError("EVP_DecryptInit_ex failed")

    def __dealloc__(self):
        if self._enc != NULL:
            EVP_CIPHER_CTX_free(self._enc)  # frees (and OpenSSL clears) the key schedule
        if self._dec != NULL:
            EVP_CIPHER_CTX_free(self._dec)

    @property
    def counter(self):
        """The last nonce used, as an integer (0: none yet)."""
        return (<object>self._hi << 64) | self._lo

    @counter.setter
    def counter(self, value):
        if not 0 <= value < (1 << 96):
            raise ValueError("the nonce counter is a 96-bit unsigned integer")
        self._lo = <uint64_t>(value & 0xFFFFFFFFFFFFFFFF)
        self._hi = <uint32_t>(value >> 64)

    def seal(self, uint64_t first, const unsigned char[::1] plain not None,
             unsigned char[::1] sealed not None, unsigned char[::1] meta not None):
        """Encrypt the len(plain) // 4096 pages numbered from `first` into `sealed`, writing
        each page's nonce and tag into `meta` (28 bytes per page). Raises OverflowError (and
        seals nothing) when the counter cannot give that many nonces."""
        cdef Py_ssize_t n = plain.shape[0] // PAGE
        if plain.shape[0] != n * PAGE or sealed.shape[0] != n * PAGE:
            raise ValueError("plain and sealed must be the same whole number of pages")
        if meta.shape[0] != n * META:
            raise ValueError("meta must hold 28 bytes per page")
        if n:
            self.seal_pages(first, &plain[0], &sealed[0], &meta[0], n)

    cdef int seal_pages(self, uint64_t first, const unsigned char *plain,
                        unsigned char *sealed, unsigned char *meta,
                        Py_ssize_t n) except -1:
        """`seal` over raw buffers: `plain` and `sealed` of n pages, `meta` of n * 28 bytes
        (the caller's to size). OverflowError, having sealed nothing, when the counter cannot
        give n nonces."""
        cdef Py_ssize_t i
        cdef unsigned char aad[AAD]
        cdef unsigned char *nonce
        cdef unsigned char tail[16]  # GCM's final step writes nothing; a place for it anyway
        cdef int outl, b
        cdef OSSL_PARAM get_tag[2]  # the tag read straight into meta (no ctrl translation)
        if self._hi == 0xFFFFFFFF and self._lo > 0xFFFFFFFFFFFFFFFF - <uint64_t>n:
            raise OverflowError("nonce space exhausted")
        get_tag[0] = OSSL_PARAM_construct_octet_string(OSSL_CIPHER_PARAM_AEAD_TAG, NULL, TAG)
        get_tag[1] = OSSL_PARAM_construct_end()
        for i in range(n):
            self._lo += 1
            if self._lo == 0:
                self._hi += 1
            nonce = meta + i * META
            for b in range(8):
                nonce[b] = <unsigned char>((self._lo >> (8 * b)) & 0xFF)
            for b in range(4):
                nonce[8 + b] = <unsigned char>((self._hi >> (8 * b)) & 0xFF)
            _aad(aad, first + <uint64_t>i, nonce)
            get_tag[0].data = nonce + NONCE
            if (
                EVP_EncryptInit_ex(self._enc, NULL, NULL, NULL, nonce) != 1
                or EVP_EncryptUpdate(self._enc, NULL, &outl, aad, AAD) != 1
                or EVP_EncryptUpdate(self._enc, sealed + i * PAGE, &outl, plain + i * PAGE,
                                     PAGE) != 1
                or EVP_EncryptFinal_ex(self._enc, tail, &outl) != 1
                or EVP_CIPHER_CTX_get_params(self._enc, get_tag) != 1
            ):
                raise RuntimeError("OpenSSL AES-GCM encryption failed")
        return 0

    def written(self, const unsigned char[::1] meta not None):
        """How many of the pages `meta` describes were written (their nonce is not zero)."""
        cdef Py_ssize_t n = meta.shape[0] // META, i, count = 0
        for i in range(n):
            if memcmp(&meta[i * META], ZERO_NONCE, NONCE) != 0:
                count += 1
        return count

    def open(self, uint64_t first, unsigned char[::1] data not None,
             const unsigned char[::1] meta not None):
        """Decrypt the pages in `data` in place; a page whose nonce is zero (never written)
        becomes zeros. Returns how many pages were opened; raises TagFailure(index) at the
        first page that fails authentication (`data` then holds partly opened bytes: the
        caller must not hand them out)."""
        cdef Py_ssize_t n = data.shape[0] // PAGE, i, opened = 0
        cdef unsigned char aad[AAD]
        cdef unsigned char tag[TAG]
        cdef const unsigned char *nonce
        cdef unsigned char *page
        cdef unsigned char tail[16]
        cdef int outl
        if data.shape[0] != n * PAGE or meta.shape[0] != n * META:
            raise ValueError("data must be whole pages and meta 28 bytes per page")
        for i in range(n):
            nonce = &meta[i * META]
            page = &data[i * PAGE]
            if memcmp(nonce, ZERO_NONCE, NONCE) == 0:
                memset(page, 0, PAGE)
                continue
            memcpy(tag, nonce + NONCE, TAG)
            _aad(aad, first + <uint64_t>i, nonce)
            if (
                EVP_DecryptInit_ex(self._dec, NULL, NULL, NULL, nonce) != 1
                or EVP_DecryptUpdate(self._dec, NULL, &outl, aad, AAD) != 1
                or EVP_DecryptUpdate(self._dec, page, &outl, page, PAGE) != 1
                or EVP_CIPHER_CTX_ctrl(self._dec, EVP_CTRL_GCM_SET_TAG, TAG, tag) != 1
            ):
                raise RuntimeError("OpenSSL AES-GCM decryption failed")
            if EVP_DecryptFinal_ex(self._dec, tail, &outl) != 1:
                raise TagFailure(i)
            opened += 1
        return opened
