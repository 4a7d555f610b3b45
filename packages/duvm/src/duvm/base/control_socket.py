"""The local status socket of a duvm process (the daemon's, a memserver's): JSON lines over
a Unix socket, owner-only; what each answers is its own (`duvm.node.daemon.status`,
`MemServer.local_status`).

Theory of operation: the process listens on a Unix socket (the daemon's by default its NBD
socket path plus ".ctl", `default_path`) created with mode 0600, and additionally checks each
client's credentials (SO_PEERCRED): only root and the process's own user are answered, since
its status names peers and page counts. A client writes one JSON object per line,
`{"cmd": "status"}`, and reads one JSON object per line back: the provider's dict, or
`{"error": "..."}` for anything else. Requests are tiny and answered from memory (no I/O on the
hot path's behalf), so the socket serves `duvm status` and gputaskman's system panel at any
rate they poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 4096  # a request is one short JSON object
_UCRED = struct.Struct("3i")  # pid, uid, gid


# A standby daemon's sockets carry this suffix until its supervisor gives them the daemon's
# names (`duvm.node.daemon.standby`, `duvm.node.lifecycle.resume.adopt`).
STANDBY_SUFFIX = ".standby"


def default_path(nbd_socket: str) -> str:
    """Where the daemon serving `nbd_socket` answers (also where `duvm status` asks)."""
    return f"{nbd_socket}.ctl"


def _peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    return _UCRED.unpack(raw)[1]


async def start(
    path: str, provider: Callable[[], dict[str, Any]], sock: socket.socket | None = None
) -> asyncio.AbstractServer:
    """Listen on `path` (replacing a stale socket) and answer `status` with `provider()`.
    With `sock` (a Unix socket already bound and listening, owner-only: `bind`), serve on it
    and touch no file: a standby daemon's, bound before its takeover."""
    allowed = {0, os.getuid()}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if _peer_uid(writer) not in allowed:
                writer.write(b'{"error": "permission denied"}\n')
                return
            while line := await reader.readline():
                try:
                    req = json.loads(line)
                    cmd = req.get("cmd") if isinstance(req, dict) else None
                except ValueError:
                    cmd = None
                if cmd == "status":
                    reply: dict[str, Any] = provider()
                else:
                    reply = {"error": 'unknown request; send {"cmd": "status"}'}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError) as e:
            log.debug("control client dropped: %s", e)
        finally:
            writer.close()

    if sock is not None:
        return await asyncio.start_unix_server(handle, sock=sock, limit=MAX_LINE)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o077)  # the socket is created owner-only, no window with looser modes
    try:
        server = await asyncio.start_unix_server(handle, path, limit=MAX_LINE)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def bind(path: str) -> socket.socket:
    """A Unix socket bound at `path` (owner-only, replacing a stale one) and listening, for
    `start(..., sock=)` later."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def query(path: str, timeout: float = 2.0) -> dict[str, Any]:
    """Ask a process for its status (blocking). Raises OSError or ValueError on failure."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(b'{"cmd": "status"}\n')
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    reply = json.loads(buf)
    if not isinstance(reply, dict):
        raise ValueError("the control socket answered something other than an object")
    if "error" in reply and len(reply) == 1:
        raise ValueError(f"the control socket refused: {reply['error']}")
    return reply
