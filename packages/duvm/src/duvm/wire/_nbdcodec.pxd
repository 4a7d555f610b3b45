# cython: language_level=3
"""The compiled NBD decoder's C interface (`duvm.wire._nbdcodec`): what another compiled
module may read without a Python call per request (the connection's compiled transmission
reads each `Request`'s fields and asks the decoder for the next one directly)."""

from libc.stdint cimport uint64_t


cdef class Request:
    cdef public int cmd
    cdef public int flags
    cdef public uint64_t cookie
    cdef public uint64_t offset
    cdef public uint64_t length
    cdef public int error
    cdef public object payload
    cdef public object buffer


cdef class BufferPool:
    cdef Py_ssize_t _keep_bytes
    cdef Py_ssize_t _min
    cdef dict _free
    cdef list _small

    cpdef object acquire(self, Py_ssize_t n)
    cpdef void release(self, object buf)


cdef class TransmissionDecoder:
    cdef readonly object export
    cdef readonly object pool
    cdef object _pool_acquire
    cdef dict _allowed
    cdef uint64_t _align
    cdef uint64_t _size
    cdef uint64_t _max_payload
    cdef int _max_rw_cmd
    cdef bytearray _buf
    cdef object _mv
    cdef unsigned char *_p
    cdef Py_ssize_t _cap
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef Request _pending
    cdef object _pay
    cdef Py_ssize_t _got
    cdef Py_ssize_t _skip
    cdef Request _skipped
    cdef bint _direct
    cdef bint _large_writes  # as nbdproto's: the next header is read alone

    cpdef Request next_request(self)
    cdef void _await_payload(self, int cmd, int flags, uint64_t cookie, uint64_t offset,
                             uint64_t length) except *
