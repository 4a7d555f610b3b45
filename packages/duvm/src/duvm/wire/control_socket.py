"""The daemon's local status/control socket: JSON lines over a Unix socket, owner-only.

Theory of operation: the daemon listens on a Unix socket (by default its NBD socket path plus
".ctl") created with mode 0600, and additionally checks each client's credentials
(SO_PEERCRED): only root and the daemon's own user are answered, since replication state names
peers and page counts. A client writes one JSON object per line, `{"cmd": "status"}`, and reads
one JSON object per line back: the provider's dict, or `{"error": "..."}` for anything else.
Requests are tiny and answered from memory (no I/O on the hot path's behalf), so the socket
serves `duvm status` and gputaskman's system panel at any rate they poll.
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


def default_path(nbd_socket: str) -> str:
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


async def start(path: str, provider: Callable[[], dict[str, Any]]) -> asyncio.AbstractServer:
    """Listen on `path` (replacing a stale socket) and answer `status` with `provider()`."""
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

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o077)  # the socket is created owner-only, no window with looser modes
    try:
        server = await asyncio.start_unix_server(handle, path, limit=MAX_LINE)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def query(path: str, timeout: float = 2.0) -> dict[str, Any]:
    """Ask a daemon for its status (blocking). Raises OSError or ValueError on failure."""
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
        raise ValueError("the daemon's control socket answered something other than an object")
    if "error" in reply and len(reply) == 1:
        raise ValueError(f"the daemon refused: {reply['error']}")
    return reply


def daemon_status(
    store: Any, server: object, replicas: int | None, request_path: str | None = None
) -> dict[str, Any]:
    """What the daemon answers: replication health of its store (through wrapping layers such
    as encryption), the NBD server's counters and which request path it runs ("compiled" or
    "pure", duvm.base.accel). Unknown parts are None."""
    health = store.health()  # through filters; each peer's written pages included
    if health is not None:  # every layer's counters beside it, flat (BlockStore.counters)
        health = {**health, **store.counters()}
    stats = getattr(server, "stats", None)
    return {
        "pid": os.getpid(),
        "size_bytes": getattr(store, "size", None),
        "replicas": replicas,
        "request_path": request_path,
        "store": health,
        "nbd": stats.as_dict() if stats is not None else None,
    }
