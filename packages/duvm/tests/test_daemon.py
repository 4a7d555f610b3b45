"""`duvm daemon` end to end: real memservers on loopback, the daemon as a process, real NBD
clients (qemu-io, nbdinfo, nbdcopy, fio), and the memservers' STATUS as the witness of where
the pages went."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.store.memclient import MemClient
from duvm.store.memserver_status import query_status

MiB = 1 << 20
PY = [sys.executable, "-m", "duvm.cli"]


def need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (CI installs it: see .ci/run)")


def wait_line(proc: subprocess.Popen, text: str, timeout: float = 30) -> str:
    """Read stdout until a line containing `text`; fail with stderr if the process exits."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    buf = ""
    while time.monotonic() < deadline:
        chunk = proc.stdout.readline()
        if chunk:
            buf += chunk
            if text in chunk:
                return chunk
            continue
        if proc.poll() is not None:
            raise AssertionError(
                f"{proc.args} exited {proc.returncode}: "
                f"{buf}{proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(0.02)
    raise AssertionError(f"{proc.args}: no {text!r} within {timeout}s (got {buf!r})")


class Procs:
    """Processes started by a test; all stopped (SIGTERM, then SIGKILL) at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="duvm-d-")

    def start(self, args: list[str]) -> subprocess.Popen:
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def memserver(self, capacity: str, port: int = 0) -> tuple[subprocess.Popen, int]:
        p = self.start(
            [
                *PY,
                "memserver",
                "--listen",
                f"127.0.0.1:{port}",
                "--capacity",
                capacity,
                "--no-mlock",
            ]
        )
        line = wait_line(p, "listening on")
        return p, int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])

    def daemon(
        self,
        ports: list[int],
        size: str,
        client_id: str,
        name: str = "d",
        replicas: int = 1,
        extra: tuple[str, ...] = (),
    ) -> tuple[subprocess.Popen, str]:
        sock = os.path.join(self.dir, f"{name}.sock")
        p = self.start(
            [
                *PY,
                "daemon",
                "--peers",
                ",".join(f"127.0.0.1:{x}" for x in ports),
                "--size",
                size,
                "--socket",
                sock,
                "--client-id",
                client_id,
                "--replicas",
                str(replicas),
                *extra,
            ]
        )
        wait_line(p, "serving")
        return p, sock

    def stop(self, p: subprocess.Popen, timeout: float = 20) -> int:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def procs() -> Iterator[Procs]:
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def status(port: int) -> dict:
    return asyncio.run(query_status("127.0.0.1", port))


def namespace(port: int, client_id: str) -> dict | None:
    return next((n for n in status(port)["namespaces"] if n["client_id"] == client_id), None)


def qemu_io(sock: str, *cmds: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    args = ["qemu-io", "-f", "raw", f"nbd+unix:///?socket={sock}"]
    for c in cmds:
        args += ["-c", c]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def test_pages_live_on_the_memserver_and_trim_frees_them(procs):
    need("qemu-io")
    _ms, port = procs.memserver("64M")
    d, sock = procs.daemon([port], "32M", "test-trim")
    ns = namespace(port, "test-trim")
    assert ns is not None and ns["reserved_pages"] == 32 * MiB // 4096 and ns["stored_pages"] == 0

    p = qemu_io(
        sock, "write -P 0xab 0 4096", "write -P 0x5a 1048576 65536", "write -P 0x11 8388608 8192"
    )
    assert p.returncode == 0 and p.stdout.count("wrote") == 3, p.stdout + p.stderr
    assert namespace(port, "test-trim")["stored_pages"] == 1 + 16 + 2
    assert status(port)["used_pages"] == 19

    p = qemu_io(
        sock,
        "read -P 0xab 0 4096",
        "read -P 0x5a 1048576 65536",
        "read -P 0x11 8388608 8192",
        "read -P 0 4096 4096",
    )
    assert p.returncode == 0 and "verification failed" not in p.stdout, p.stdout

    p = qemu_io(sock, "discard 1048576 65536", "read -P 0 1048576 65536")
    assert p.returncode == 0 and "verification failed" not in p.stdout, p.stdout
    assert namespace(port, "test-trim")["stored_pages"] == 3  # the 16 pages were FREEd

    p = qemu_io(sock, "write -z 8388608 8192", "read -P 0 8388608 8192", "read -P 0xab 0 4096")
    assert p.returncode == 0 and "verification failed" not in p.stdout, p.stdout
    assert namespace(port, "test-trim")["stored_pages"] == 1

    # `duvm status` learns from the daemon itself which request path it runs
    from duvm.base import accel, control_socket

    assert control_socket.query(sock + ".ctl")["request_path"] == accel.report().path

    # SIGTERM: clean exit, and the reservation and pages are released on the memserver.
    assert procs.stop(d) == 0
    assert not os.path.exists(sock)
    assert not os.path.exists(sock + ".ctl")  # no stale control socket for `duvm status`
    ns = namespace(port, "test-trim")
    assert ns is None or (ns["reserved_pages"], ns["stored_pages"]) == (0, 0)
    assert status(port)["used_pages"] == 0 and status(port)["reserved_pages"] == 0


PF_MEMALLOC_NOIO = 0x00080000  # include/linux/sched.h: what PR_SET_IO_FLUSHER sets


def _task_facts(pid: int) -> list[tuple[int, int]]:
    """(scheduling policy, task flags) of each thread of `pid`."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        out.append((int(stat[41 - 3]), int(stat[9 - 3])))  # fields 41 (policy) and 9 (flags)
    return out


def test_the_daemon_protects_itself_against_memory_pressure_by_default(procs):
    """Catches a daemon that runs at the normal scheduling class, unlocked or without the I/O
    flusher flag by default: under real memory pressure such a daemon faulted in reclaim that
    waited on its own swap writes, and the QEMU guest hung or panicked."""
    if os.geteuid() != 0:
        pytest.skip("needs root (SCHED_RR, mlockall, PR_SET_IO_FLUSHER)")
    # what this machine permits even root (a sandbox may deny CAP_SYS_RESOURCE): those the
    # daemon cannot take it must name in a warning
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from duvm.base import pressure; print(json.dumps(pressure.probe()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    allowed = {k: v is None for k, v in json.loads(probe.stdout).items()}
    if not allowed["realtime"] or not allowed["mlock"]:
        pytest.skip(f"this machine refuses SCHED_RR or mlockall even to root: {probe.stdout}")
    _, port = procs.memserver("16M")
    d, sock = procs.daemon([port], "8M", "test-protect")
    threads = _task_facts(d.pid)
    assert len(threads) >= 2  # the event loop and the log writer (duvm.base.quietlog)
    assert all(policy == os.SCHED_RR for policy, _ in threads), threads
    assert all(bool(flags & PF_MEMALLOC_NOIO) == allowed["io-flusher"] for _, flags in threads), (
        threads
    )
    assert os.sched_getparam(d.pid).sched_priority == 1
    status = Path(f"/proc/{d.pid}/status").read_text()
    locked_kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmLck:")).split()[1])
    assert locked_kb > 1024
    adj = Path(f"/proc/{d.pid}/oom_score_adj").read_text().strip()
    assert adj == ("-900" if allowed["oom-score"] else "0")
    p = qemu_io(sock, "write -P 0x3c 0 65536", "read -P 0x3c 0 65536")
    assert p.returncode == 0 and "verification failed" not in p.stdout, p.stdout
    assert procs.stop(d) == 0
    err = d.stderr.read()
    assert ("PR_SET_IO_FLUSHER" in err) != allowed["io-flusher"], err
    assert ("oom_score_adj" in err) != allowed["oom-score"], err
    assert "SCHED_RR" not in err, err

    # the documented opt-outs: the normal class, no I/O flusher flag, another OOM score
    d, _ = procs.daemon(
        [port],
        "8M",
        "test-protect-2",
        name="d2",
        extra=("--no-realtime", "--no-io-flusher", "--oom-score-adj", "-500"),
    )
    threads = _task_facts(d.pid)
    assert all(
        policy == os.SCHED_OTHER and not flags & PF_MEMALLOC_NOIO for policy, flags in threads
    ), threads
    adj = Path(f"/proc/{d.pid}/oom_score_adj").read_text().strip()
    assert adj == ("-500" if allowed["oom-score"] else "0")
    assert procs.stop(d) == 0


def test_nbdinfo_sees_the_daemon_export(procs):
    need("nbdinfo")
    _, port = procs.memserver("16M")
    _, sock = procs.daemon([port], "8M", "test-info")
    p = subprocess.run(
        ["nbdinfo", "--json", f"nbd+unix:///?socket={sock}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    (e,) = json.loads(p.stdout)["exports"]
    assert e["export-size"] == 8 * MiB and e["can_trim"] and e["can_multi_conn"]
    assert e["block_size_minimum"] == 4096


def test_unreachable_peer_is_a_clear_error(procs, dead_port):
    p = procs.start(
        [
            *PY,
            "daemon",
            "--peers",
            f"127.0.0.1:{dead_port}",
            "--size",
            "8M",
            "--socket",
            os.path.join(procs.dir, "x.sock"),
        ]
    )
    assert p.wait(30) == 1
    err = p.stderr.read()
    assert f"127.0.0.1:{dead_port}" in err and "unreachable" in err and "Traceback" not in err
    assert not os.path.exists(os.path.join(procs.dir, "x.sock"))


def test_pool_too_small_for_the_export_is_refused_and_reserves_nothing(procs):
    _, port = procs.memserver("16M")
    p = procs.start(
        [
            *PY,
            "daemon",
            "--peers",
            f"127.0.0.1:{port}",
            "--size",
            "64M",
            "--socket",
            os.path.join(procs.dir, "x.sock"),
            "--client-id",
            "greedy",
        ]
    )
    assert p.wait(30) == 1
    err = p.stderr.read()
    assert "cannot hold" in err and "Traceback" not in err, err
    assert status(port)["reserved_pages"] == 0  # all or nothing
    assert not os.path.exists(os.path.join(procs.dir, "x.sock"))


def test_bad_arguments_exit_2():
    p = subprocess.run(
        [*PY, "daemon", "--size", "1000", "--socket", "/tmp/never.sock", "--memory"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "multiple of 4096" in p.stderr
    p = subprocess.run(
        [*PY, "daemon", "--size", "8M", "--socket", "/tmp/never.sock"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "--peers is required" in p.stderr


def test_full_memserver_refuses_and_the_client_gets_an_error_not_a_hang(procs):
    """The memserver restarts on the same port with its room taken by another namespace:
    the daemon's reconnect cannot restore its reservation, the memserver refuses, and the NBD
    write fails promptly with an error; the daemon keeps serving."""
    need("qemu-io")
    ms, port = procs.memserver("16M")
    d, sock = procs.daemon([port], "8M", "test-full")
    p = qemu_io(sock, "write -P 0x77 0 4096")
    assert p.returncode == 0, p.stdout + p.stderr
    assert procs.stop(ms) == 0

    _, port2 = procs.memserver("4M", port=port)
    assert port2 == port

    async def hog() -> None:  # another node takes all the room (kept for its lease)
        c = MemClient("127.0.0.1", port, "hog")
        await c.connect()
        await c.reserve(4 * MiB // 4096)
        await c.close()

    asyncio.run(hog())
    t0 = time.monotonic()
    p = qemu_io(sock, "write -P 0x78 40960 4096", timeout=60)
    assert time.monotonic() - t0 < 30
    assert "write failed" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "No space left on device" in p.stdout + p.stderr or "Input/output" in (
        p.stdout + p.stderr
    )
    assert d.poll() is None  # still serving
    p = subprocess.run(
        ["nbdinfo", "--size", f"nbd+unix:///?socket={sock}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.stdout.strip() == str(8 * MiB)
    assert namespace(port, "hog")["reserved_pages"] == 1024


@pytest.mark.slow
def test_nbdcopy_256mib_round_trip_through_two_memservers(procs, tmp_path):
    need("nbdcopy")
    _, p1 = procs.memserver("160M")
    _, p2 = procs.memserver("160M")
    _, sock = procs.daemon([p1, p2], "256M", "test-copy")
    uri = f"nbd+unix:///?socket={sock}"
    src = tmp_path / "src.bin"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(16):
            chunk = os.urandom(16 * MiB)
            h.update(chunk)
            f.write(chunk)
    r = subprocess.run(["nbdcopy", str(src), uri], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    src.unlink()
    # The pages are spread over both memservers (slabs placed round-robin).
    stored = [namespace(p, "test-copy")["stored_pages"] for p in (p1, p2)]
    assert sum(stored) == 256 * MiB // 4096 and min(stored) > 0
    dst = tmp_path / "dst.bin"
    r = subprocess.run(
        ["nbdcopy", "--no-extents", uri, str(dst)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    h2 = hashlib.sha256()
    with open(dst, "rb") as f:
        while chunk := f.read(16 * MiB):
            h2.update(chunk)
    assert h2.hexdigest() == h.hexdigest()


@pytest.mark.slow
def test_fio_verify_64_in_flight_over_4_connections_through_the_daemon(procs, tmp_path):
    need("fio")
    _, port = procs.memserver("80M")
    _, sock = procs.daemon([port], "64M", "test-fio")
    r = subprocess.run(
        [
            "fio",
            "--name=verify",
            "--ioengine=nbd",
            f"--uri=nbd+unix:///?socket={sock}",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--numjobs=4",
            "--size=8m",
            "--offset_increment=16m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--group_reporting",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
    assert job["error"] == 0 and job["read"]["io_bytes"] == 32 * MiB
    assert namespace(port, "test-fio")["stored_pages"] == 32 * MiB // 4096


def test_memory_backend_serves_on_unix_and_loopback_tcp(procs):
    need("nbdinfo")
    sock = os.path.join(procs.dir, "m.sock")
    p = procs.start(
        [
            *PY,
            "daemon",
            "--memory",
            "--size",
            "4M",
            "--socket",
            sock,
            "--tcp",
            "127.0.0.1:0",
            "--export-name",
            "swap0",
        ]
    )
    line = wait_line(p, "serving")
    port = int(line.rsplit("tcp:127.0.0.1:", 1)[1])
    for uri in (f"nbd+unix:///swap0?socket={sock}", f"nbd://127.0.0.1:{port}/swap0"):
        r = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == str(4 * MiB), r.stderr
    assert procs.stop(p) == 0


def test_tcp_must_be_loopback():
    p = subprocess.run(
        [
            *PY,
            "daemon",
            "--memory",
            "--size",
            "4M",
            "--socket",
            "/tmp/n.sock",
            "--tcp",
            "0.0.0.0:10809",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "loopback" in p.stderr


def test_a_locked_memserver_locks_the_whole_process_not_only_its_arena(procs):
    """Catches a memserver that locks only its arena: on a node that swaps into the pool too,
    its interpreter's pages could go out to this node's duvm device, and serving its peers
    would then wait on other nodes' memservers."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mlock of the arena and mlockall)")
    p = procs.start([*PY, "memserver", "--listen", "127.0.0.1:0", "--capacity", "4M"])
    line = wait_line(p, "listening on")
    assert "locked yes" in line, line
    status = Path(f"/proc/{p.pid}/status").read_text()
    locked_kb = int(next(ln for ln in status.splitlines() if ln.startswith("VmLck:")).split()[1])
    assert locked_kb > 4096 + 1024, status  # the arena (4 MiB) and the process's own mappings
    assert procs.stop(p) == 0


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--standby-for", "12:zz"], "needs --standby-fd"),
        (["--standby-fd", "5"], "needs --resume and --standby-for"),
        (
            ["--standby-fd", "5", "--resume", "--state-dir", "/tmp/s", "--standby-for", "1:x"],
            "takes PID:START",
        ),
    ],
)
def test_standby_flags_with_bad_input_are_refused_before_anything_starts(
    extra: list[str], why: str
) -> None:
    """Catches `--standby-for` accepted alone or malformed: the daemon then served as if it
    had not been given (seen by hand: `duvm daemon --memory ... --standby-for 12:zz`)."""
    import argparse

    from duvm.node.daemon import daemon as d

    p = argparse.ArgumentParser()
    d.add_arguments(p)
    args = p.parse_args(["--peers", "127.0.0.1:1", "--size", "8M", "--socket", "/tmp/x", *extra])
    with pytest.raises(ValueError, match=why):
        d.settings_from_args(args)


def test_a_stdout_that_cannot_take_a_line_never_stops_the_daemon(tmp_path) -> None:
    """Catches a daemon whose event loop prints its "serving" line itself: after a crash a new
    daemon's stdout is a file on /run whose page may be out on the dead device, and the loop
    stopped in that write and never answered the kernel's handshake (QEMU guest, 256 MiB
    RDMA). Here its stdout is a pipe already full: the control socket must still answer."""
    from duvm.base import control_socket

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 65536)  # full: the next write waits for a reader
    os.set_blocking(write_end, True)
    sock = str(tmp_path / "full.sock")
    p = subprocess.Popen(
        [*PY, "daemon", "--memory", "--size", "4M", "--socket", sock],
        stdout=write_end,
        stderr=subprocess.PIPE,
    )
    os.close(write_end)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock + ".ctl") and time.monotonic() < deadline:
            assert p.poll() is None, p.stderr.read() if p.stderr else ""
            time.sleep(0.05)
        time.sleep(0.5)  # the "serving" line is due by now
        assert control_socket.query(sock + ".ctl", timeout=5)["size_bytes"] == 4 << 20
        # the line comes out once the reader drains the pipe
        drained = b""
        os.set_blocking(read_end, False)
        deadline = time.monotonic() + 10
        while b"serving export" not in drained and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                drained = (drained + os.read(read_end, 1 << 20))[-4096:]
            time.sleep(0.01)
        assert b"duvm daemon serving export" in drained
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:  # its loop stuck in the write (the bug above)
            p.kill()
            p.wait()
        os.close(read_end)
