"""One NBD client connection of `duvm.node.daemon.nbdserver`: the handshake, then the transmission
phase (`duvm.node.daemon.nbd_transmission`), the hot path of every swap request.

Each connection is an `asyncio.BufferedProtocol`. During the handshake it feeds bytes to a
`nbdhandshake.Handshake` (a client that does not finish within the server's handshake timeout is
dropped); once transmission starts it hands every transport event to its `Transmission`, which
decodes, dispatches and answers the requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from duvm.base.sockets import set_buffers
from duvm.node.daemon.nbd_transmission import Transmission, transmission_type
from duvm.wire.nbdhandshake import Handshake, HandshakeState
from duvm.wire.nbdproto import NbdProtocolError, transmission_decoder

if TYPE_CHECKING:
    from duvm.node.daemon.nbdserver import NBDServer

log = logging.getLogger("duvm.nbd")

DEFAULT_HANDSHAKE_TIMEOUT = 30.0  # seconds a client may take to negotiate
_SOCK_BUF = 4 << 20  # whole large replies fit, so one send per batch


class NBDConnection(asyncio.BufferedProtocol):
    """One client connection: the handshake, then its `Transmission`."""

    def __init__(self, server: NBDServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._hs: Handshake | None = Handshake([server.export])
        self._hs_buf = bytearray(4096)
        self._hs_timer: asyncio.TimerHandle | None = None
        self._tx: Transmission | None = None  # once the handshake is done
        self._write_paused = False  # before transmission starts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.peer = str(sock.getpeername() or "unix")
            _tune_socket(sock)
        self.transport.set_write_buffer_limits(high=8 << 20, low=1 << 20)
        if not server.admit(self):
            self.transport.abort()
            return
        assert self._hs is not None
        self.transport.write(self._hs.data_to_send())
        # A client that never finishes negotiating must not hold a connection slot forever.
        self._hs_timer = asyncio.get_running_loop().call_later(
            server.handshake_timeout, self._handshake_timeout
        )

    def _handshake_timeout(self) -> None:
        if self._tx is None and self.transport is not None:
            self.server.protocol_error()
            self.abort(f"no NBD handshake within {self.server.handshake_timeout:g} s")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hs_timer is not None:
            self._hs_timer.cancel()
        self.server.forget(self)
        self.transport = None
        if self._tx is not None:
            self._tx.lost()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._tx is not None:
            return self._tx.get_buffer()
        return memoryview(self._hs_buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self._tx is not None:
            self._tx.received(nbytes)
        else:
            self._handshake(bytes(self._hs_buf[:nbytes]))

    def eof_received(self) -> bool:
        # The client half-closed: finish what is in flight, then close.
        if self._tx is not None:
            self._tx.finish()
        elif self.transport is not None:
            self.transport.close()
        return True

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._tx is not None:
            self._tx.write_paused(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._tx is not None:
            self._tx.write_paused(False)

    def _handshake(self, data: bytes) -> None:
        hs = self._hs
        assert hs is not None and self.transport is not None
        try:
            hs.receive_data(data)
        except NbdProtocolError as e:
            self.server.protocol_error()
            self.transport.write(hs.data_to_send())
            self.abort(f"handshake: {e}")
            return
        out = hs.data_to_send()
        if out:
            self.transport.write(out)
        if hs.state is HandshakeState.CLOSED:
            log.debug("%s: %s", self.peer, hs.close_reason)
            self.transport.close()
        elif hs.state is HandshakeState.TRANSMISSION:
            assert hs.export is not None
            dec = transmission_decoder(hs.export, self.server.pool)
            tx = self._tx = transmission_type()(self.server, self.transport, dec, self.peer)
            self._hs = None
            if self._hs_timer is not None:
                self._hs_timer.cancel()
            if self._write_paused:
                tx.write_paused(True)
            if hs.trailing:
                tx.receive_data(hs.trailing)

    def shutdown(self) -> None:
        """Server is stopping: read nothing more, finish in-flight requests, close."""
        if self._tx is not None:
            self._tx.finish()
        elif self.transport is not None:
            self.transport.close()  # still negotiating: nothing in flight

    def abort(self, reason: str) -> None:
        if self._tx is not None:
            self._tx.abort(reason)
            return
        log.warning("%s: closing connection: %s", self.peer, reason)
        if self.transport is not None:
            self.transport.abort()


def _tune_socket(sock: socket.socket) -> None:
    """Big socket buffers (one send per reply batch) and no Nagle delay on TCP."""
    set_buffers(sock, _SOCK_BUF)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
