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

A second request tells a daemon which block device serves its export as swap:
`{"cmd": "swap_device", "device": "/dev/nbd0"}`, answered `{"ok": true}` (a process started
without `on_swap_device` answers `{"error": ...}`, and so does a device that is not an
absolute path under /dev/ of at most `MAX_DEVICE` characters, without changing anything).
`duvm enable`, a resume and a standby's takeover send it once the device is attached
(`try_tell_swap_device`, which never fails them); the daemon keeps it in memory and its
status names it ("swap_device"), which is how gputaskman learns that swapped-out bytes are
held by the pool. The daemon never reads a file to learn it: a read could wait on the very
swap device it serves.

A third hands a daemon the supervisor's request-timer guard (`duvm.wire.nbdguard`):
`{"cmd": "timer_guard", "guard": {...}}`, answered `{"ok": true}`, or `{"error": ...}` when the
process takes none (`on_timer_guard` not given) or the guard is malformed (the callback's
ValueError). `duvm supervise` sends it to each daemon it watches (`tell_timer_guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 4096  # a request is one short JSON object
MAX_DEVICE = 255  # the longest swap device path told (a block device's name under /dev/)
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


def device_problem(device: object) -> str | None:
    """Why `device` cannot be a told swap device (None: it can): an absolute, normalised path
    under /dev/ of printable characters, at most `MAX_DEVICE` of them. Nothing is looked up."""
    if not isinstance(device, str):
        return "'device' must be a string"
    if len(device) > MAX_DEVICE:
        return f"'device' is longer than {MAX_DEVICE} characters"
    if not device.startswith("/dev/") or len(device) == len("/dev/"):
        return "'device' must be an absolute path under /dev/"
    if not device.isprintable() or os.path.normpath(device) != device:
        return "'device' must be a normalised path under /dev/"
    return None


def _swap_device(
    req: dict[str, Any], on_swap_device: Callable[[str], None] | None
) -> dict[str, Any]:
    """The answer to a `swap_device` request (`on_swap_device` called only when it is valid)."""
    if on_swap_device is None:
        return {"error": "this process serves no swap device"}
    device = req.get("device")
    why = device_problem(device)
    if why is not None or not isinstance(device, str):
        return {"error": why or "'device' must be a string"}
    on_swap_device(device)
    return {"ok": True}


def _timer_guard(
    req: dict[str, Any], on_timer_guard: Callable[[object], None] | None
) -> dict[str, Any]:
    """The answer to a `timer_guard` request (`on_timer_guard` validates and keeps it)."""
    if on_timer_guard is None:
        return {"error": "this process takes no request-timer guard"}
    try:
        on_timer_guard(req.get("guard"))
    except ValueError as e:
        return {"error": str(e)}
    return {"ok": True}


async def start(
    path: str,
    provider: Callable[[], dict[str, Any]],
    sock: socket.socket | None = None,
    on_swap_device: Callable[[str], None] | None = None,
    on_timer_guard: Callable[[object], None] | None = None,
) -> asyncio.AbstractServer:
    """Listen on `path` (replacing a stale socket) and answer `status` with `provider()`.
    With `sock` (a Unix socket already bound and listening, owner-only: `bind`), serve on it
    and touch no file: a standby daemon's, bound before its takeover. With `on_swap_device`,
    a valid `swap_device` request calls it with the device (on the event loop: it must only
    keep it in memory); without, that request is refused. `on_timer_guard` likewise gets a
    `timer_guard` request's guard object, raising ValueError to refuse it."""
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
                elif cmd == "swap_device":
                    reply = _swap_device(req, on_swap_device)
                elif cmd == "timer_guard":
                    reply = _timer_guard(req, on_timer_guard)
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
    return _ask(path, {"cmd": "status"}, timeout)


def tell_swap_device(path: str, device: str, timeout: float = 2.0) -> None:
    """Tell the daemon answering at `path` that `device` serves its export as swap (blocking).
    Raises OSError or ValueError (a refusal, with its reason) on failure."""
    why = device_problem(device)
    if why is not None:
        raise ValueError(why)
    reply = _ask(path, {"cmd": "swap_device", "device": device}, timeout)
    if reply.get("ok") is not True:
        raise ValueError(f"the control socket did not confirm: {reply}")


def tell_timer_guard(path: str, guard: dict[str, Any], timeout: float = 2.0) -> None:
    """Hand the daemon answering at `path` the request-timer guard `guard` (its JSON form).
    Raises OSError or ValueError (a refusal, with its reason) on failure."""
    reply = _ask(path, {"cmd": "timer_guard", "guard": guard}, timeout)
    if reply.get("ok") is not True:
        raise ValueError(f"the control socket did not take it: {reply}")


def try_tell_swap_device(
    path: str, device: str | None, timeout: float = 2.0, wait: bool = True
) -> bool:
    """`tell_swap_device` that never raises, for `duvm enable`, a resume and a standby's
    takeover, which must not fail for it: False (logged at debug level) when the daemon does
    not confirm within `timeout`, or there is no device (an attachment without one). `wait`:
    a socket not there yet (a daemon just started opens it right after its NBD socket) is
    waited for, within `timeout`."""
    if not device:
        return False
    deadline = time.monotonic() + timeout
    while True:
        try:
            tell_swap_device(path, device, max(deadline - time.monotonic(), 0.05))
            return True
        except (FileNotFoundError, ConnectionRefusedError) as e:  # not listening (yet)
            if not wait or time.monotonic() >= deadline:
                log.debug("could not tell the daemon at %s its swap device: %s", path, e)
                return False
            time.sleep(0.05)
        except (OSError, ValueError) as e:
            log.debug("could not tell the daemon at %s its swap device: %s", path, e)
            return False


def _ask(path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request, one answer (an object; a bare `{"error": ...}` raises ValueError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
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
