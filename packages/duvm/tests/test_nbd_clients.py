"""The NBD server against real NBD clients written elsewhere, over a Unix socket.

Clients: nbdinfo, qemu-io, nbdcopy, fio's nbd engine and libnbd (through Debian's
/usr/bin/python3, where python3-libnbd lives). The server runs in a thread of this process
over a `MemoryStore` (optionally behind a `FaultStore`), so tests can check the store and the
server's counters as well as what the client saw. A few protocol corners no client lets us
provoke (out-of-order replies, DISC with requests in flight, garbage) use a raw socket and
bytes built by hand here, not by the codec under test.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
from duvm.node.daemon.nbdserver import NBDServer
from duvm.store.memory_store import MemoryStore
from duvm.store.storage import BlockStore, FaultStore

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None

MiB = 1 << 20
SYS_PYTHON = "/usr/bin/python3"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (CI installs it: see .ci/run)")
    return path


class ServerThread:
    """An NBDServer on a Unix socket, on its own event loop in a thread."""

    def __init__(self, store: BlockStore, export_name: str = "", **kw) -> None:
        self.store = store
        self.dir = tempfile.mkdtemp(prefix="duvm-nbd-")  # short path: sun_path is 108 bytes
        self.path = os.path.join(self.dir, "nbd.sock")
        self.uri = f"nbd+unix:///{export_name}?socket={self.path}"
        self.server = NBDServer(store, export_name, **kw)
        self.loop = uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("NBD server thread did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.start_unix(self.path))
        self._ready.set()
        self.loop.run_forever()

    def call(self, coro):  # run a coroutine on the server's loop
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        try:
            self.call(self.server.close(timeout=5))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def serve() -> Iterator:
    started: list[ServerThread] = []

    def start(store: BlockStore, export_name: str = "", **kw) -> ServerThread:
        st = ServerThread(store, export_name, **kw)
        started.append(st)
        return st

    yield start
    for st in started:
        st.stop()
        assert not os.path.exists(st.path)  # the server removed its socket


def run(cmd: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# ----------------------------------------------------------------------------- nbdinfo


def test_nbdinfo_reports_size_flags_and_block_sizes(serve):
    need("nbdinfo")
    srv = serve(MemoryStore(64 * MiB), "swap0")
    p = run(["nbdinfo", "--json", srv.uri])
    assert p.returncode == 0, p.stderr
    (e,) = json.loads(p.stdout)["exports"]
    assert e["export-name"] == "swap0"
    assert e["export-size"] == 64 * MiB
    assert (e["can_flush"], e["can_fua"], e["can_trim"], e["can_zero"], e["can_multi_conn"]) == (
        True,
        True,
        True,
        True,
        True,
    )
    assert e["is_read_only"] is False and e["can_cache"] is False and e["can_fast_zero"] is False
    assert (e["block_size_minimum"], e["block_size_preferred"], e["block_size_maximum"]) == (
        4096,
        4096,
        32 * MiB,
    )
    assert json.loads(p.stdout)["protocol"] == "newstyle-fixed"


def test_nbdinfo_list_uses_opt_list(serve):
    need("nbdinfo")
    srv = serve(MemoryStore(MiB), "swap0")
    p = run(["nbdinfo", "--list", "--json", f"nbd+unix:///?socket={srv.path}"])
    assert p.returncode == 0, p.stderr
    assert [e["export-name"] for e in json.loads(p.stdout)["exports"]] == ["swap0"]


# ----------------------------------------------------------------------------- qemu-io

SCATTERED = [
    (0, 4096, 0xAB),
    (4096 * 7, 8192, 0x11),
    (5 * MiB, 65536, 0x5A),
    (32 * MiB - 4096, 4096, 0xFE),
    (12 * MiB + 4096 * 3, 4096 * 5, 0x01),
]


def qemu_io(uri: str, *cmds: str) -> subprocess.CompletedProcess[str]:
    args = ["qemu-io", "-f", "raw", uri]
    for c in cmds:
        args += ["-c", c]
    return run(args)


def test_qemu_io_scattered_patterns_read_back_and_discard_reads_zeros(serve):
    need("qemu-io")
    store = MemoryStore(32 * MiB)
    srv = serve(store)
    p = qemu_io(srv.uri, *[f"write -P {pat:#x} {off} {n}" for off, n, pat in SCATTERED])
    assert p.returncode == 0 and p.stdout.count("wrote") == len(SCATTERED), p.stdout + p.stderr
    # A second connection reads every pattern back, and the bytes just around them as zeros.
    checks = [f"read -P {pat:#x} {off} {n}" for off, n, pat in SCATTERED]
    checks += [
        "read -P 0 4096 4096",
        f"read -P 0 {5 * MiB - 4096} 4096",
        f"read -P 0 {5 * MiB + 65536} 4096",
    ]
    p = qemu_io(srv.uri, *checks)
    assert "Pattern verification failed" not in p.stdout, p.stdout
    assert p.returncode == 0 and p.stdout.count("read ") == len(checks), p.stdout + p.stderr
    assert store.counters()["write"] >= len(SCATTERED)

    off, n, _ = SCATTERED[2]
    freed_before = store.counters()["bytes_freed"]
    p = qemu_io(
        srv.uri,
        f"discard {off} {n}",
        f"read -P 0 {off} {n}",
        f"read -P {SCATTERED[3][2]:#x} {SCATTERED[3][0]} 4096",
    )
    assert p.returncode == 0 and "Pattern verification failed" not in p.stdout, p.stdout
    assert store.counters()["trim"] == 1 and store.counters()["bytes_freed"] - freed_before == n

    # Writing zeroes (qemu-io's write -z) also reads back as zeros.
    off, n, _ = SCATTERED[1]
    p = qemu_io(srv.uri, f"write -z {off} {n}", f"read -P 0 {off} {n}")
    assert p.returncode == 0 and "Pattern verification failed" not in p.stdout, p.stdout
    assert store.counters()["zero"] == 1


def test_qemu_io_detects_a_wrong_pattern(serve):
    """Guards the test above: a mismatching pattern must be reported."""
    need("qemu-io")
    srv = serve(MemoryStore(MiB))
    p = qemu_io(srv.uri, "write -P 0xab 0 4096", "read -P 0xac 0 4096")
    assert "Pattern verification failed" in p.stdout


# ----------------------------------------------------------------------------- nbdcopy


@pytest.mark.slow
def test_nbdcopy_256mib_random_round_trip(serve, tmp_path):
    need("nbdcopy")
    size = 256 * MiB
    src = tmp_path / "src.bin"
    h_src = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(size // (16 * MiB)):
            chunk = os.urandom(16 * MiB)
            h_src.update(chunk)
            f.write(chunk)
    store = MemoryStore(size)
    srv = serve(store)
    p = run(["nbdcopy", str(src), srv.uri], timeout=300)
    assert p.returncode == 0, p.stderr
    src.unlink()  # keep the disk footprint at one copy
    dst = tmp_path / "dst.bin"
    p = run(["nbdcopy", "--no-extents", srv.uri, str(dst)], timeout=300)
    assert p.returncode == 0, p.stderr
    h_dst = hashlib.sha256()
    with open(dst, "rb") as f:
        while chunk := f.read(16 * MiB):
            h_dst.update(chunk)
    assert dst.stat().st_size == size
    assert h_dst.hexdigest() == h_src.hexdigest()
    assert store.counters()["bytes_written"] >= size and store.counters()["bytes_read"] >= size


# ----------------------------------------------------------------------------- fio


@pytest.mark.slow
@pytest.mark.parametrize("delayed", [False, True], ids=["inline", "async-store"])
def test_fio_64_in_flight_over_4_connections_verifies(serve, delayed, tmp_path):
    need("fio")
    base = MemoryStore(64 * MiB)
    # With a store that really suspends, requests overlap inside the server too.
    store = FaultStore(base, delay={"read": 0.0002, "write": 0.0002}) if delayed else base
    srv = serve(store)
    p = run(
        [
            "fio",
            "--name=verify",
            "--ioengine=nbd",
            f"--uri={srv.uri}",
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
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
    job = json.loads(p.stdout[p.stdout.index("{") :])["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] == 4 * 8 * MiB
    assert job["read"]["io_bytes"] == 4 * 8 * MiB  # the verify pass read everything back
    assert srv.server.stats.connections >= 4
    assert base.counters()["bytes_written"] == 4 * 8 * MiB
    if delayed:
        assert srv.server.stats.peak_in_flight > 1


# ----------------------------------------------------------------------------- libnbd errors

LIBNBD_SCRIPT = r"""
import json, sys, nbd
h = nbd.NBD()
h.set_strict_mode(0)          # let bad requests reach the server
h.connect_uri(sys.argv[1])
size = h.get_size()
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = 0
    except nbd.Error as e:
        out[name] = e.errno  # libnbd gives the errno's name, e.g. "EINVAL"
    # the connection must keep working after every error
    h.pwrite(b"\x5a" * 4096, 0)
    assert h.pread(4096, 0) == b"\x5a" * 4096, name
attempt("read_past_end", lambda: h.pread(4096, size))
attempt("write_past_end", lambda: h.pwrite(b"x" * 4096, size))
attempt("zero_past_end", lambda: h.zero(4096, size))
attempt("trim_past_end", lambda: h.trim(4096, size))
attempt("read_unaligned", lambda: h.pread(4096, 512))
attempt("write_unaligned_len", lambda: h.pwrite(b"x" * 1000, 0))
attempt("read_df_flag", lambda: h.pread(4096, 0, flags=nbd.CMD_FLAG_DF))
attempt("trim_no_hole_flag", lambda: h.trim(4096, 0, flags=nbd.CMD_FLAG_NO_HOLE))
attempt("zero_fast_zero", lambda: h.zero(4096, 0, flags=nbd.CMD_FLAG_FAST_ZERO))
attempt("read_too_big", lambda: h.pread((32 << 20) + 4096, 0))
attempt("read_fault", lambda: h.pread(4096, 1 << 20))
attempt("write_fault", lambda: h.pwrite(b"y" * 4096, 1 << 20))
attempt("good_read", lambda: h.pread(4096, 8192))
attempt("write_fua", lambda: h.pwrite(b"f" * 4096, 8192, flags=nbd.CMD_FLAG_FUA))
attempt("flush", lambda: h.flush())
out["connected"] = not h.aio_is_closed()
h.shutdown()
print(json.dumps(out))
"""


def libnbd(script: str, *args: str) -> dict:
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    probe = run([SYS_PYTHON, "-c", "import nbd"], env=env)
    if probe.returncode != 0:
        pytest.skip("python3-libnbd is not importable by /usr/bin/python3")
    p = run([SYS_PYTHON, "-c", script, *args], env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_libnbd_bad_requests_get_documented_errors_and_connection_survives(serve):
    base = MemoryStore(64 * MiB)
    fault_range = range(1 << 20, (1 << 20) + 4096)
    store = FaultStore(base, fail={"read": errno.EIO, "write": errno.ENOSPC}, only=fault_range)
    srv = serve(store)
    out = libnbd(LIBNBD_SCRIPT, srv.uri)
    assert out == {
        "read_past_end": "EINVAL",
        "write_past_end": "ENOSPC",
        "zero_past_end": "ENOSPC",
        "trim_past_end": "EINVAL",
        "read_unaligned": "EINVAL",
        "write_unaligned_len": "EINVAL",
        "read_df_flag": "EINVAL",
        "trim_no_hole_flag": "EINVAL",
        "zero_fast_zero": "EINVAL",
        "read_too_big": "EINVAL",
        "read_fault": "EIO",
        "write_fault": "ENOSPC",
        "good_read": 0,
        "write_fua": 0,
        "flush": 0,
        "connected": True,
    }
    # Validation errors never reached the store; the two injected faults did.
    assert srv.server.stats.errors == 12
    assert base.counters()["read"] == 1 + 15  # good_read + the check after every attempt
    assert base.counters()["flush"] == 2  # FUA is honoured by a flush after the write, then FLUSH


# ----------------------------------------------------------------------------- raw protocol


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def raw_connect(path: str) -> socket.socket:
    """Fixed newstyle handshake by hand: GO on the default export."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    assert recv_exact(s, 18)[:16] == b"NBDMAGICIHAVEOPT"
    s.sendall(struct.pack(">I", 3))
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">IH", 0, 0))
    while True:
        _, _, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, length)
        if rtype == 1:
            return s
        assert rtype == 3, hex(rtype)


def send_req(
    s: socket.socket, cmd: int, cookie: int, offset: int = 0, length: int = 0, payload: bytes = b""
) -> None:
    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, cmd, cookie, offset, length) + payload)


def recv_reply(s: socket.socket, read_len: int = 0) -> tuple[int, int, bytes]:
    magic, err, cookie = struct.unpack(">IIQ", recv_exact(s, 16))
    assert magic == 0x67446698
    return cookie, err, recv_exact(s, read_len) if read_len and not err else b""


def closed_by_server(s: socket.socket, timeout: float = 5) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


class SeeingStore(MemoryStore):
    """A MemoryStore that offers the callback fast path (declining it, so the coroutine path
    then runs) and records every range either path was asked for."""

    fast_path = True

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.seen: list[tuple[str, int, int]] = []

    def start_read(self, offset, out, done, tag) -> bool:
        self.seen.append(("start_read", offset, len(out)))
        return False

    def start_write(self, offset, data, done, tag) -> bool:
        self.seen.append(("start_write", offset, len(data)))
        return False

    async def read(self, offset, out) -> None:
        self.seen.append(("read", offset, len(out)))
        await super().read(offset, out)

    async def write(self, offset, data) -> None:
        self.seen.append(("write", offset, len(data)))
        await super().write(offset, data)

    async def trim(self, offset, length) -> None:
        self.seen.append(("trim", offset, length))
        await super().trim(offset, length)

    async def write_zeroes(self, offset, length, *args, **kw) -> None:
        self.seen.append(("zero", offset, length))
        await super().write_zeroes(offset, length, *args, **kw)


def test_requests_that_run_past_the_end_are_refused_before_any_store_path(serve):
    """Catches a bounds check of the start alone (`offset < size`): a request that starts
    inside the export and runs past its end would reach the store, the fast path included.
    Every earlier past-the-end test started exactly at the size."""
    size = MiB
    store = SeeingStore(size)
    srv = serve(store)
    s = raw_connect(srv.path)
    inside = size - 4096  # starts on the last page, runs one page past the end
    send_req(s, 0, cookie=1, offset=inside, length=8192)  # READ
    send_req(s, 1, cookie=2, offset=inside, length=8192, payload=b"x" * 8192)  # WRITE
    send_req(s, 4, cookie=3, offset=inside, length=8192)  # TRIM
    send_req(s, 6, cookie=4, offset=inside, length=8192)  # WRITE_ZEROES
    got = {c: e for c, e, _ in (recv_reply(s) for _ in range(4))}
    assert got == {1: errno.EINVAL, 2: errno.ENOSPC, 3: errno.EINVAL, 4: errno.ENOSPC}
    assert store.seen == []  # refused before the store saw any of them
    # the connection is intact, and an in-range request takes the fast path first
    send_req(s, 1, cookie=5, offset=inside, length=4096, payload=b"y" * 4096)
    assert recv_reply(s) == (5, 0, b"")
    send_req(s, 0, cookie=6, offset=inside, length=4096)  # after the write (NBD orders none)
    assert recv_reply(s, 4096) == (6, 0, b"y" * 4096)
    assert store.seen == [
        ("start_write", inside, 4096),
        ("write", inside, 4096),
        ("start_read", inside, 4096),
        ("read", inside, 4096),
    ]
    s.close()


def _one_write_and_read(srv) -> None:
    s = raw_connect(srv.path)
    send_req(s, 1, cookie=1, offset=0, length=4096, payload=b"f" * 4096)
    assert recv_reply(s) == (1, 0, b"")
    send_req(s, 0, cookie=2, offset=0, length=4096)  # after the write (NBD orders none)
    assert recv_reply(s, 4096) == (2, 0, b"f" * 4096)
    s.close()


def test_the_fast_path_is_offered_only_to_a_store_that_declares_it(serve):
    """Catches a server that picks the fast path by which methods a store defines (a filter
    that inherits or stubs `start_read` would change the path silently)."""
    undeclared = SeeingStore(MiB)
    undeclared.fast_path = False
    _one_write_and_read(serve(undeclared))
    assert undeclared.seen == [("write", 0, 4096), ("read", 0, 4096)]


def test_filters_forward_or_decline_the_fast_path(serve):
    """Catches a filter that hides its inner store's fast path (FaultStore forwards it, and
    declines only a request it must fault; CryptStore forwards it with the pages sealed) or
    that takes a request the store below declined (it must then take the coroutine path)."""
    inner = SeeingStore(MiB)
    faults = FaultStore(inner, delay={"read": 0.01}, only=range(0, 4096))
    assert faults.fast_path and faults.describe() == "local RAM, faults injected"
    _one_write_and_read(serve(faults))
    # the write was forwarded to the fast path; the read, which has a delay to inject there,
    # was declined before the inner store saw it and took the coroutine path
    assert inner.seen == [("start_write", 0, 4096), ("write", 0, 4096), ("read", 0, 4096)]

    from duvm.store.crypt_store import CryptStore

    inner = SeeingStore(MiB)
    sealed = CryptStore(inner)
    assert sealed.fast_path and sealed.describe() == "local RAM, pages encrypted"
    _one_write_and_read(serve(sealed))
    # offered to the store below first, declined there, then the coroutine path
    assert inner.seen == [
        ("start_write", 0, 4096),
        ("write", 0, 4096),
        ("start_read", 0, 4096),
        ("read", 0, 4096),
    ]
    assert bytes(inner._view[:4096]) != b"f" * 4096  # below it, only ciphertext


def test_replies_come_out_of_order_as_requests_complete(serve):
    base = MemoryStore(MiB)
    srv = serve(FaultStore(base, delay={"read": 0.3}, only=range(0, 4096)))
    s = raw_connect(srv.path)
    send_req(s, 0, cookie=1, offset=0, length=4096)  # slow
    send_req(s, 1, cookie=2, offset=8192, length=4096, payload=b"w" * 4096)
    send_req(s, 0, cookie=3, offset=8192, length=4096)
    first = [recv_reply(s, 4096 if c != 2 else 0) for c in (2, 3)]
    assert [(c, e) for c, e, _ in first] == [(2, 0), (3, 0)]
    assert first[1][2] == b"w" * 4096
    assert recv_reply(s, 4096) == (1, 0, bytes(4096))
    s.close()


def test_disc_lets_in_flight_requests_finish_then_closes(serve):
    base = MemoryStore(MiB)
    srv = serve(FaultStore(base, delay={"write": 0.2}))
    s = raw_connect(srv.path)
    send_req(s, 1, cookie=9, offset=4096, length=4096, payload=b"d" * 4096)
    send_req(s, 2, cookie=10)  # DISC: no reply of its own
    assert recv_reply(s) == (9, 0, b"")
    assert closed_by_server(s)
    out = bytearray(4096)
    srv.call(base.read(4096, memoryview(out)))
    assert out == b"d" * 4096


def test_garbage_closes_only_that_connection(serve):
    base = MemoryStore(MiB)
    srv = serve(base)
    good = raw_connect(srv.path)
    send_req(good, 1, cookie=1, offset=0, length=4096, payload=b"g" * 4096)
    assert recv_reply(good) == (1, 0, b"")

    bad_flags = socket.socket(socket.AF_UNIX)
    bad_flags.connect(srv.path)
    recv_exact(bad_flags, 18)
    bad_flags.sendall(struct.pack(">I", 0xFFFF0000))  # unknown client flags
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(srv.path)
    recv_exact(garbage, 18)
    garbage.sendall(struct.pack(">I", 1) + os.urandom(64))  # not an option header
    bad_magic = raw_connect(srv.path)
    bad_magic.sendall(os.urandom(28))  # transmission phase, wrong request magic
    for s in (bad_flags, garbage, bad_magic):
        assert closed_by_server(s)
        s.close()
    assert srv.server.stats.protocol_errors >= 3

    send_req(good, 0, cookie=2, offset=0, length=4096)
    assert recv_reply(good, 4096) == (2, 0, b"g" * 4096)
    good.close()


def test_server_close_finishes_in_flight_request_then_disconnects(serve):
    base = MemoryStore(MiB)
    srv = serve(FaultStore(base, delay={"read": 0.3}))
    s = raw_connect(srv.path)
    send_req(s, 0, cookie=5, offset=0, length=4096)
    # in flight before the close (a fixed delay could let the close come first on a loaded
    # machine: an unread request is rightly never answered)
    deadline = time.monotonic() + 30
    while srv.server.stats.requests < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    fut = asyncio.run_coroutine_threadsafe(srv.server.close(timeout=5), srv.loop)
    assert recv_reply(s, 4096) == (5, 0, bytes(4096))
    assert closed_by_server(s)
    fut.result(10)
    assert srv.server.open_connections == 0


@pytest.mark.parametrize(
    ("delay", "fail", "expect"),
    [
        (0.0, None, 0),  # bare yield (asyncio.sleep(0)) inside the store
        (0.01, None, 0),  # awaits a timer future
        (0.01, errno.EIO, 5),  # fails after resuming: NBD_EIO
        (0.0, errno.ENOSPC, 28),  # fails after a bare yield: NBD_ENOSPC
    ],
)
def test_suspending_store_coroutines_are_resumed_and_their_errors_mapped(
    serve, delay, fail, expect
):
    base = MemoryStore(MiB)
    srv = serve(
        FaultStore(
            base, delay={"write": delay, "read": delay}, fail={"write": fail} if fail else {}
        )
    )
    s = raw_connect(srv.path)
    for cookie in range(1, 9):  # several in flight at once
        send_req(
            s, 1, cookie=cookie, offset=cookie * 4096, length=4096, payload=bytes([cookie]) * 4096
        )
    replies = sorted(recv_reply(s) for _ in range(8))
    assert replies == [(c, expect, b"") for c in range(1, 9)]
    send_req(s, 0, cookie=99, offset=3 * 4096, length=4096)
    assert recv_reply(s, 4096) == (99, 0, bytes([3]) * 4096 if not fail else bytes(4096))
    s.close()


def test_abort_with_requests_in_flight_closes_their_coroutines(serve, caplog):
    base = MemoryStore(MiB)
    srv = serve(FaultStore(base, delay={"write": 0.3}))
    s = raw_connect(srv.path)
    send_req(s, 1, cookie=1, offset=0, length=4096, payload=b"a" * 4096)
    time.sleep(0.05)
    s.sendall(os.urandom(28))  # bad magic: the server drops the connection at once
    assert closed_by_server(s)
    time.sleep(0.4)  # past the delay: the closed coroutine must not be resumed
    out = bytearray(4096)
    srv.call(base.read(0, memoryview(out)))
    assert out == bytes(4096)  # the write never reached the store
    assert "store failed" not in caplog.text
    assert srv.server.open_connections == 0
    s.close()


def test_connections_beyond_the_limit_are_refused_others_keep_working(serve):
    srv = serve(MemoryStore(MiB), max_connections=2)
    a, b = raw_connect(srv.path), raw_connect(srv.path)
    c = socket.socket(socket.AF_UNIX)
    c.connect(srv.path)
    assert closed_by_server(c)
    c.close()
    for s in (a, b):
        send_req(s, 0, cookie=1, offset=0, length=4096)
        assert recv_reply(s, 4096) == (1, 0, bytes(4096))
        s.close()


def test_client_that_never_negotiates_is_dropped(serve):
    # the good client below must negotiate within the timeout too: 1 s, not 0.3 s, leaves
    # room for its thread to be scheduled late on a loaded machine
    srv = serve(MemoryStore(MiB), handshake_timeout=1.0)
    s = socket.socket(socket.AF_UNIX)
    s.connect(srv.path)
    assert recv_exact(s, 18)[:8] == b"NBDMAGIC"
    assert closed_by_server(s, timeout=5)  # said nothing: dropped after the timeout
    s.close()
    good = raw_connect(srv.path)  # a negotiating client is not affected
    time.sleep(1.5)  # past the handshake timeout
    send_req(good, 0, cookie=4, offset=0, length=4096)
    assert recv_reply(good, 4096) == (4, 0, bytes(4096))
    good.close()


def test_the_in_ram_store_answers_reads_and_writes_without_a_task(serve):
    """Catches the in-RAM store falling back to the coroutine path (a Task per request halved
    `duvm daemon --memory`'s IOPS): its reads and writes are answered from `start_read` and
    `start_write` at once; only the other commands run as Tasks (counted by the loop's task
    factory, whichever request path runs)."""
    ran: list[str] = []

    def counting(loop, coro, **kw):
        ran.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **kw)

    async def install() -> None:
        asyncio.get_running_loop().set_task_factory(counting)

    store = MemoryStore(MiB)
    srv = serve(store)
    srv.call(install())
    _one_write_and_read(srv)
    assert ran == []
    assert (store.counters()["write"], store.counters()["read"]) == (1, 1)
    s = raw_connect(srv.path)
    send_req(s, 4, cookie=9, offset=0, length=4096)  # TRIM: the coroutine path
    assert recv_reply(s) == (9, 0, b"")
    s.close()
    assert ran == ["MemoryStore.trim"]
