"""Attach the kernel's NBD client (/dev/nbdN) to the local daemon, without nbd-client.

Theory of operation
-------------------
The kernel NBD driver does not speak the handshake; a user-space client must open the
connection, negotiate the export (fixed newstyle, ``C.OPT_GO``), and then hand the connected
socket to the kernel. From then on the kernel sends transmission-phase requests on that socket
by itself. The handshake below serves both ways of handing it over:

* generic netlink (:mod:`duvm.wire.nbdnetlink`, Linux 4.12+), which :mod:`duvm.node.attach.attach`
  uses whenever the kernel's nbd family answers: no process has to stay, and a restarted daemon
  can be given the live device back (``NBD_CMD_RECONFIGURE``);
* the ioctls, below, kept only as the fallback for an nbd driver without the netlink family.

The ioctl interface needs one process to sit inside ``NBD_DO_IT`` for as long as the device is
connected (the ioctl returns only on disconnect). ``duvm enable`` exits, so attaching spawns a
small *holder* process (``python -m duvm.node.attach.kernelnbd``), detached into its own session,
that does the handshake, configures the device, locks itself in RAM, makes itself the last choice of
the OOM killer, and blocks in ``NBD_DO_IT``. The parent waits until ``/sys/block/nbdN/pid`` appears
(the kernel creates it when the device starts), so nothing touches the device before it works.

Detach: ``NBD_DISCONNECT`` then ``NBD_CLEAR_SOCK`` on the device; ``NBD_DO_IT`` returns in the
holder, which exits.

``NBD_SET_TIMEOUT`` is the request timeout: a request the daemon has not answered in that
many seconds fails with EIO instead of hanging the swapping processes forever. The ioctl
interface cannot reconnect a restarted daemon to a live device; that needs the netlink path.

The handshake functions are sans-io (bytes in, values out) so they are tested against a real
server and fuzzed; the ioctl part runs only where the kernel has nbd (tested under QEMU).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from duvm.wire import nbdconst as C

# ioctl numbers: _IO(0xab, n) from <linux/nbd.h>; _IO has no size or direction bits.
_NBD_IOC = 0xAB


def _io(nr: int) -> int:
    return (_NBD_IOC << 8) | nr


NBD_SET_SOCK = _io(0)
NBD_SET_BLKSIZE = _io(1)
NBD_SET_SIZE = _io(2)
NBD_DO_IT = _io(3)
NBD_CLEAR_SOCK = _io(4)
NBD_CLEAR_QUE = _io(5)
NBD_SET_SIZE_BLOCKS = _io(7)
NBD_DISCONNECT = _io(8)
NBD_SET_TIMEOUT = _io(9)
NBD_SET_FLAGS = _io(10)

# Handshake constants (doc/proto.md in NetworkBlockDevice/nbd).
BLOCK_SIZE = 4096  # the page size: swap writes whole pages
MAX_REPLY_DATA = 64 * 1024  # a peer cannot make us buffer more than this per option reply
MAX_REPLIES = 64


class NbdHandshakeError(Exception):
    """The server broke the protocol or refused the export."""


@dataclass(frozen=True, slots=True)
class NegotiatedExport:
    """What the server said about the export during NBD_OPT_GO."""

    size: int
    transmission_flags: int
    min_block: int | None = None
    preferred_block: int | None = None
    max_block: int | None = None

    @property
    def read_only(self) -> bool:
        return bool(self.transmission_flags & C.FLAG_READ_ONLY)


# --- sans-io pieces -------------------------------------------------------------------------


def parse_greeting(data: bytes) -> int:
    """18 bytes of server greeting -> handshake flags. Raises NbdHandshakeError."""
    if len(data) != 18:
        raise NbdHandshakeError(f"greeting is {len(data)} bytes, expected 18")
    magic, opt_magic, flags = struct.unpack(">QQH", data)
    if magic != C.NBDMAGIC:
        raise NbdHandshakeError("not an NBD server (bad magic)")
    if opt_magic != C.IHAVEOPT:
        raise NbdHandshakeError("server does not speak newstyle negotiation (oldstyle?)")
    if not flags & C.FLAG_FIXED_NEWSTYLE:
        raise NbdHandshakeError("server does not support fixed newstyle negotiation")
    return flags


def client_flags(server_flags: int) -> bytes:
    flags = C.FLAG_FIXED_NEWSTYLE | (server_flags & C.FLAG_NO_ZEROES)
    return struct.pack(">I", flags)


def build_opt_go(export_name: str = "") -> bytes:
    """NBD_OPT_GO asking for the export and its block-size constraints."""
    name = export_name.encode()
    payload = struct.pack(">I", len(name)) + name + struct.pack(">HH", 1, C.INFO_BLOCK_SIZE)
    return struct.pack(">QII", C.IHAVEOPT, C.OPT_GO, len(payload)) + payload


def parse_reply_header(data: bytes) -> tuple[int, int, int]:
    """20 bytes -> (option, reply type, data length). Raises NbdHandshakeError."""
    if len(data) != 20:
        raise NbdHandshakeError(f"option reply header is {len(data)} bytes, expected 20")
    magic, option, rtype, length = struct.unpack(">QIII", data)
    if magic != C.OPT_REPLY_MAGIC:
        raise NbdHandshakeError("bad option reply magic")
    if option != C.OPT_GO:
        raise NbdHandshakeError(f"reply for option {option}, expected NBD_OPT_GO")
    if length > MAX_REPLY_DATA:
        raise NbdHandshakeError(f"option reply of {length} bytes is over the {MAX_REPLY_DATA} cap")
    return option, rtype, length


def apply_info(info: dict[str, int], payload: bytes) -> None:
    """Fold one NBD_REP_INFO payload into `info`; unknown info types are ignored."""
    if len(payload) < 2:
        raise NbdHandshakeError("NBD_REP_INFO shorter than its type field")
    (itype,) = struct.unpack_from(">H", payload)
    if itype == C.INFO_EXPORT:
        if len(payload) != 12:
            raise NbdHandshakeError("NBD_INFO_EXPORT has the wrong length")
        info["size"], info["flags"] = struct.unpack_from(">QH", payload, 2)
    elif itype == C.INFO_BLOCK_SIZE:
        if len(payload) != 14:
            raise NbdHandshakeError("NBD_INFO_BLOCK_SIZE has the wrong length")
        info["min"], info["pref"], info["max"] = struct.unpack_from(">III", payload, 2)


def finish_info(info: dict[str, int]) -> NegotiatedExport:
    if "size" not in info:
        raise NbdHandshakeError("server acknowledged NBD_OPT_GO without NBD_INFO_EXPORT")
    return NegotiatedExport(
        info["size"], info["flags"], info.get("min"), info.get("pref"), info.get("max")
    )


# --- blocking driver over a socket ------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise NbdHandshakeError("server closed the connection during the handshake")
        got += k
    return bytes(buf)


def handshake(sock: socket.socket, export_name: str = "") -> NegotiatedExport:
    """Negotiate `export_name` with NBD_OPT_GO; on return the socket is in transmission phase."""
    server_flags = parse_greeting(_recv_exact(sock, 18))
    sock.sendall(client_flags(server_flags) + build_opt_go(export_name))
    info: dict[str, int] = {}
    for _ in range(MAX_REPLIES):
        _, rtype, length = parse_reply_header(_recv_exact(sock, 20))
        payload = _recv_exact(sock, length) if length else b""
        if rtype & C.REP_FLAG_ERROR:
            text = payload.decode(errors="replace") if payload else ""
            raise NbdHandshakeError(
                f"server refused export {export_name!r} (reply type {rtype:#x}) {text}".strip()
            )
        if rtype == C.REP_INFO:
            apply_info(info, payload)
        elif rtype == C.REP_ACK:
            return finish_info(info)
        else:
            raise NbdHandshakeError(f"unexpected reply type {rtype} to NBD_OPT_GO")
    raise NbdHandshakeError(f"more than {MAX_REPLIES} replies to NBD_OPT_GO")


def connect_unix(
    path: str, timeout: float = 10.0, export_name: str = ""
) -> tuple[socket.socket, NegotiatedExport]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        info = handshake(sock, export_name)
        sock.settimeout(None)  # the kernel owns the socket from here; it must block
    except BaseException:
        sock.close()
        raise
    return sock, info


# --- the kernel side -------------------------------------------------------------------------


def kernel_has_nbd() -> bool:
    return Path("/dev/nbd0").exists() or Path("/sys/module/nbd").exists()


def free_device(sys_block: Path = Path("/sys/block"), dev: Path = Path("/dev")) -> str | None:
    """The first /dev/nbdN that is not connected (no pid attribute, size 0)."""
    names = sorted(
        (p.name for p in sys_block.glob("nbd*") if p.name[3:].isdigit()), key=lambda n: int(n[3:])
    )
    for name in names:
        if (sys_block / name / "pid").exists():
            continue
        try:
            if int((sys_block / name / "size").read_text()) != 0:
                continue
        except (OSError, ValueError):
            continue
        if (dev / name).exists():
            return str(dev / name)
    return None


def device_started(device: str) -> bool:
    return Path("/sys/block", Path(device).name, "pid").exists()


def configure(fd: int, sock: socket.socket, info: NegotiatedExport, timeout_s: int) -> None:
    """Hand `sock` (post-handshake) and the export's geometry to the device open as `fd`."""
    blocks = info.size // BLOCK_SIZE
    if blocks == 0:
        raise NbdHandshakeError(f"export of {info.size} bytes is smaller than one page")
    fcntl.ioctl(fd, NBD_CLEAR_SOCK)  # a leftover socket from a crashed holder would block SET_SOCK
    fcntl.ioctl(fd, NBD_SET_BLKSIZE, BLOCK_SIZE)
    fcntl.ioctl(fd, NBD_SET_SIZE_BLOCKS, blocks)
    fcntl.ioctl(fd, NBD_SET_FLAGS, info.transmission_flags)
    fcntl.ioctl(fd, NBD_SET_TIMEOUT, timeout_s)
    fcntl.ioctl(fd, NBD_SET_SOCK, sock.fileno())


def disconnect(device: str) -> None:
    """Ask the kernel to end the connection; the holder's NBD_DO_IT then returns."""
    fd = os.open(device, os.O_RDWR)
    try:
        fcntl.ioctl(fd, NBD_DISCONNECT)
        with contextlib.suppress(OSError):  # already cleared when DO_IT returned first
            fcntl.ioctl(fd, NBD_CLEAR_SOCK)
    finally:
        os.close(fd)


def _protect_self() -> None:
    """Stay in RAM, realtime and out of the OOM killer's way: our death would fail every swap
    read (`duvm.base.pressure`)."""
    from duvm.base import pressure

    pressure.protect("duvm nbd holder", oom_adj=-1000)


def hold(device: str, socket_path: str, timeout_s: int, export_name: str = "") -> int:
    """Holder process body: handshake, configure, block in NBD_DO_IT until disconnected."""
    _protect_self()
    sock, info = connect_unix(socket_path, export_name=export_name)
    fd = os.open(device, os.O_RDWR)
    try:
        configure(fd, sock, info, timeout_s)
        print(
            f"duvm nbd holder: {device} <- {socket_path} ({info.size} bytes)",
            file=sys.stderr,
            flush=True,
        )
        try:
            fcntl.ioctl(fd, NBD_DO_IT)
        except OSError as exc:  # returns with an error on a dead connection, too
            print(f"duvm nbd holder: NBD_DO_IT ended: {exc}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, NBD_CLEAR_QUE)
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, NBD_CLEAR_SOCK)
    finally:
        os.close(fd)
        sock.close()
    return 0


def holder_command(device: str, socket_path: str, timeout_s: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "duvm.node.attach.kernelnbd",
        "--device",
        device,
        "--socket",
        socket_path,
        "--timeout",
        str(timeout_s),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m duvm.node.attach.kernelnbd",
        description="hold a kernel NBD device connected (internal)",
    )
    p.add_argument("--device", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--timeout", type=int, default=60)
    p.add_argument("--export-name", default="")
    a = p.parse_args(argv)
    try:
        return hold(a.device, a.socket, a.timeout, a.export_name)
    except (OSError, NbdHandshakeError) as exc:
        print(f"duvm nbd holder: {a.device}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
