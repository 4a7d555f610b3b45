"""The swap device a daemon is told (`duvm.base.control_socket`'s ``swap_device`` request):
kept by the daemon in memory and named in its status ("swap_device"), which is how gputaskman
labels swapped-out bytes as the pool's. A real control socket with the daemon's own status
provider (`daemon.ControlStatus`), then a real `duvm daemon` process told through the helper
that `duvm enable`, a resume and a standby's takeover call (`try_tell_swap_device`). `duvm
enable` itself is checked in test_enable_e2e.py, a standby's takeover in test_standby.py."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import duvm_processes
import pytest
from duvm.base import control_socket
from duvm.node.attach import processes
from duvm.node.daemon.daemon import ControlStatus
from duvm.node.daemon.nbdserver import NBDServer
from duvm.node.daemon.status import daemon_status
from duvm.node.lifecycle import control
from duvm.store.memory_store import MemoryStore

MiB = 1 << 20

BAD = [
    ("nbd0", "absolute path under /dev/"),  # relative
    ("/tmp/nbd0", "absolute path under /dev/"),  # not under /dev/
    ("/dev/", "absolute path under /dev/"),  # /dev/ itself
    ("/dev/../etc/passwd", "normalised"),
    ("/dev/nbd0/", "normalised"),
    ("/dev/nbd0\n", "normalised"),
    ("/dev/" + "x" * 300, "longer than"),
    (7, "string"),
    (None, "string"),
    (["/dev/nbd0"], "string"),
]


def _raw(path: str, line: bytes) -> dict:
    """One request line as any client could send it, the answer decoded."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(line + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


async def test_a_told_device_is_in_the_status_and_a_bad_one_changes_nothing(tmp_path) -> None:
    """Catches a daemon whose status does not name the device it was told, a request that
    takes something other than a short absolute path under /dev/ (each refused with a reason,
    the device told before kept), and a process without a swap device that accepts one."""
    store = MemoryStore(4 * MiB)
    server = NBDServer(store)
    report = ControlStatus(lambda: daemon_status(store, server, None, "pure").to_json())
    path = str(tmp_path / "d.sock.ctl")
    srv = await control_socket.start(path, report, on_swap_device=report.tell_swap_device)
    bare_path = str(tmp_path / "m.ctl")  # a memserver's, say: it serves no swap device
    bare = await control_socket.start(bare_path, lambda: {"role": "memserver"})
    try:
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["swap_device"] is None and st["size_bytes"] == 4 * MiB and st["nbd"] is not None
        await asyncio.to_thread(control_socket.tell_swap_device, path, "/dev/nbd0")
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["swap_device"] == "/dev/nbd0" and report.swap_device == "/dev/nbd0"
        assert st["pid"] == os.getpid()  # the rest of the status is still there

        for device, why in BAD:
            line = json.dumps({"cmd": "swap_device", "device": device}).encode()
            reply = await asyncio.to_thread(_raw, path, line)
            assert list(reply) == ["error"] and why in reply["error"], (device, reply)
            if isinstance(device, str):  # the client helper refuses it before sending
                with pytest.raises(ValueError, match=why):
                    await asyncio.to_thread(control_socket.tell_swap_device, path, device)
        missing = await asyncio.to_thread(_raw, path, b'{"cmd": "swap_device"}')
        assert list(missing) == ["error"]
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["swap_device"] == "/dev/nbd0"  # nothing changed

        # told again (a resume on another device): the latest is reported
        await asyncio.to_thread(control_socket.tell_swap_device, path, "/dev/loop3")
        assert (await asyncio.to_thread(control_socket.query, path))["swap_device"] == "/dev/loop3"

        with pytest.raises(ValueError, match="serves no swap device"):
            await asyncio.to_thread(control_socket.tell_swap_device, bare_path, "/dev/nbd0")
        assert await asyncio.to_thread(control_socket.query, bare_path) == {"role": "memserver"}
    finally:
        srv.close()
        bare.close()
        await store.close()


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to ask as another user",
)
async def test_another_user_cannot_tell_a_swap_device() -> None:
    """Catches a `swap_device` request answered without the credential check `status` has:
    with the socket's mode opened up, another user is still refused and nothing changes."""
    store = MemoryStore(MiB)
    report = ControlStatus(lambda: daemon_status(store, None).to_json())
    where = tempfile.mkdtemp(prefix="duvm-ctl-", dir="/tmp")  # reachable by nobody
    os.chmod(where, 0o755)
    path = os.path.join(where, "d.ctl")
    srv = await control_socket.start(path, report, on_swap_device=report.tell_swap_device)
    os.chmod(path, 0o666)  # past the file mode: the peer credentials must refuse
    code = "\n".join(
        [
            "import socket",
            "s = socket.socket(socket.AF_UNIX)",
            f"s.connect({path!r})",
            "try:",  # the refusal may come (and the socket close) before the request is sent
            """    s.sendall(b'{"cmd": "swap_device", "device": "/dev/nbd9"}\\n')""",
            "except BrokenPipeError:",
            "    pass",
            "print(s.recv(4096).decode())",
        ]
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert json.loads(out) == {"error": "permission denied"}
        assert report.swap_device is None
        assert (await asyncio.to_thread(control_socket.query, path))["swap_device"] is None
    finally:
        srv.close()
        await store.close()
        shutil.rmtree(where, ignore_errors=True)


# ------------------------------------------------------------------------- a real daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[control.DaemonInfo]:
    """A real `duvm daemon` (local RAM), recorded as `duvm enable` records it."""
    sock = str(tmp_path / "nbd.sock")
    log = tmp_path / "daemon.log"
    proc = duvm_processes.start(
        [
            "daemon",
            "--memory",
            "--size",
            "4M",
            "--socket",
            sock,
            "--no-mlock",
            "--no-realtime",
            "--no-io-flusher",
        ],
        "serving export",
        log,
    )
    info = control.DaemonInfo(
        proc.pid,
        sock,
        [],
        4 * MiB,
        1,
        str(log),
        time.time(),
        "test-swap-device",
        [],
        processes.start_time(proc.pid),
    )
    control.daemon_path(tmp_path).write_text(json.dumps(asdict(info)) + "\n")
    try:
        yield info
    finally:
        assert duvm_processes.stop(proc) == 0
        assert "Traceback" not in log.read_text()


def test_a_real_daemon_told_its_device_reports_it_in_duvm_status(
    tmp_path: Path, daemon: control.DaemonInfo
) -> None:
    """Catches a daemon process whose status never names its swap device (so gputaskman
    never labels swapped bytes as the pool's), and `duvm status` not showing it."""
    no_node = tmp_path / "no-node.ctl"
    ctl = control_socket.default_path(daemon.socket)  # where enable and a resume tell it
    assert control.status(tmp_path, no_node)["daemon"]["swap_device"] is None
    assert control_socket.try_tell_swap_device(ctl, "/dev/nbd3") is True
    assert control_socket.query(ctl)["swap_device"] == "/dev/nbd3"
    st = control.status(tmp_path, no_node)
    assert st["daemon"]["running"] is True and st["daemon"]["swap_device"] == "/dev/nbd3"
    # a refused device is not fatal either: said False, the one told before kept
    assert control_socket.try_tell_swap_device(ctl, "../nbd4") is False
    assert control_socket.try_tell_swap_device(ctl, None) is False  # an attachment without one
    assert control_socket.query(ctl)["swap_device"] == "/dev/nbd3"


def test_a_daemon_that_does_not_answer_never_fails_the_caller(tmp_path: Path) -> None:
    """Catches a tell that raises (which would fail `duvm enable` after its device is swap,
    or a takeover after the device has its connection) or waits without bound: no socket,
    a socket nobody answers on, a stale one and one answering garbage all say False within
    the timeout."""
    ctl = str(tmp_path / "nbd.sock.ctl")
    t0 = time.monotonic()
    assert control_socket.try_tell_swap_device(ctl, "/dev/nbd0", timeout=0.5) is False
    assert control_socket.try_tell_swap_device(ctl, "/dev/nbd0", timeout=5, wait=False) is False
    assert time.monotonic() - t0 < 3

    mute = socket.socket(socket.AF_UNIX)  # accepts (the backlog) and never answers
    mute.bind(ctl)
    mute.listen()
    try:
        t0 = time.monotonic()
        assert control_socket.try_tell_swap_device(ctl, "/dev/nbd0", timeout=0.5) is False
        assert time.monotonic() - t0 < 3
    finally:
        mute.close()
    # now stale: a file nobody listens on
    assert control_socket.try_tell_swap_device(ctl, "/dev/nbd0", timeout=0.3) is False
    os.unlink(ctl)

    garbage = socket.socket(socket.AF_UNIX)
    garbage.bind(ctl)
    garbage.listen()

    def answer() -> None:
        conn, _ = garbage.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"not json\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert control_socket.try_tell_swap_device(ctl, "/dev/nbd0", timeout=2) is False
    finally:
        t.join(5)
        garbage.close()


def test_a_daemon_that_opens_its_socket_late_is_still_told(tmp_path: Path) -> None:
    """Catches a tell that gives up at once when the control socket is not there yet (a
    daemon just started opens it right after its NBD socket, which enable and a resume wait
    for)."""
    ctl = str(tmp_path / "late.ctl")
    told: list[str] = []

    async def serve_late() -> None:
        await asyncio.sleep(0.4)
        srv = await control_socket.start(ctl, lambda: {}, on_swap_device=told.append)
        await asyncio.sleep(2)
        srv.close()

    t = threading.Thread(target=lambda: asyncio.run(serve_late()), daemon=True)
    t.start()
    try:
        assert control_socket.try_tell_swap_device(ctl, "/dev/nbd1", timeout=2) is True
    finally:
        t.join(10)
    assert told == ["/dev/nbd1"]
