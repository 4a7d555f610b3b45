"""The generic-netlink codec of duvm.wire.nbdnetlink: encoders checked by decoding, the decoder
fuzzed, and the blocking exchange against this kernel's own nlctrl family (the nbd commands
themselves run under QEMU: test_kernel_nbd_qemu.py)."""

from __future__ import annotations

import errno
import socket
import struct

import pytest
from duvm.wire import nbdnetlink as nl
from hypothesis import given
from hypothesis import strategies as st


def _u64(b: bytes) -> int:
    return struct.unpack("=Q", b)[0]


def test_connect_request_decodes_to_what_was_asked() -> None:
    attrs = nl.connect_attrs(
        3, [7, 9], 128 << 20, server_flags=0x2D, timeout_s=60, dead_conn_timeout_s=90
    )
    msg = nl.genl_message(0x1234, nl.NBD_CMD_CONNECT, attrs, seq=42)
    [m] = list(nl.parse_messages(msg))
    assert (m.type, m.seq, m.flags) == (0x1234, 42, nl.NLM_F_REQUEST | nl.NLM_F_ACK)
    assert m.payload[:4] == bytes([nl.NBD_CMD_CONNECT, 1, 0, 0])
    a = nl.parse_attrs(m.payload[4:])
    assert nl.attr_u32(a, nl.NBD_ATTR_INDEX) == 3
    assert _u64(a[nl.NBD_ATTR_SIZE_BYTES]) == 128 << 20
    assert _u64(a[nl.NBD_ATTR_BLOCK_SIZE_BYTES]) == 4096
    assert _u64(a[nl.NBD_ATTR_SERVER_FLAGS]) == 0x2D
    assert _u64(a[nl.NBD_ATTR_TIMEOUT]) == 60
    assert _u64(a[nl.NBD_ATTR_DEAD_CONN_TIMEOUT]) == 90
    # nested: SOCKETS { ITEM { FD } ITEM { FD } }, each flagged nested as the kernel expects
    fds = []
    socks = a[nl.NBD_ATTR_SOCKETS]
    items = []
    off = 0
    while off < len(socks):
        length, atype = struct.unpack_from("=HH", socks, off)
        assert atype == nl.NBD_SOCK_ITEM | nl.NLA_F_NESTED
        items.append(socks[off + 4 : off + length])
        off += (length + 3) & ~3
    for item in items:
        fds.append(nl.attr_u32(nl.parse_attrs(item), nl.NBD_SOCK_FD))
    assert fds == [7, 9]


def test_zero_timeouts_are_left_to_the_kernel() -> None:
    a = nl.parse_attrs(nl.connect_attrs(0, [5], 4096))
    assert nl.NBD_ATTR_TIMEOUT not in a and nl.NBD_ATTR_DEAD_CONN_TIMEOUT not in a


@pytest.mark.parametrize("kw", [{"index": -1}, {"fds": []}, {"size": 0}])
def test_impossible_connect_requests_are_refused(kw: dict) -> None:
    args = {"index": 0, "fds": [3], "size": 4096, **kw}
    with pytest.raises(ValueError):
        nl.connect_attrs(args.pop("index"), args.pop("fds"), args.pop("size"))


@given(st.integers(0, 0x3FFF), st.binary(max_size=64))
def test_attribute_padding_round_trips(atype: int, value: bytes) -> None:
    enc = nl.nla(atype, value) + nl.nla_u32(1 if atype != 1 else 2, 7)
    assert len(enc) % 4 == 0
    assert nl.parse_attrs(enc)[atype] == value


@given(st.binary(max_size=200))
def test_decoders_never_crash_on_garbage(data: bytes) -> None:
    for parse in (
        lambda d: list(nl.parse_messages(d)),
        nl.parse_attrs,
        lambda d: nl.parse_link_dead(d, 0x1234),
        nl.mcast_groups,
    ):
        try:
            parse(data)
        except nl.NetlinkError as exc:
            assert exc.errno == errno.EPROTO


def _link_dead(family: int, *attrs: bytes, cmd: int = nl.NBD_CMD_LINK_DEAD) -> bytes:
    """A report as the driver multicasts it (`nbd_mcast_index`: seq 0, no flags)."""
    return nl.genl_message(family, cmd, b"".join(attrs), seq=0, flags=0)


def test_link_dead_reports_name_their_device() -> None:
    """Catches a reader that takes another family's messages or another command for a dead
    connection, or drops a report that names no device (the supervisor must hand one then)."""
    fam = 0x21
    index = nl.nla_u32(nl.NBD_ATTR_INDEX, 7)
    assert nl.parse_link_dead(_link_dead(fam, index), fam) == [7]
    two = _link_dead(fam, index) + _link_dead(fam, nl.nla_u32(nl.NBD_ATTR_INDEX, 3))
    assert nl.parse_link_dead(two, fam) == [7, 3]
    assert nl.parse_link_dead(_link_dead(fam + 1, index), fam) == []
    assert nl.parse_link_dead(_link_dead(fam, index, cmd=nl.NBD_CMD_RECONFIGURE), fam) == []
    assert nl.parse_link_dead(_link_dead(fam), fam) == [nl.LOST]


def test_link_dead_events_read_all_waiting_without_blocking() -> None:
    """The supervisor's reader, over a datagram socket standing in for the netlink one:
    every report waiting is returned at once, a garbled datagram as `LOST`, and an empty
    socket answers at once with nothing."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    events = nl.LinkDeadEvents(a, 0x21)
    try:
        b.send(_link_dead(0x21, nl.nla_u32(nl.NBD_ATTR_INDEX, 7)))
        b.send(b"\x40\x00\x00\x00garbled")
        b.send(_link_dead(0x21, nl.nla_u32(nl.NBD_ATTR_INDEX, 2)))
        assert events.take() == [7, nl.LOST, 2]
        assert events.take() == []
        assert events.fileno() == a.fileno()
    finally:
        events.close()
        b.close()
    assert a.fileno() == -1


def test_multicast_groups_of_a_family_and_joining_one() -> None:
    """Against this kernel: nlctrl's own group ("notify") is resolved and joined as the nbd
    driver's "nbd_mc_group" is by `subscribe_link_dead` (whose reports come under QEMU);
    a group the family lacks is refused by name."""
    with _netlink_or_skip() as s:
        fam, groups = s.family("nlctrl")
    assert fam == nl.GENL_ID_CTRL and groups.get("notify", 0) > 0, groups
    sock, fam = nl.subscribe("nlctrl", "notify")
    try:
        events = nl.LinkDeadEvents(sock, fam)
        assert events.take() == []  # joined, nothing waiting, no wait
    finally:
        sock.close()
    with pytest.raises(nl.NetlinkError, match="no multicast group 'nbd_mc_group'"):
        nl.subscribe("nlctrl", nl.NBD_GENL_MCAST_GROUP_NAME)


def test_short_error_message_is_a_protocol_error() -> None:
    with pytest.raises(nl.NetlinkError, match="shorter"):
        nl.error_code(nl.Message(nl.NLMSG_ERROR, 0, 1, 0, b"\x01"))
    ack = nl.Message(nl.NLMSG_ERROR, 0, 1, 0, struct.pack("=i", -errno.ENOSPC) + bytes(16))
    assert nl.error_code(ack) == errno.ENOSPC


def test_device_index() -> None:
    assert nl.device_index("/dev/nbd12") == 12
    for bad in ("/dev/sda", "/dev/nbd", "/dev/nbdx1"):
        with pytest.raises(ValueError):
            nl.device_index(bad)


def _netlink_or_skip() -> nl.GenlSocket:
    try:
        return nl.GenlSocket(timeout=5)
    except OSError as exc:  # a sandbox without AF_NETLINK
        pytest.skip(f"no generic netlink here: {exc}")


def test_kernel_resolves_its_own_control_family() -> None:
    with _netlink_or_skip() as s:
        assert s.family_id("nlctrl") == nl.GENL_ID_CTRL
        with pytest.raises(nl.FamilyNotFound, match="no generic-netlink family"):
            s.family_id("duvmnofamily")


def test_kernel_refusal_carries_its_errno() -> None:
    with _netlink_or_skip() as s:
        with pytest.raises(nl.NetlinkError) as exc:
            s.request(nl.GENL_ID_CTRL, 250, b"", what="bogus command")
        assert exc.value.errno == errno.EOPNOTSUPP
        assert "bogus command" in str(exc.value)


def test_nbd_commands_without_the_nbd_module_say_so() -> None:
    """Where the kernel has nbd the commands run under QEMU; here they must fail cleanly."""
    with _netlink_or_skip() as s:
        try:
            s.family_id(nl.NBD_GENL_FAMILY_NAME)
            pytest.skip("this kernel has nbd loaded; the QEMU test covers the commands")
        except nl.FamilyNotFound:
            pass
    assert nl.available() is False
    a, b = socket.socketpair()
    try:
        with pytest.raises(nl.FamilyNotFound):
            nl.connect("/dev/nbd0", [a.fileno()], 1 << 20)
        with pytest.raises(nl.FamilyNotFound):
            nl.reconfigure("/dev/nbd0", [a.fileno()])
        with pytest.raises(nl.FamilyNotFound):
            nl.disconnect("/dev/nbd0")
        with pytest.raises(nl.FamilyNotFound):
            nl.subscribe_link_dead()
    finally:
        a.close()
        b.close()
