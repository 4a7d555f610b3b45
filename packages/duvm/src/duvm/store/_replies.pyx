# cython: language_level=3
"""The memory client's reply callback in C: the compiled twin of
`duvm.store.memclient_replies.Callback`, which stays the reference and documents it.

Two of these are made and completed per replicated 4 KiB write; completing one is a C call
into the caller's function instead of two interpreted frames (tests/test_memclient_callback.py
holds both to the same behaviour).
"""

import logging

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

log = logging.getLogger("duvm.store.memclient_replies")


cdef class Callback:
    """Stands in for a Future on the callback fast path: completing it calls `cb(None)` or
    `cb(exception)` at once, from the receive path."""

    cdef public object cb
    cdef public bint finished

    def __init__(self, cb):
        self.cb = cb
        self.finished = False

    def done(self):
        return self.finished

    def set_result(self, _):
        self._call(None)

    def set_exception(self, exc):
        self._call(exc)

    cdef void _call(self, exc) noexcept:
        self.finished = True
        try:
            self.cb(exc)
        except Exception:  # a caller's bug must not break this connection's other replies
            log.exception("memserver request callback failed")
