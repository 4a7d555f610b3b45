"""The kernel NBD driver's generic-netlink interface: connect, reconfigure, disconnect, and
its reports of dead connections.

Theory of operation
-------------------
Since Linux 4.12 the nbd driver registers a generic-netlink family ``"nbd"``
(``<linux/nbd-netlink.h>``). Unlike the ioctls, it needs no process to sit in ``NBD_DO_IT``:

* ``NBD_CMD_CONNECT`` hands the kernel connected, post-handshake socket fds
  (``NBD_ATTR_SOCKETS``), the export's size, block size and flags, the request timeout and the
  *dead-connection timeout*. The kernel takes its own reference on each socket, so the caller
  closes its fds and may exit; the device stays configured until ``NBD_CMD_DISCONNECT``.
* When the server end of a socket dies, the kernel marks it dead. New requests then wait up to
  the dead-connection timeout for a replacement, and requests that were in flight are requeued
  when their request timer fires, instead of failing with EIO.
* ``NBD_CMD_RECONFIGURE`` with a new socket fd replaces a *dead* socket on the live device.
  That is how a restarted daemon gets its device back with every swapped page still
  addressable. When none is dead yet (the driver's receive worker has not read the old
  server's end of file), the 6.1 driver drops the new socket and answers success
  (`nbd_genl_reconfigure` turns its ``-ENOSPC`` into 0): the caller must find out from the
  server whether the connection is held (`duvm.node.lifecycle.resume.adopt` does).
* Each time one of a device's connections goes from live to dead, the driver multicasts
  ``NBD_CMD_LINK_DEAD`` with the device's index to the family's group ``"nbd_mc_group"``
  (`subscribe_link_dead`). Its receive worker marks its connection slot dead when its loop
  ends, whatever socket the slot holds by then: a worker that ran late can cut the connection
  that replaced its own (`duvm.node.lifecycle.linkmend` hands another).

This module is a small, typed encoder/decoder for exactly these messages (netlink header,
generic-netlink header, attributes, nested attributes, ``NLMSG_ERROR``) plus the blocking
request/ack exchange over an ``AF_NETLINK`` socket. A library (pyroute2) was considered: it has
no nbd family definitions, so it would only replace the ~100 lines of attribute packing below
with a large dependency; these few messages are easier to audit, and the decoder is
fuzz-tested. The encoders are pure (bytes out) and are checked against the kernel's own
``nlctrl`` family on any Linux host, the nbd commands under QEMU (tools/qemu_guest).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_GENERIC = 16
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
CTRL_ATTR_MCAST_GROUPS = 7  # nested: one nested item per group { NAME str, ID u32 }
CTRL_ATTR_MCAST_GRP_NAME = 1
CTRL_ATTR_MCAST_GRP_ID = 2
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NLA_F_NESTED = 1 << 15
NLA_TYPE_MASK = ~((1 << 15) | (1 << 14)) & 0xFFFF

# <linux/nbd-netlink.h>
NBD_GENL_FAMILY_NAME = "nbd"
NBD_GENL_VERSION = 1
NBD_CMD_CONNECT, NBD_CMD_DISCONNECT, NBD_CMD_RECONFIGURE = 1, 2, 3
NBD_CMD_LINK_DEAD = 4  # multicast to NBD_GENL_MCAST_GROUP_NAME, with NBD_ATTR_INDEX
NBD_GENL_MCAST_GROUP_NAME = "nbd_mc_group"
NBD_ATTR_INDEX = 1  # u32
NBD_ATTR_SIZE_BYTES = 2  # u64
NBD_ATTR_BLOCK_SIZE_BYTES = 3  # u64
NBD_ATTR_TIMEOUT = 4  # u64, seconds
NBD_ATTR_SERVER_FLAGS = 5  # u64
NBD_ATTR_CLIENT_FLAGS = 6  # u64
NBD_ATTR_SOCKETS = 7  # nested: NBD_SOCK_ITEM { NBD_SOCK_FD u32 }
NBD_ATTR_DEAD_CONN_TIMEOUT = 8  # u64, seconds
NBD_SOCK_ITEM = 1
NBD_SOCK_FD = 1

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host byte order)
_GENLHDR = struct.Struct("=BBH")  # cmd, version, reserved
_NLATTR = struct.Struct("=HH")  # len, type
MAX_REPLY = 1 << 16
LOST = -1  # in place of a device index: reports were lost (or garbled), any device may be meant


class NetlinkError(OSError):
    """The kernel refused a request (errno set), or sent something that is not netlink."""


class FamilyNotFound(NetlinkError):
    """No generic-netlink family of that name: the module is not loaded or too old."""


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded netlink message: header fields and the payload after the header."""

    type: int
    flags: int
    seq: int
    pid: int
    payload: bytes


# --- encoding -------------------------------------------------------------------------------


def _align(n: int) -> int:
    return (n + 3) & ~3


def nla(atype: int, value: bytes) -> bytes:
    """One attribute: header, value, zero padding to 4 bytes."""
    length = _NLATTR.size + len(value)
    if length > 0xFFFF:
        raise ValueError(f"attribute {atype} of {len(value)} bytes does not fit netlink")
    return _NLATTR.pack(length, atype) + value + bytes(_align(length) - length)


def nla_u32(atype: int, value: int) -> bytes:
    return nla(atype, struct.pack("=I", value))


def nla_u64(atype: int, value: int) -> bytes:
    return nla(atype, struct.pack("=Q", value))


def nla_str(atype: int, value: str) -> bytes:
    return nla(atype, value.encode() + b"\0")


def nla_nested(atype: int, *children: bytes) -> bytes:
    return nla(atype | NLA_F_NESTED, b"".join(children))


def genl_message(
    family: int,
    cmd: int,
    attrs: bytes,
    seq: int,
    *,
    version: int = 1,
    flags: int = NLM_F_REQUEST | NLM_F_ACK,
) -> bytes:
    """A complete generic-netlink request."""
    body = _GENLHDR.pack(cmd, version, 0) + attrs
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), family, flags, seq, 0) + body


def sockets_attr(fds: list[int]) -> bytes:
    return nla_nested(
        NBD_ATTR_SOCKETS, *(nla_nested(NBD_SOCK_ITEM, nla_u32(NBD_SOCK_FD, fd)) for fd in fds)
    )


def connect_attrs(
    index: int,
    fds: list[int],
    size: int,
    *,
    block_size: int = 4096,
    server_flags: int = 0,
    timeout_s: int = 0,
    dead_conn_timeout_s: int = 0,
) -> bytes:
    """NBD_CMD_CONNECT's attributes. A timeout of 0 leaves the kernel's default."""
    if index < 0 or not fds or size <= 0 or block_size <= 0:
        raise ValueError("connect needs a device index >= 0, sockets and a positive size")
    out = [
        nla_u32(NBD_ATTR_INDEX, index),
        nla_u64(NBD_ATTR_SIZE_BYTES, size),
        nla_u64(NBD_ATTR_BLOCK_SIZE_BYTES, block_size),
        nla_u64(NBD_ATTR_SERVER_FLAGS, server_flags),
    ]
    if timeout_s:
        out.append(nla_u64(NBD_ATTR_TIMEOUT, timeout_s))
    if dead_conn_timeout_s:
        out.append(nla_u64(NBD_ATTR_DEAD_CONN_TIMEOUT, dead_conn_timeout_s))
    out.append(sockets_attr(fds))
    return b"".join(out)


# --- decoding -------------------------------------------------------------------------------


def parse_messages(data: bytes) -> Iterator[Message]:
    """Netlink messages in one datagram. Raises NetlinkError on a malformed header."""
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, mtype, flags, seq, pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise NetlinkError(
                errno.EPROTO,
                f"netlink message length {length} at {off} is "
                f"outside the {len(data)}-byte datagram",
            )
        yield Message(mtype, flags, seq, pid, data[off + _NLMSGHDR.size : off + length])
        off += _align(length)
    if off < len(data) and len(data) - off >= 1 and any(data[off:]):
        raise NetlinkError(errno.EPROTO, f"{len(data) - off} trailing bytes after netlink messages")


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """Attributes (type without the nested/byte-order flags -> value). Later ones win."""
    out: dict[int, bytes] = {}
    off = 0
    while off + _NLATTR.size <= len(data):
        length, atype = _NLATTR.unpack_from(data, off)
        if length < _NLATTR.size or off + length > len(data):
            raise NetlinkError(
                errno.EPROTO,
                f"attribute length {length} at {off} is outside the {len(data)}-byte payload",
            )
        out[atype & NLA_TYPE_MASK] = data[off + _NLATTR.size : off + length]
        off += _align(length)
    return out


def error_code(msg: Message) -> int:
    """NLMSG_ERROR's errno (0 is an ACK). Raises NetlinkError when the payload is short."""
    if len(msg.payload) < 4:
        raise NetlinkError(errno.EPROTO, "NLMSG_ERROR shorter than its error field")
    (code,) = struct.unpack_from("=i", msg.payload)
    return -code


def attr_u32(attrs: dict[int, bytes], atype: int) -> int | None:
    value = attrs.get(atype)
    return struct.unpack("=I", value)[0] if value is not None and len(value) == 4 else None


# --- the blocking exchange ------------------------------------------------------------------


class GenlSocket:
    """A NETLINK_GENERIC socket for request/ack exchanges. Use as a context manager."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self._seq = int.from_bytes(os.urandom(2), "little")

    def __enter__(self) -> GenlSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def request(
        self,
        family: int,
        cmd: int,
        attrs: bytes,
        *,
        version: int = 1,
        what: str = "netlink request",
    ) -> list[dict[int, bytes]]:
        """Send one request with NLM_F_ACK; the attributes of each reply until the ACK.
        Raises NetlinkError with the kernel's errno on refusal."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        self.sock.send(genl_message(family, cmd, attrs, seq, version=version))
        replies: list[dict[int, bytes]] = []
        while True:
            try:
                data = self.sock.recv(MAX_REPLY)
            except TimeoutError:
                raise NetlinkError(errno.ETIMEDOUT, f"{what}: the kernel did not answer") from None
            for msg in parse_messages(data):
                if msg.seq != seq:
                    continue  # a late answer to an earlier request
                if msg.type == NLMSG_ERROR:
                    code = error_code(msg)
                    if code:
                        raise NetlinkError(code, f"{what}: {os.strerror(code)}")
                    return replies
                if msg.type == NLMSG_DONE:
                    return replies
                if len(msg.payload) < _GENLHDR.size:
                    raise NetlinkError(errno.EPROTO, f"{what}: reply without a genl header")
                replies.append(parse_attrs(msg.payload[_GENLHDR.size :]))

    def family_id(self, name: str) -> int:
        """The numeric id of generic-netlink family `name`. FamilyNotFound when absent."""
        return self.family(name)[0]

    def family(self, name: str) -> tuple[int, dict[str, int]]:
        """Family `name`'s numeric id and its multicast groups (name -> id). FamilyNotFound
        when absent."""
        try:
            replies = self.request(
                GENL_ID_CTRL,
                CTRL_CMD_GETFAMILY,
                nla_str(CTRL_ATTR_FAMILY_NAME, name),
                version=1,
                what=f"resolving netlink family {name!r}",
            )
        except NetlinkError as exc:
            if exc.errno == errno.ENOENT:
                raise FamilyNotFound(
                    errno.ENOENT, f"no generic-netlink family {name!r} (module not loaded?)"
                ) from None
            raise
        for attrs in replies:
            value = attrs.get(CTRL_ATTR_FAMILY_ID)
            if value is not None and len(value) == 2:
                return int(struct.unpack("=H", value)[0]), mcast_groups(
                    attrs.get(CTRL_ATTR_MCAST_GROUPS, b"")
                )
        raise NetlinkError(errno.EPROTO, f"the kernel named no id for family {name!r}")


def mcast_groups(value: bytes) -> dict[str, int]:
    """CTRL_ATTR_MCAST_GROUPS' value: multicast group name -> id."""
    groups: dict[str, int] = {}
    for item in parse_attrs(value).values():
        attrs = parse_attrs(item)
        gid = attr_u32(attrs, CTRL_ATTR_MCAST_GRP_ID)
        raw = attrs.get(CTRL_ATTR_MCAST_GRP_NAME)
        if gid is not None and raw is not None:
            groups[raw.split(b"\0", 1)[0].decode(errors="replace")] = gid
    return groups


def parse_link_dead(data: bytes, family: int) -> list[int]:
    """The device indexes of the NBD_CMD_LINK_DEAD messages of `family` in one datagram
    (`LOST` for one that names none); other messages are skipped. NetlinkError when the
    datagram is malformed."""
    out: list[int] = []
    for msg in parse_messages(data):
        if msg.type != family or len(msg.payload) < _GENLHDR.size:
            continue
        if msg.payload[0] != NBD_CMD_LINK_DEAD:
            continue
        index = attr_u32(parse_attrs(msg.payload[_GENLHDR.size :]), NBD_ATTR_INDEX)
        out.append(LOST if index is None else index)
    return out


class LinkDeadEvents:
    """The nbd driver's reports that one of a device's connections went from live to dead
    (``NBD_CMD_LINK_DEAD``, multicast from `nbd_mark_nsock_dead`), read from `sock`, a
    non-blocking socket subscribed to them (`subscribe_link_dead`)."""

    def __init__(self, sock: socket.socket, family: int) -> None:
        self.sock, self.family = sock, family
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def take(self) -> list[int]:
        """The device indexes reported since the last call, without waiting. `LOST` among
        them when reports were dropped (the socket's buffer overflowed) or garbled."""
        out: list[int] = []
        while True:
            try:
                data = self.sock.recv(MAX_REPLY)
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                out.append(LOST)
                continue
            try:
                out.extend(parse_link_dead(data, self.family))
            except NetlinkError:
                out.append(LOST)

    def close(self) -> None:
        self.sock.close()


def subscribe(family_name: str, group: str) -> tuple[socket.socket, int]:
    """A netlink socket that hears multicast group `group` of family `family_name`, and the
    family's id. FamilyNotFound without the family; NetlinkError when it has no such group."""
    with GenlSocket(timeout=5) as nl:
        family, groups = nl.family(family_name)
    if group not in groups:
        raise NetlinkError(errno.ENOENT, f"family {family_name!r} has no multicast group {group!r}")
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
    try:
        sock.bind((0, 0))
        sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, groups[group])
    except BaseException:
        sock.close()
        raise
    return sock, family


def subscribe_link_dead() -> LinkDeadEvents:
    """The nbd driver's ``NBD_CMD_LINK_DEAD`` reports. FamilyNotFound without the driver."""
    return LinkDeadEvents(*subscribe(NBD_GENL_FAMILY_NAME, NBD_GENL_MCAST_GROUP_NAME))


# --- NBD commands ---------------------------------------------------------------------------


def device_index(device: str) -> int:
    """/dev/nbd7 -> 7. ValueError for anything that is not an nbd device path."""
    name = os.path.basename(device)
    if not name.startswith("nbd") or not name[3:].isdigit():
        raise ValueError(f"{device} is not an nbd device (/dev/nbdN)")
    return int(name[3:])


def available() -> bool:
    """True when the kernel's nbd driver answers on generic netlink."""
    try:
        with GenlSocket(timeout=5) as nl:
            nl.family_id(NBD_GENL_FAMILY_NAME)
        return True
    except OSError:
        return False


def connect(
    device: str,
    fds: list[int],
    size: int,
    *,
    server_flags: int = 0,
    timeout_s: int = 0,
    dead_conn_timeout_s: int = 0,
    block_size: int = 4096,
) -> int:
    """NBD_CMD_CONNECT `device` to the (post-handshake) sockets `fds`. Returns the index the
    kernel reports. The caller may close its fds afterwards: the kernel holds its own."""
    index = device_index(device)
    attrs = connect_attrs(
        index,
        fds,
        size,
        block_size=block_size,
        server_flags=server_flags,
        timeout_s=timeout_s,
        dead_conn_timeout_s=dead_conn_timeout_s,
    )
    with GenlSocket() as nl:
        family = nl.family_id(NBD_GENL_FAMILY_NAME)
        replies = nl.request(
            family,
            NBD_CMD_CONNECT,
            attrs,
            version=NBD_GENL_VERSION,
            what=f"NBD_CMD_CONNECT {device}",
        )
    for attrs_ in replies:
        got = attr_u32(attrs_, NBD_ATTR_INDEX)
        if got is not None:
            return got
    return index


def reconfigure(device: str, fds: list[int], *, dead_conn_timeout_s: int = 0) -> None:
    """NBD_CMD_RECONFIGURE: the live `device` takes `fds` in place of its dead sockets. With
    no dead socket the 6.1 driver drops them and answers success (ENOSPC only where a kernel
    passes it on): success does not prove the device holds them (module doc)."""
    attrs = nla_u32(NBD_ATTR_INDEX, device_index(device)) + sockets_attr(fds)
    if dead_conn_timeout_s:
        attrs += nla_u64(NBD_ATTR_DEAD_CONN_TIMEOUT, dead_conn_timeout_s)
    with GenlSocket() as nl:
        family = nl.family_id(NBD_GENL_FAMILY_NAME)
        try:
            nl.request(
                family,
                NBD_CMD_RECONFIGURE,
                attrs,
                version=NBD_GENL_VERSION,
                what=f"NBD_CMD_RECONFIGURE {device}",
            )
        except NetlinkError as exc:
            if exc.errno == errno.ENOSPC:
                raise NetlinkError(
                    errno.ENOSPC,
                    f"{device} has no dead connection to replace "
                    "(is the old daemon still running?)",
                ) from None
            raise


def set_timeout(device: str, timeout_s: int) -> None:
    """NBD_CMD_RECONFIGURE with only NBD_ATTR_TIMEOUT: the driver's request timeout (0: its
    timer never cuts a connection; it then also sets the block queue's `io_timeout` to 30 s,
    so write that afterwards). Sockets are left as they are."""
    if timeout_s < 0:
        raise ValueError("a request timeout is >= 0 seconds")
    attrs = nla_u32(NBD_ATTR_INDEX, device_index(device)) + nla_u64(NBD_ATTR_TIMEOUT, timeout_s)
    with GenlSocket() as nl:
        family = nl.family_id(NBD_GENL_FAMILY_NAME)
        nl.request(
            family,
            NBD_CMD_RECONFIGURE,
            attrs,
            version=NBD_GENL_VERSION,
            what=f"NBD_CMD_RECONFIGURE {device} timeout {timeout_s}",
        )


def disconnect(device: str) -> None:
    """NBD_CMD_DISCONNECT: end the device's connections; the device becomes free."""
    with GenlSocket() as nl:
        family = nl.family_id(NBD_GENL_FAMILY_NAME)
        nl.request(
            family,
            NBD_CMD_DISCONNECT,
            nla_u32(NBD_ATTR_INDEX, device_index(device)),
            version=NBD_GENL_VERSION,
            what=f"NBD_CMD_DISCONNECT {device}",
        )
