"""Sans-io NBD server codec, transmission: bytes in, requests out; replies in, bytes out. No
sockets here.

Theory of operation
-------------------
The NBD protocol (`doc/proto.md` of NetworkBlockDevice/nbd) has two phases: the handshake
(`duvm.wire.nbdhandshake`, which offers the `ExportInfo`s defined here) and transmission,
this module's:

* `TransmissionDecoder` turns the request stream into `Request`s. It owns a fixed receive
  buffer so a driver can `recv_into` it (`get_buffer`/`buffer_updated`, the shape of asyncio's
  BufferedProtocol); a write payload is copied out of that buffer as soon as it arrives, or,
  when it is large, received straight into the payload buffer that becomes the store's input.
  After a large write it offers a header's room alone for the next read, so large writes in a
  row are received with no copy; after any other request, the whole buffer (many to a read).
  Every request is validated here, once (range, alignment to the advertised minimum block
  size, flags, payload size, commands the export does not offer); a bad request comes out with
  `error` set, its payload already skipped, so the connection keeps working. Only a broken
  frame (wrong magic: the stream is out of step) raises `NbdProtocolError`.

Buffering is capped: the decoder holds one receive buffer plus the payload of the request
being received; everything else is the driver's choice of how many requests to keep in
flight.

The transmission phase has a compiled twin (`duvm.wire._nbdcodec`: the same decoder, pool and
request in Cython, reading headers by pointer); `transmission_decoder()` and `buffer_pool()`
return it unless it is not built or DUVM_PURE_PYTHON=1 (duvm.base.accel). The classes here stay
the reference.

Errors inside are errno values; `wire_error` is the one place that maps them to the values the
document allows on the wire.
"""

from __future__ import annotations

import errno as _errno
from dataclasses import dataclass

from duvm.base import accel
from duvm.wire import nbdconst as C
from duvm.wire.pageproto import PAGE_SIZE


class NbdProtocolError(Exception):
    """The remote peer broke the protocol; the connection must be closed (hard disconnect)."""


class UsageError(Exception):
    """This side misused the codec (a bug in the driver, not the peer's fault)."""


@dataclass(frozen=True, slots=True)
class ExportInfo:
    """One export as offered to clients: name, size, transmission flags, size constraints."""

    name: str
    size: int
    flags: int
    min_block: int = PAGE_SIZE
    preferred_block: int = PAGE_SIZE
    max_payload: int = C.DEFAULT_MAX_PAYLOAD
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.name.encode()) > C.MAX_STRING:
            raise ValueError("export name longer than 4096 bytes")
        if not 0 <= self.size < 1 << 63:
            raise ValueError(f"bad export size {self.size}")
        for label, v in (("min_block", self.min_block), ("preferred_block", self.preferred_block)):
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{label} must be a power of two, not {v}")
        if self.min_block > C.MAX_MIN_BLOCK:
            raise ValueError("min_block must be at most 65536")
        if self.preferred_block < max(self.min_block, 512):
            raise ValueError("preferred_block must be >= max(min_block, 512)")
        if not self.preferred_block <= self.max_payload <= 0xFFFFFFFF:
            raise ValueError("max_payload must be >= preferred_block and fit 32 bits")
        if self.size % self.min_block:
            raise ValueError("export size must be a multiple of min_block")
        if not self.flags & C.FLAG_HAS_FLAGS:
            raise ValueError("transmission flags must include HAS_FLAGS")


_WIRE_ERRORS = {
    0: 0,
    _errno.EPERM: C.EPERM,
    _errno.EROFS: C.EPERM,
    _errno.EIO: C.EIO,
    _errno.ENOMEM: C.ENOMEM,
    _errno.EINVAL: C.EINVAL,
    _errno.ENOSPC: C.ENOSPC,
    _errno.EDQUOT: C.ENOSPC,
    _errno.EFBIG: C.ENOSPC,
    _errno.EOVERFLOW: C.EOVERFLOW,
    _errno.ESHUTDOWN: C.ESHUTDOWN,
}


def wire_error(err: int, flags: int = 0) -> int:
    """Map an errno value to an NBD error value; anything unexpected is EIO.

    ENOTSUP is only allowed on the wire for a FAST_ZERO write-zeroes (proto.md, "Error
    values"), so elsewhere it becomes EINVAL, as does EOVERFLOW without the DF flag.
    """
    if err in (_errno.ENOTSUP, _errno.EOPNOTSUPP):
        return C.ENOTSUP if flags & C.CMD_FLAG_FAST_ZERO else C.EINVAL
    if err == _errno.EOVERFLOW and not flags & C.CMD_FLAG_DF:
        return C.EINVAL
    return _WIRE_ERRORS.get(err, C.EIO)


def encode_simple_reply(cookie: int, error: int = 0) -> bytes:
    """A simple reply header; `error` is an NBD error value (see `wire_error`)."""
    return C.SIMPLE_REPLY.pack(C.SIMPLE_REPLY_MAGIC, error, cookie)


# --------------------------------------------------------------------------- transmission


class Request:
    """One decoded request. `error` is an errno value (0: valid, go ahead).

    For a valid WRITE, `payload` is a memoryview of the data and `buffer` the pooled buffer
    that holds it; give `buffer` back to the pool once the store is done with it.
    """

    __slots__ = ("buffer", "cmd", "cookie", "error", "flags", "length", "offset", "payload")

    def __init__(
        self,
        cmd: int,
        flags: int,
        cookie: int,
        offset: int,
        length: int,
        error: int,
        payload: memoryview | None = None,
        buffer: memoryview | None = None,
    ) -> None:
        self.cmd = cmd
        self.flags = flags
        self.cookie = cookie
        self.offset = offset
        self.length = length
        self.error = error
        self.payload = payload
        self.buffer = buffer

    def __repr__(self) -> str:
        name = C.CMD_NAMES.get(self.cmd, str(self.cmd))
        return (
            f"Request({name} flags=0x{self.flags:x} cookie={self.cookie} "
            f"offset={self.offset} length={self.length} error={self.error})"
        )


class BufferPool:
    """Reusable buffers in power-of-two size classes, so the hot path does not allocate.

    `acquire(n)` returns a memoryview of a whole class-size bytearray (at least `n` bytes);
    `release` takes that same view back. Each class keeps at most `keep_bytes` worth of free
    buffers (and at least 4).
    """

    def __init__(self, keep_bytes: int = 16 << 20, min_size: int = PAGE_SIZE) -> None:
        self._keep_bytes = keep_bytes
        self._min = min_size
        self._free: dict[int, list[memoryview]] = {}
        self._small: list[memoryview] = self._free.setdefault(min_size, [])

    def acquire(self, n: int) -> memoryview:
        """A buffer of at least `n` bytes (contents undefined)."""
        if n <= self._min:
            small = self._small
            return small.pop() if small else memoryview(bytearray(self._min))
        size = 1 << (n - 1).bit_length()
        free = self._free.get(size)
        if free:
            return free.pop()
        return memoryview(bytearray(size))

    def release(self, buf: memoryview) -> None:
        size = len(buf)
        free = self._small if size == self._min else self._free.setdefault(size, [])
        if len(free) < (self._keep_bytes // size or 1) + 4:
            free.append(buf)


_WRITE_CMDS = (C.CMD_WRITE, C.CMD_TRIM, C.CMD_WRITE_ZEROES)
_REQ_SIZE = C.REQUEST_SIZE
_REQ_MAGIC = C.REQUEST_MAGIC
_CMD_READ = C.CMD_READ
_unpack_request = C.REQUEST.unpack_from
_RANGE_CMDS = (C.CMD_READ, *_WRITE_CMDS)


def allowed_flags(flags: int) -> dict[int, int]:
    """Command -> the command flags a client may set on it, given the transmission flags."""
    fua = C.CMD_FLAG_FUA if flags & C.FLAG_SEND_FUA else 0
    allowed = {C.CMD_READ: fua, C.CMD_DISC: fua}
    if flags & C.FLAG_SEND_FLUSH:
        allowed[C.CMD_FLUSH] = fua
    if not flags & C.FLAG_READ_ONLY:
        allowed[C.CMD_WRITE] = fua
    if flags & C.FLAG_SEND_TRIM:
        allowed[C.CMD_TRIM] = fua
    if flags & C.FLAG_SEND_WRITE_ZEROES:
        allowed[C.CMD_WRITE_ZEROES] = fua | C.CMD_FLAG_NO_HOLE
    return allowed


def validate(
    export: ExportInfo, allowed: dict[int, int], cmd: int, flags: int, offset: int, length: int
) -> int:
    """The errno a request must be failed with, or 0. The rules of proto.md, in one place."""
    mask = allowed.get(cmd)
    if mask is None:
        if cmd in _WRITE_CMDS and export.flags & C.FLAG_READ_ONLY:
            return _errno.EPERM
        return _errno.EINVAL  # unknown, or a command the export does not offer
    if flags & ~mask:
        return _errno.EINVAL
    if cmd == C.CMD_READ or cmd == C.CMD_WRITE:
        if length > export.max_payload:
            return _errno.EINVAL
    elif cmd not in _RANGE_CMDS:
        # FLUSH and DISC: offset and length are reserved and must be zero.
        return _errno.EINVAL if offset or length else 0
    if offset + length > export.size:
        return _errno.ENOSPC if cmd == C.CMD_WRITE or cmd == C.CMD_WRITE_ZEROES else _errno.EINVAL
    if (offset | length) & (export.min_block - 1):
        return _errno.EINVAL
    return 0


class TransmissionDecoder:
    """Request stream -> `Request`s, validated. Feed it with get_buffer()/buffer_updated()
    (recv_into style) or receive_data(); drain it with next_request() until None."""

    # Payload bytes still to come above which the driver receives straight into the payload.
    DIRECT_MIN = 32 << 10

    def __init__(
        self, export: ExportInfo, pool: BufferPool | None = None, buffer_size: int = 256 << 10
    ) -> None:
        if buffer_size < 2 * C.REQUEST_SIZE:
            raise UsageError("receive buffer too small")
        self.export = export
        self.pool = pool if pool is not None else BufferPool()
        self._allowed = allowed_flags(export.flags)
        self._align = export.min_block - 1
        self._max_payload = export.max_payload
        # READ (0) always; WRITE (1) only on a writable export
        self._max_rw_cmd = C.CMD_READ if export.flags & C.FLAG_READ_ONLY else C.CMD_WRITE
        self._buf = bytearray(buffer_size)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._pending: Request | None = None  # a write whose payload is arriving
        self._pay: memoryview | None = None
        self._got = 0
        self._skip = 0  # payload bytes of a refused write still to discard
        self._skipped: Request | None = None
        self._direct = False
        self._large_writes = False  # the last header was a large write's: read the next alone

    # -- input

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should go (never empty)."""
        pending = self._pending
        if pending is not None and self._start == self._end:
            remaining = pending.length - self._got
            if remaining >= self.DIRECT_MIN:
                self._direct = True
                return self._pay[self._got :]  # type: ignore[index]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
            if self._large_writes and pending is None and not self._skip:
                return self._mv[:_REQ_SIZE]
        elif len(self._buf) - self._end < C.REQUEST_SIZE or self._start > len(self._buf) // 2:
            n = self._end - self._start
            self._buf[:n] = self._mv[self._start : self._end]
            self._start, self._end = 0, n
        return self._mv[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """`nbytes` were written into the view the last get_buffer() returned."""
        if self._direct:
            self._got += nbytes
            self._direct = False
        else:
            self._end += nbytes

    def receive_data(self, data: bytes) -> None:
        """Copy bytes in (for callers without recv_into); call next_request() in between
        if `data` is larger than the free buffer."""
        view = memoryview(data)
        while view:
            dst = self.get_buffer()
            n = min(len(dst), len(view))
            if n == 0:
                raise UsageError("receive buffer full: drain next_request() first")
            dst[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
            if view and not self._direct and self._end == len(self._buf):
                raise UsageError("receive buffer full: drain next_request() first")

    # -- output

    def next_request(self) -> Request | None:
        """The next complete request, or None when more bytes are needed.

        Raises NbdProtocolError on a frame that puts the stream out of step (bad magic).
        """
        while True:
            start = self._start
            avail = self._end - start
            pending = self._pending
            if pending is not None:
                want = pending.length - self._got
                if avail and want:
                    n = want if want < avail else avail
                    got = self._got
                    self._pay[got : got + n] = self._mv[start : start + n]  # type: ignore[index]
                    self._got = got + n
                    self._start = start + n
                    want -= n
                if want:
                    return None
                self._pending = self._pay = None
                return pending
            if self._skip:
                n = self._skip if self._skip < avail else avail
                self._start += n
                self._skip -= n
                if self._skip:
                    return None
                skipped, self._skipped = self._skipped, None
                return skipped
            if avail < _REQ_SIZE:
                return None
            magic, flags, cmd, cookie, offset, length = _unpack_request(self._buf, start)
            start += _REQ_SIZE
            self._start = start
            self._large_writes = cmd == C.CMD_WRITE and length >= self.DIRECT_MIN
            if magic != _REQ_MAGIC:
                raise NbdProtocolError(f"bad request magic 0x{magic:08x}")
            # Fast path: a plain aligned in-range READ or WRITE needs no further checks.
            if (
                cmd <= self._max_rw_cmd
                and not flags
                and not (offset | length) & self._align
                and offset + length <= self.export.size
                and length <= self._max_payload
            ):
                if cmd == _CMD_READ or not length:
                    return Request(cmd, flags, cookie, offset, length, 0)
                buf = self.pool.acquire(length)
                pay = buf if len(buf) == length else buf[:length]
                if avail - _REQ_SIZE >= length:  # whole payload already here: one copy
                    pay[:] = self._mv[start : start + length]
                    self._start = start + length
                    return Request(cmd, flags, cookie, offset, length, 0, pay, buf)
                self._pay, self._got = pay, 0
                self._pending = Request(cmd, flags, cookie, offset, length, 0, pay, buf)
                continue
            err = validate(self.export, self._allowed, cmd, flags, offset, length)
            if cmd != C.CMD_WRITE or not length:
                return Request(cmd, flags, cookie, offset, length, err)
            if err:
                # The payload follows anyway: skip it so the next request is read in step.
                self._skip = length
                self._skipped = Request(cmd, flags, cookie, offset, length, err)
                continue
            buf = self.pool.acquire(length)
            pay = buf if len(buf) == length else buf[:length]
            self._pay, self._got = pay, 0
            self._pending = Request(cmd, flags, cookie, offset, length, 0, pay, buf)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet turned into requests (for tests and diagnostics)."""
        return self._end - self._start

    @property
    def mid_request(self) -> bool:
        """True while a request header or payload is only partly received."""
        return bool(self._pending or self._skip or self._end != self._start)


def buffer_pool() -> BufferPool:
    """The compiled pool when the compiled path runs here, else the reference."""
    compiled = accel.load("duvm.wire._nbdcodec")
    return compiled.BufferPool() if compiled is not None else BufferPool()


def transmission_decoder(export: ExportInfo, pool: BufferPool) -> TransmissionDecoder:
    """The compiled decoder when the compiled path runs here, else the reference (both take
    either pool)."""
    compiled = accel.load("duvm.wire._nbdcodec")
    if compiled is not None:
        return compiled.TransmissionDecoder(export, pool)
    return TransmissionDecoder(export, pool)
