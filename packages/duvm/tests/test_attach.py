"""Attach layer: NBD client handshake against real nbdkit, ioctl numbers against the kernel
header, the vm.min_free_kbytes policy, /proc/swaps parsing, state file, and refusals.

The kernel nbd device path itself needs a kernel with nbd (tested under QEMU elsewhere); the
nbdfuse+loop path runs for real in test_swap_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from duvm.node.attach import (
    attach,
    attach_fuse,
    attach_kernel,
    attach_state,
    kernel_swap,
    kernelnbd,
    systools,
)
from duvm.node.attach.kernelnbd import NbdHandshakeError
from duvm.wire import nbdconst as C
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NBDKIT = shutil.which("nbdkit")
QEMU_IO = shutil.which("qemu-io")
needs_nbdkit = pytest.mark.skipif(NBDKIT is None, reason="nbdkit not installed (apt: nbdkit)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def start_nbdkit(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp_path / f"nbdkit-{time.monotonic_ns()}.sock")
    proc = subprocess.Popen(
        [NBDKIT or "nbdkit", "-f", "-U", sock, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"nbdkit did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.02)
    return proc, sock


@pytest.fixture
def nbdkit_memory(tmp_path: Path):
    if NBDKIT is None:
        pytest.skip("nbdkit not installed (apt: nbdkit)")
    proc, sock = start_nbdkit(tmp_path, "memory", "64M")
    yield sock
    proc.terminate()
    proc.wait(10)


# --- ioctl numbers ---------------------------------------------------------------------------


def test_ioctl_numbers_match_kernel_uapi_header() -> None:
    header = Path("/usr/include/linux/nbd.h")
    if not header.exists():
        pytest.skip("linux/nbd.h not installed (apt: linux-libc-dev)")
    pattern = r"#define\s+(NBD_\w+)\s+_IO\(\s*0xab,\s*(\d+)\s*\)"
    found = dict(re.findall(pattern, header.read_text()))
    assert len(found) >= 10
    for name, nr in found.items():
        if hasattr(kernelnbd, name):
            assert getattr(kernelnbd, name) == 0xAB00 | int(nr), name
    for name in (
        "NBD_SET_SOCK",
        "NBD_SET_BLKSIZE",
        "NBD_SET_SIZE_BLOCKS",
        "NBD_SET_FLAGS",
        "NBD_SET_TIMEOUT",
        "NBD_DO_IT",
        "NBD_CLEAR_SOCK",
        "NBD_DISCONNECT",
    ):
        assert name in found, name


# --- handshake against real nbdkit -----------------------------------------------------------


@needs_nbdkit
def test_handshake_with_nbdkit_reaches_transmission_phase(nbdkit_memory: str) -> None:
    sock, info = kernelnbd.connect_unix(nbdkit_memory)
    with sock:
        assert info.size == 64 << 20
        assert info.transmission_flags & C.FLAG_HAS_FLAGS
        assert info.transmission_flags & (1 << 5), "nbdkit memory supports TRIM"
        assert not info.read_only
        # prove the socket is in transmission phase: a raw NBD_CMD_WRITE gets a clean reply
        payload = bytes([0xAB]) * 4096
        req = (0x25609513).to_bytes(4, "big") + (0).to_bytes(2, "big") + (1).to_bytes(2, "big")
        req += (7).to_bytes(8, "big") + (8192).to_bytes(8, "big") + (4096).to_bytes(4, "big")
        sock.sendall(req + payload)
        reply = kernelnbd._recv_exact(sock, 16)
        assert reply[:4] == (0x67446698).to_bytes(4, "big")
        assert reply[4:8] == bytes(4), "error field"
        assert reply[8:16] == (7).to_bytes(8, "big"), "handle echoed"
    if QEMU_IO is None:
        return
    # another real client sees the bytes written through our handshake's socket
    res = subprocess.run(
        [
            QEMU_IO,
            "-f",
            "raw",
            "-c",
            "read -P 0xab 8192 4096",
            f"nbd+unix:///?socket={nbdkit_memory}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert res.returncode == 0 and "Pattern verification failed" not in res.stdout, res.stdout


@needs_nbdkit
def test_handshake_named_export_and_refusal(tmp_path: Path) -> None:
    proc, sock_path = start_nbdkit(
        tmp_path,
        "--filter=exportname",
        "memory",
        "16M",
        "exportname-strict=true",
        "exportname=swap",
    )
    try:
        sock, info = kernelnbd.connect_unix(sock_path, export_name="swap")
        sock.close()
        assert info.size == 16 << 20
        with pytest.raises(NbdHandshakeError, match="refused export 'other'"):
            kernelnbd.connect_unix(sock_path, export_name="other")
    finally:
        proc.terminate()
        proc.wait(10)


def _serve_bytes(data: bytes) -> tuple[socket.socket, threading.Thread]:
    client, server = socket.socketpair()

    def serve() -> None:
        try:
            server.sendall(data)
            server.shutdown(socket.SHUT_WR)
            while server.recv(65536):
                pass
        except OSError:
            pass
        finally:
            server.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client.settimeout(5)
    return client, t


def test_handshake_rejects_non_nbd_peer() -> None:
    client, t = _serve_bytes(b"SSH-2.0-OpenSSH_9.2\r\n")
    with client, pytest.raises(NbdHandshakeError, match="bad magic"):
        kernelnbd.handshake(client)
    t.join(5)


def test_handshake_caps_reply_length() -> None:
    greeting = C.NBDMAGIC.to_bytes(8, "big") + C.IHAVEOPT.to_bytes(8, "big")
    greeting += (3).to_bytes(2, "big")
    huge = (
        C.OPT_REPLY_MAGIC.to_bytes(8, "big")
        + (7).to_bytes(4, "big")
        + (3).to_bytes(4, "big")
        + (1 << 30).to_bytes(4, "big")
    )
    client, t = _serve_bytes(greeting + huge)
    with client, pytest.raises(NbdHandshakeError, match="cap"):
        kernelnbd.handshake(client)
    t.join(5)


_GREETING = C.NBDMAGIC.to_bytes(8, "big") + C.IHAVEOPT.to_bytes(8, "big") + b"\0\3"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=200), st.binary(max_size=200).map(lambda b: _GREETING + b)))
def test_fuzz_handshake_only_raises_handshake_error(data: bytes) -> None:
    client, t = _serve_bytes(data)
    with client, contextlib.suppress(NbdHandshakeError):
        kernelnbd.handshake(client)
    t.join(5)


@given(st.binary(max_size=64))
def test_fuzz_parsers(data: bytes) -> None:
    for fn in (kernelnbd.parse_greeting, kernelnbd.parse_reply_header):
        with contextlib.suppress(NbdHandshakeError):
            fn(data)
    info: dict[str, int] = {}
    with contextlib.suppress(NbdHandshakeError):
        kernelnbd.apply_info(info, data)


# --- vm.min_free_kbytes ----------------------------------------------------------------------


def test_min_free_floor_matches_measured_guest_and_scales() -> None:
    # 192 MiB guest: froze at the default 1447 KiB, never at 8192 KiB (FACTS.md)
    assert kernel_swap.safe_min_free_kbytes(192 * 1024) == 8192
    assert kernel_swap.safe_min_free_kbytes(1 << 20) == 16384  # 1 GiB
    assert kernel_swap.safe_min_free_kbytes(16 << 20) == 65536  # 16 GiB
    assert kernel_swap.safe_min_free_kbytes(1 << 30) == 262144  # 1 TiB: capped
    assert kernel_swap.safe_min_free_kbytes(0) == 8192


@given(st.integers(min_value=0, max_value=1 << 40), st.integers(min_value=0, max_value=1 << 40))
def test_fuzz_min_free_floor_monotonic_and_bounded(a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    assert (
        8192
        <= kernel_swap.safe_min_free_kbytes(lo)
        <= kernel_swap.safe_min_free_kbytes(hi)
        <= 262144
    )


def test_min_free_raised_restored_and_never_lowered(tmp_path: Path) -> None:
    floor = kernel_swap.safe_min_free_kbytes(kernel_swap.mem_total_kb())
    sysctl = tmp_path / "min_free_kbytes"
    sysctl.write_text("1024\n")
    before, we_set = kernel_swap.raise_min_free(sysctl)
    assert (before, we_set) == (1024, floor)
    assert int(sysctl.read_text()) == floor
    kernel_swap.restore_min_free(before, we_set, sysctl)
    assert int(sysctl.read_text()) == 1024

    # someone changed it after us: theirs stands
    kernel_swap.raise_min_free(sysctl)
    sysctl.write_text("5000")
    kernel_swap.restore_min_free(1024, floor, sysctl)
    assert sysctl.read_text() == "5000"

    # a higher value is never lowered, and nothing is restored
    sysctl.write_text(str(floor + 1))
    assert kernel_swap.raise_min_free(sysctl) == (floor + 1, None)
    assert int(sysctl.read_text()) == floor + 1


def test_watermark_boost_stopped_restored_and_absent_on_old_kernels(tmp_path: Path) -> None:
    """Guards the hang of the stop set-up (docs/BENCHMARKS.md): a boost left on lifts the min
    watermark above free memory while the memserver is away, below the daemon's reserve."""
    sysctl = tmp_path / "watermark_boost_factor"
    sysctl.write_text("15000\n")
    before, we_set = kernel_swap.stop_watermark_boost(sysctl)
    assert (before, we_set) == (15000, 0)
    assert sysctl.read_text() == "0"
    kernel_swap.restore_sysctl(before, we_set, sysctl)
    assert sysctl.read_text() == "15000"

    # someone changed it after us: theirs stands
    kernel_swap.stop_watermark_boost(sysctl)
    sysctl.write_text("500")
    kernel_swap.restore_sysctl(15000, 0, sysctl)
    assert sysctl.read_text() == "500"

    # already 0: nothing set, nothing to restore
    sysctl.write_text("0")
    assert kernel_swap.stop_watermark_boost(sysctl) == (0, None)
    kernel_swap.restore_sysctl(0, None, sysctl)
    assert sysctl.read_text() == "0"

    # a kernel before 5.0 has no such setting: nothing done, nothing recorded
    assert kernel_swap.stop_watermark_boost(tmp_path / "absent") == (None, None)
    kernel_swap.restore_sysctl(None, None, tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


# --- /proc/swaps -----------------------------------------------------------------------------


def test_parse_proc_swaps_sample_and_live() -> None:
    text = (
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
        "/dev/loop0                              partition\t524284\t\t209188\t\t100\n"
        "/swap\\040file                           file\t\t1048572\t\t0\t\t-2\n"
        "garbage line\n"
    )
    entries = kernel_swap.parse_proc_swaps(text)
    assert entries == [
        kernel_swap.SwapEntry("/dev/loop0", "partition", 524284, 209188, 100),
        kernel_swap.SwapEntry("/swap file", "file", 1048572, 0, -2),
    ]
    live = kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())
    assert all(e.size_kb >= e.used_kb >= 0 for e in live)


@given(st.text(max_size=400))
def test_fuzz_parse_proc_swaps(text: str) -> None:
    for e in kernel_swap.parse_proc_swaps(text):
        assert isinstance(e.size_kb, int)


# --- state file ------------------------------------------------------------------------------


def test_state_roundtrip_and_corruption(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    assert attach_state.load_state(path) is None
    att = attach_state.Attachment(
        socket="/run/x.sock",
        method=attach_state.METHOD_FUSE,
        device="/dev/loop7",
        loop_device="/dev/loop7",
        min_free_before=1447,
        extra={"pid": 5},
    )
    attach_state.save_state(path, att)
    assert attach_state.load_state(path) == att
    assert not list(path.parent.glob("*.tmp*")), "atomic write leaves no temp file"

    raw = json.loads(path.read_text())
    raw["from_a_newer_version"] = 1
    path.write_text(json.dumps(raw))
    assert attach_state.load_state(path) == att

    path.write_text("{not json")
    with pytest.raises(attach_state.AttachError, match="unreadable"):
        attach_state.load_state(path)
    path.write_text("[1, 2]")
    with pytest.raises(attach_state.AttachError, match="not a duvm attachment"):
        attach_state.load_state(path)


# --- refusals --------------------------------------------------------------------------------


def test_missing_tool_names_debian_package(tmp_path: Path) -> None:
    tools = systools.Tools((str(tmp_path),))
    with pytest.raises(attach_state.AttachError, match="install the Debian package util-linux"):
        tools.require("mkswap")
    assert any("libnbd-bin" in p for p in attach_fuse.problems(tools))


@needs_root
def test_attach_refuses_without_root(tmp_path: Path) -> None:
    """A real privilege drop (fork + setuid nobody), not a patched geteuid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        msg = "no error"
        try:
            os.setgid(65534)
            os.setuid(65534)
            attach.attach(str(tmp_path / "none.sock"), tmp_path / "state.json")
        except attach_state.AttachError as exc:
            msg = f"AttachError: {exc}"
        except BaseException as exc:  # report anything else as a failure
            msg = f"{type(exc).__name__}: {exc}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    assert msg.startswith("AttachError: attaching swap needs root"), msg
    assert not (tmp_path / "state.json").exists()


@needs_root
def test_attach_without_server_leaves_nothing(tmp_path: Path) -> None:
    before = Path("/proc/sys/vm/min_free_kbytes").read_text()
    boost = kernel_swap.WATERMARK_BOOST_SYSCTL
    boost_before = boost.read_text() if boost.exists() else None  # Linux 5.0 and later
    state = tmp_path / "state.json"
    with pytest.raises(attach_state.AttachError):
        attach.attach(
            str(tmp_path / "absent.sock"),
            state,
            run_dir=tmp_path / "run",
            method=attach_state.METHOD_FUSE,
        )
    assert not state.exists()
    assert Path("/proc/sys/vm/min_free_kbytes").read_text() == before
    assert (boost.read_text() if boost.exists() else None) == boost_before


@needs_root
def test_attach_unknown_method_and_detach_nothing(tmp_path: Path) -> None:
    with pytest.raises(attach_state.AttachError):
        attach.attach("/nonexistent.sock", tmp_path / "s.json", method="carrier-pigeon")
    assert attach.detach(tmp_path / "s.json") is None


# --- kernel nbd device selection and the holder process ---------------------------------------


def test_free_device_skips_connected_and_sized(tmp_path: Path) -> None:
    """A sysfs tree in the kernel's layout: nbd0 connected (pid), nbd1 has a size, nbd2 free,
    nbd10 free; numeric order, not string order, decides."""
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    dev.mkdir()
    for name, size, pid in (
        ("nbd0", "0", "123"),
        ("nbd1", "2048", None),
        ("nbd10", "0", None),
        ("nbd2", "0", None),
        ("loop0", "0", None),
    ):
        (sysfs / name).mkdir(parents=True)
        (sysfs / name / "size").write_text(size + "\n")
        if pid:
            (sysfs / name / "pid").write_text(pid)
        (dev / name).touch()
    assert kernelnbd.free_device(sysfs, dev) == str(dev / "nbd2")
    (sysfs / "nbd2" / "pid").write_text("7")
    assert kernelnbd.free_device(sysfs, dev) == str(dev / "nbd10")
    (dev / "nbd10").unlink()
    assert kernelnbd.free_device(sysfs, dev) is None


@needs_nbdkit
def test_holder_handshakes_then_reports_a_missing_device(
    nbdkit_memory: str, tmp_path: Path
) -> None:
    """The real holder process: negotiates with nbdkit, then fails cleanly without /dev/nbdN."""
    missing = str(tmp_path / "nbd99")
    res = subprocess.run(
        kernelnbd.holder_command(missing, nbdkit_memory, 30),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1
    assert f"duvm nbd holder: {missing}:" in res.stderr and "No such file" in res.stderr
    assert "Traceback" not in res.stderr


def test_holder_reports_a_dead_server(tmp_path: Path) -> None:
    res = subprocess.run(
        kernelnbd.holder_command("/dev/nbd0", str(tmp_path / "none.sock"), 30),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "No such file" in res.stderr
    assert "Traceback" not in res.stderr


@needs_root
def test_neither_path_available_says_what_to_install(tmp_path: Path) -> None:
    """Swap tools present, but no nbd module, no modprobe and no nbdfuse/losetup."""
    if kernelnbd.kernel_has_nbd():
        pytest.skip("this kernel has nbd; the fallback message is not reached")
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("mkswap", "swapon", "swapoff", "blkdiscard", "fusermount3"):
        real = systools.find_tool(name)
        if real is None:
            pytest.skip(f"{name} missing")
        (tools / name).symlink_to(real)
    only = systools.Tools((str(tools),))
    state = tmp_path / "state.json"
    with pytest.raises(attach_state.AttachError) as info:
        attach.attach(str(tmp_path / "x.sock"), state, run_dir=tmp_path / "run", tools=only)
    assert str(info.value) == attach_fuse.AUTO_REFUSES_FALLBACK  # auto: kernel nbd or nothing
    with pytest.raises(attach_state.AttachError) as info:
        attach.attach(
            str(tmp_path / "x.sock"),
            state,
            run_dir=tmp_path / "run",
            method=attach_state.METHOD_FUSE,
            tools=only,
        )
    msg = str(info.value)
    assert msg.startswith("nbdfuse fallback cannot run: ")
    assert "nbdfuse missing (Debian package libnbd-bin" in msg and "losetup missing" in msg
    assert "(Debian package mount)" in msg
    assert not state.exists()


@pytest.mark.parametrize(
    ("said", "expected", "not_expected"),
    [
        (
            "swapoff: /dev/loop0: swapoff failed: Cannot allocate memory",
            "not enough free memory",
            "I/O errors",
        ),
        ("swapoff: /dev/nbd0: swapoff failed: Input/output error", "I/O errors", "free memory"),
    ],
)
def test_swapoff_failure_names_the_cause_it_saw(
    said: str, expected: str, not_expected: str
) -> None:
    msg = kernel_swap.swapoff_failure("/dev/x", said)
    assert msg.startswith("swapoff of /dev/x failed, so it stays attached")
    assert expected in msg and not_expected not in msg and said in msg


def test_device_problem_kernel_nbd_fake_sysfs(tmp_path: Path) -> None:
    """Catches a detach that would swapoff and disconnect an nbd device whose number someone
    else connected after ours went away (the kernel nbd path's check, reached through
    attach.device_problem). No kernel nbd here: a sysfs tree under tmp_path holds
    block/nbd3/pid (the QEMU guest test runs the real one through enable, resume and disable)."""
    att = attach_state.Attachment(
        socket="s",
        method=attach_state.METHOD_KERNEL,
        device="/dev/nbd3",
        nbd_device="/dev/nbd3",
        nbd_netlink=True,
        extra={"nbd_pid": "812"},
    )
    pid = tmp_path / "block" / "nbd3" / "pid"
    pid.parent.mkdir(parents=True)
    for now, problem in (
        ("812\n", None),
        (None, None),  # not connected at all: still ours to clean up
        ("", None),
        ("977\n", "connected by someone else now (pid 977, duvm's connection was pid 812)"),
    ):
        pid.unlink(missing_ok=True)
        if now is not None:
            pid.write_text(now)
        found = attach.device_problem(att, sys_root=tmp_path)
        assert (found is None) if problem is None else (problem in (found or "")), (now, found)
    assert attach_kernel.nbd_pid("/dev/nbd3", tmp_path) == "977"
    att.extra.pop("nbd_pid")  # a state file from before the pid was recorded: trusted
    assert attach.device_problem(att, sys_root=tmp_path) is None


def test_writeback_throttling_is_turned_off_on_the_nbd_device(tmp_path: Path) -> None:
    """Catches an attach that leaves the block layer's writeback throttling on: requests held
    across a daemon crash count against it for the kernel's 60 s request timer, and kswapd and
    every task short of memory waited in `wbt_wait` although a standby served the device again
    (kernel stacks in a QEMU guest, DECISIONS.md D48). A sysfs tree under tmp_path stands in
    for the kernel's (the QEMU guest test reads the real knob after enable)."""
    knob = tmp_path / "block" / "nbd3" / "queue" / "wbt_lat_usec"
    knob.parent.mkdir(parents=True)
    knob.write_text("2000\n")
    assert attach_kernel.no_writeback_throttle("/dev/nbd3", tmp_path) == "2000"
    assert knob.read_text() == "0"
    assert attach_kernel.no_writeback_throttle("/dev/nbd4", tmp_path).startswith("not set (")


@needs_root
def test_device_problem_loop_device_backed_by_another_file(tmp_path: Path) -> None:
    """Catches a detach that would swapoff and discard a loop device whose number was reused
    (the nbdfuse+loop path's check, reached through attach.device_problem): a real loop
    device on a plain file that stands in for nbdfuse's file (the real one: test_swap_e2e.py)."""
    ours, theirs = tmp_path / "swap", tmp_path / "theirs"
    for f in (ours, theirs):
        f.write_bytes(bytes(1 << 20))
    (tmp_path / "link").symlink_to(ours)
    loop = systools.SYSTEM_TOOLS.run("losetup", "--find", "--show", str(ours)).strip()
    att = attach_state.Attachment(
        socket="s",
        method=attach_state.METHOD_FUSE,
        device=loop,
        loop_device=loop,
        fuse_file=str(tmp_path / "link"),  # the kernel reports it resolved
    )
    try:
        assert attach.device_problem(att) is None
        att.fuse_file = str(theirs)
        assert attach.device_problem(att) == (
            f"{loop} is now backed by {ours}, not by duvm's {theirs}"
        )
    finally:
        systools.SYSTEM_TOOLS.run("losetup", "-d", loop)
    deadline = time.monotonic() + 10
    while attach.device_problem(att) != f"{loop} is no longer a loop device":
        assert time.monotonic() < deadline, attach.device_problem(att)
        time.sleep(0.05)
