"""Sans-io NBD server codec, handshake: the fixed newstyle negotiation. No sockets here.

`Handshake` speaks it (`doc/proto.md` of NetworkBlockDevice/nbd). Feed it what the client sent
(`receive_data`), send what `data_to_send()` returns. It answers options itself from the list
of `duvm.wire.nbdproto.ExportInfo`s it was given (GO, INFO, EXPORT_NAME, LIST, ABORT;
everything else is `NBD_REP_ERR_UNSUP`). When `state` becomes `TRANSMISSION`, `export` is the
chosen export and `trailing` holds any bytes the client sent after its last option, which the
transmission decoder (`duvm.wire.nbdproto`) takes next. It holds at most one option: a longer
one is skipped and refused, not buffered.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import Enum

from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import ExportInfo, NbdProtocolError, UsageError


class HandshakeState(Enum):
    CLIENT_FLAGS = "client-flags"
    OPTIONS = "options"
    TRANSMISSION = "transmission"
    CLOSED = "closed"


_GREETING = struct.pack(">QQH", C.NBDMAGIC, C.IHAVEOPT, C.FLAG_FIXED_NEWSTYLE | C.FLAG_NO_ZEROES)
_KNOWN_CLIENT_FLAGS = C.FLAG_C_FIXED_NEWSTYLE | C.FLAG_C_NO_ZEROES

# An option carries at most a name (4096 bytes) and a list of 16-bit info requests; anything
# longer is skipped and answered with NBD_REP_ERR_TOO_BIG rather than buffered.
MAX_OPTION_DATA = C.MAX_STRING + 2 * 1024 + 16


class Handshake:
    """Fixed newstyle negotiation, server side, for a fixed list of exports.

    The empty name selects the first export (the default export of the document).
    """

    def __init__(self, exports: Sequence[ExportInfo]) -> None:
        if not exports:
            raise UsageError("at least one export is needed")
        self._exports = list(exports)
        self.state = HandshakeState.CLIENT_FLAGS
        self.export: ExportInfo | None = None
        self.no_zeroes = False
        self.block_size_requested = False  # the client promised to honour our constraints
        self.close_reason: str | None = None
        self.trailing = b""
        self._in = bytearray()
        self._out = bytearray(_GREETING)
        self._skip = 0  # bytes of an over-long option still to discard
        self._skip_option = 0

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive_data(self, data: bytes) -> None:
        """Consume client bytes. Raises NbdProtocolError when the connection must be dropped."""
        if self.state in (HandshakeState.TRANSMISSION, HandshakeState.CLOSED):
            raise UsageError(f"handshake already {self.state.value}")
        self._in += data
        try:
            self._process()
        except NbdProtocolError as e:
            self.state = HandshakeState.CLOSED
            self.close_reason = str(e)
            raise

    def _find(self, name: str) -> ExportInfo | None:
        if name == "":
            return self._exports[0]
        return next((e for e in self._exports if e.name == name), None)

    def _process(self) -> None:
        buf = self._in
        while True:
            if self.state is HandshakeState.CLIENT_FLAGS:
                if len(buf) < 4:
                    return
                (cflags,) = struct.unpack_from(">I", buf)
                del buf[:4]
                if cflags & ~_KNOWN_CLIENT_FLAGS:
                    raise NbdProtocolError(f"unknown client flags 0x{cflags:x}")
                self.no_zeroes = bool(cflags & C.FLAG_C_NO_ZEROES)
                self.state = HandshakeState.OPTIONS
                continue
            if self.state is not HandshakeState.OPTIONS:
                self.trailing = bytes(buf)
                buf.clear()
                return
            if self._skip:
                n = min(self._skip, len(buf))
                del buf[:n]
                self._skip -= n
                if self._skip:
                    return
                self._reply(self._skip_option, C.REP_ERR_TOO_BIG, b"option data too long")
                continue
            if len(buf) < C.OPTION_HEADER_SIZE:
                return
            magic, option, length = C.OPTION_HEADER.unpack_from(buf)
            if magic != C.IHAVEOPT:
                raise NbdProtocolError(f"bad option magic 0x{magic:x}")
            if length > MAX_OPTION_DATA:
                if option == C.OPT_EXPORT_NAME:
                    raise NbdProtocolError("NBD_OPT_EXPORT_NAME name too long")
                del buf[: C.OPTION_HEADER_SIZE]
                self._skip, self._skip_option = length, option
                continue
            if len(buf) < C.OPTION_HEADER_SIZE + length:
                return
            data = bytes(buf[C.OPTION_HEADER_SIZE : C.OPTION_HEADER_SIZE + length])
            del buf[: C.OPTION_HEADER_SIZE + length]
            self._option(option, data)

    def _reply(self, option: int, rtype: int, data: bytes = b"") -> None:
        self._out += C.OPTION_REPLY_HEADER.pack(C.OPT_REPLY_MAGIC, option, rtype, len(data))
        self._out += data

    def _option(self, option: int, data: bytes) -> None:
        if option == C.OPT_EXPORT_NAME:
            try:
                export = self._find(data.decode())
            except UnicodeDecodeError:
                export = None
            if export is None:
                # The document leaves no way to refuse EXPORT_NAME but to disconnect.
                raise NbdProtocolError(f"NBD_OPT_EXPORT_NAME: no export named {data[:64]!r}")
            self._out += struct.pack(">QH", export.size, export.flags)
            if not self.no_zeroes:
                self._out += bytes(124)
            self._enter(export)
        elif option == C.OPT_ABORT:
            self._reply(option, C.REP_ACK)
            self.state = HandshakeState.CLOSED
            self.close_reason = "client sent NBD_OPT_ABORT"
        elif option == C.OPT_LIST:
            if data:
                self._reply(option, C.REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")
                return
            for e in self._exports:
                name = e.name.encode()
                self._reply(option, C.REP_SERVER, struct.pack(">I", len(name)) + name)
            self._reply(option, C.REP_ACK)
        elif option in (C.OPT_INFO, C.OPT_GO):
            self._info_or_go(option, data)
        else:
            self._reply(option, C.REP_ERR_UNSUP, b"option not supported")

    def _info_or_go(self, option: int, data: bytes) -> None:
        if len(data) < 6:
            self._reply(option, C.REP_ERR_INVALID, b"option data too short")
            return
        (nlen,) = struct.unpack_from(">I", data)
        if nlen > len(data) - 6 or nlen > C.MAX_STRING:
            self._reply(option, C.REP_ERR_INVALID, b"bad export name length")
            return
        (ninfo,) = struct.unpack_from(">H", data, 4 + nlen)
        if len(data) != 6 + nlen + 2 * ninfo:
            self._reply(option, C.REP_ERR_INVALID, b"option length does not match its contents")
            return
        requests = set(struct.unpack_from(f">{ninfo}H", data, 6 + nlen))
        try:
            name = data[4 : 4 + nlen].decode()
        except UnicodeDecodeError:
            self._reply(option, C.REP_ERR_INVALID, b"export name is not UTF-8")
            return
        export = self._find(name)
        if export is None:
            self._reply(option, C.REP_ERR_UNKNOWN, b"no such export")
            return
        info = C.REP_INFO
        self._reply(option, info, struct.pack(">HQH", C.INFO_EXPORT, export.size, export.flags))
        # Sent unasked too (allowed): our constraints are stricter than the defaults.
        self._reply(
            option,
            info,
            struct.pack(
                ">HIII",
                C.INFO_BLOCK_SIZE,
                export.min_block,
                export.preferred_block,
                export.max_payload,
            ),
        )
        if C.INFO_NAME in requests:
            self._reply(option, info, struct.pack(">H", C.INFO_NAME) + export.name.encode())
        if C.INFO_DESCRIPTION in requests and export.description:
            desc = export.description.encode()[: C.MAX_STRING]
            self._reply(option, info, struct.pack(">H", C.INFO_DESCRIPTION) + desc)
        self._reply(option, C.REP_ACK)
        if option == C.OPT_GO:
            self.block_size_requested = C.INFO_BLOCK_SIZE in requests
            self._enter(export)

    def _enter(self, export: ExportInfo) -> None:
        self.export = export
        self.state = HandshakeState.TRANSMISSION
