"""The whole request path, compiled against pure, in all four pairings of daemon and memserver.

Four deployed stacks run side by side as real processes, each a `duvm daemon` (two copies of
each page, pages encrypted, peers authenticated) over two `duvm memserver`s: compiled daemon
with compiled memservers, compiled with pure, pure with compiled, and pure with pure
(DUVM_PURE_PYTHON=1 per process). A raw NBD client sends each stack the same request sequence
(Hypothesis), one request at a time or as a burst of writes in flight together, and every
reply must be what a plain byte-array model of the export says: the same errors, the same
bytes. So the compiled and the pure paths answer alike, and they speak one wire format in
every pairing. The sequences include unaligned and out-of-range requests, TRIM, WRITE_ZEROES,
FLUSH, disconnects; a second test SIGKILLs one memserver of each stack while a burst of
writes is in flight (a replica dropped mid-write).

What the compiled modules do on their own with errors, refusals, checksum mismatches and tag
failures is compared in test_memserver_hotloop.py and test_page_cipher.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from duvm.base import accel
from duvm.wire import nbdconst as C
from duvm_processes import start, stop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
PAGES = 1024  # 4 MiB: four slabs of 256 pages, so some requests cross a slab
SIZE = PAGES * PS
EINVAL, ENOSPC = 22, 28
MISSING = [m for m in accel.MODULES if accel.state(m) != "compiled"]
if MISSING and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {MISSING}")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"compiled path not built: {MISSING}")

PAIRINGS = [(d, m) for d in ("compiled", "pure") for m in ("compiled", "pure")]


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        buf += chunk
    return bytes(buf)


class RawNbd:
    """A minimal NBD client: fixed newstyle handshake (EXPORT_NAME), simple replies."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(path)
        magic, opt, _ = struct.unpack(">QQH", _recv(self.sock, 18))
        assert (magic, opt) == (C.NBDMAGIC, C.IHAVEOPT)
        self.sock.sendall(struct.pack(">I", C.FLAG_C_FIXED_NEWSTYLE | C.FLAG_C_NO_ZEROES))
        self.sock.sendall(struct.pack(">QII", C.IHAVEOPT, C.OPT_EXPORT_NAME, 0))
        self.size, self.flags = struct.unpack(">QH", _recv(self.sock, 10))
        self.cookie = 0

    def send(self, cmd: int, offset: int, length: int, data: bytes = b"") -> int:
        self.cookie += 1
        self.sock.sendall(
            C.REQUEST.pack(C.REQUEST_MAGIC, 0, cmd, self.cookie, offset, length) + data
        )
        return self.cookie

    def reply(self, reads: dict[int, int]) -> tuple[int, int, bytes]:
        """(cookie, error, data) of the next reply; `reads` maps a READ's cookie to its length."""
        magic, err, cookie = C.SIMPLE_REPLY.unpack(_recv(self.sock, C.SIMPLE_REPLY.size))
        assert magic == C.SIMPLE_REPLY_MAGIC
        n = reads.get(cookie, 0)
        return cookie, err, _recv(self.sock, n) if n and not err else b""

    def request(self, cmd: int, offset: int, length: int, data: bytes = b"") -> tuple[int, bytes]:
        cookie = self.send(cmd, offset, length, data)
        got, err, payload = self.reply({cookie: length} if cmd == C.CMD_READ else {})
        assert got == cookie
        return err, payload

    def close(self) -> None:
        try:
            self.send(C.CMD_DISC, 0, 0)
        finally:
            self.sock.close()


def _start(args: list[str], ready: str, log: Path, pure: bool) -> subprocess.Popen:
    """`duvm ARGS` on the pure path when `pure`, else on whatever path the build gives."""
    env = {k: v for k, v in os.environ.items() if k != accel.ENV}
    if pure:
        env[accel.ENV] = "1"
    return start(args, ready, log, env=env, timeout=60)


def _path_logged(log: Path) -> str:
    m = re.search(r"request path: (compiled|pure Python)", log.read_text())
    assert m, f"no request path in {log}"
    return "compiled" if m.group(1) == "compiled" else "pure"


@dataclass
class Stack:
    name: str
    sock: str
    memservers: list[subprocess.Popen]
    daemon: subprocess.Popen
    client: RawNbd | None = None

    def connect(self) -> RawNbd:
        if self.client is None:
            self.client = RawNbd(self.sock)
        return self.client

    def reconnect(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


@contextmanager
def _stacks(tmp: Path) -> Iterator[list[Stack]]:
    """The four stacks, one per pairing; every process stopped on the way out."""
    secret = tmp / "cluster.secret"
    subprocess.run(
        [sys.executable, "-m", "duvm.cli", "secret", "generate", str(secret)],
        check=True,
        capture_output=True,
    )
    stacks: list[Stack] = []
    started: list[
        subprocess.Popen
    ] = []  # each process as soon as it runs: none outlives a failed set-up
    try:
        for daemon_path, ms_path in PAIRINGS:
            name = f"{daemon_path}-daemon-{ms_path}-memservers"
            memservers, peers = [], []
            for i in range(2):
                log = tmp / f"{name}.ms{i}.log"
                ms = _start(
                    [
                        *("memserver", "--listen", "127.0.0.1:0", "--capacity", "8M"),
                        *("--no-mlock", "--verbose", "--secret-file", str(secret)),
                    ],
                    "listening on",
                    log,
                    ms_path == "pure",
                )
                started.append(ms)
                memservers.append(ms)
                peers.append(re.search(r"listening on ([\d.]+:\d+)", log.read_text()).group(1))
                assert _path_logged(log) == ms_path
            sock, log = str(tmp / f"{name}.sock"), tmp / f"{name}.daemon.log"
            daemon = _start(
                [
                    *("daemon", "--peers", ",".join(peers), "--replicas", "2", "--encrypt"),
                    *("--secret-file", str(secret), "--size", str(SIZE), "--socket", sock),
                    *("--no-mlock", "--verbose"),
                ],
                "serving export",
                log,
                daemon_path == "pure",
            )
            started.append(daemon)
            assert _path_logged(log) == daemon_path  # mechanism: each runs the path it should
            stacks.append(Stack(name, sock, memservers, daemon))
        yield stacks
    finally:
        for s in stacks:
            if s.client is not None:
                s.client.sock.close()
        for p in reversed(started):  # each daemon before its memservers: it RELEASEs its pages
            stop(p)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    with _stacks(tmp_path_factory.mktemp("pairings")) as started:
        yield started


def _data(seed: int, pages: int) -> bytes:
    return random.Random(seed).randbytes(pages * PS)


# --- the operations, and what the model says each must answer ---------------------------

pages_at = st.integers(0, PAGES - 1)
span = st.integers(1, 64)  # up to 256 KiB
ops = st.one_of(
    st.tuples(st.just("write"), pages_at, span, st.integers(0, 2**32)),
    st.tuples(st.just("read"), pages_at, span),
    st.tuples(st.just("trim"), pages_at, span),
    st.tuples(st.just("zero"), pages_at, span),
    st.tuples(st.just("flush")),
    st.tuples(st.just("unaligned"), st.sampled_from(["read", "write"]), st.integers(1, PS - 1)),
    st.tuples(st.just("beyond"), st.sampled_from(["read", "write"]), span),
    st.tuples(st.just("reconnect")),
    st.tuples(
        st.just("burst"),
        st.lists(st.tuples(pages_at, st.integers(0, 2**32)), min_size=2, max_size=12),
    ),
)


def _apply(op: tuple, client: RawNbd) -> list[tuple[int, bytes]]:
    """Send `op`; returns its replies (error, data), in request order."""
    kind = op[0]
    if kind == "write":
        _, page, n, seed = op
        n = min(n, PAGES - page)
        return [client.request(C.CMD_WRITE, page * PS, n * PS, _data(seed, n))]
    if kind == "read":
        _, page, n = op
        n = min(n, PAGES - page)
        return [client.request(C.CMD_READ, page * PS, n * PS)]
    if kind in ("trim", "zero"):
        _, page, n = op
        n = min(n, PAGES - page)
        cmd = C.CMD_TRIM if kind == "trim" else C.CMD_WRITE_ZEROES
        return [client.request(cmd, page * PS, n * PS)]
    if kind == "flush":
        return [client.request(C.CMD_FLUSH, 0, 0)]
    if kind == "unaligned":
        _, what, off = op
        if what == "read":
            return [client.request(C.CMD_READ, off, PS)]
        return [client.request(C.CMD_WRITE, off, PS, bytes(PS))]
    if kind == "beyond":
        _, what, n = op
        if what == "read":
            return [client.request(C.CMD_READ, SIZE - PS, (n + 1) * PS)]
        return [client.request(C.CMD_WRITE, SIZE - PS, (n + 1) * PS, bytes((n + 1) * PS))]
    if kind == "burst":  # writes in flight together, to distinct pages: any order is right
        pages = {page: seed for page, seed in op[1]}
        cookies = [client.send(C.CMD_WRITE, p * PS, PS, _data(s, 1)) for p, s in pages.items()]
        replies = dict((c, (e, d)) for c, e, d in (client.reply({}) for _ in cookies))
        return [replies[c] for c in cookies]
    raise AssertionError(kind)


def _expect(op: tuple, model: bytearray, flags: int) -> list[tuple[int, bytes]]:
    """What a correct export answers to `op`, and the model updated as it must be."""
    kind = op[0]
    if kind == "write":
        _, page, n, seed = op
        n = min(n, PAGES - page)
        model[page * PS : (page + n) * PS] = _data(seed, n)
        return [(0, b"")]
    if kind == "read":
        _, page, n = op
        n = min(n, PAGES - page)
        return [(0, bytes(model[page * PS : (page + n) * PS]))]
    if kind in ("trim", "zero"):
        _, page, n = op
        n = min(n, PAGES - page)
        offered = C.FLAG_SEND_TRIM if kind == "trim" else C.FLAG_SEND_WRITE_ZEROES
        if not flags & offered:
            return [(EINVAL, b"")]
        model[page * PS : (page + n) * PS] = bytes(n * PS)
        return [(0, b"")]
    if kind == "flush":
        return [(0 if flags & C.FLAG_SEND_FLUSH else EINVAL, b"")]
    if kind == "unaligned":
        return [(EINVAL, b"")]
    if kind == "beyond":
        return [(EINVAL if op[1] == "read" else ENOSPC, b"")]
    if kind == "burst":
        pages = {page: seed for page, seed in op[1]}
        for p, s in pages.items():
            model[p * PS : (p + 1) * PS] = _data(s, 1)
        return [(0, b"")] * len(pages)
    raise AssertionError(kind)


_MODEL = bytearray(SIZE)  # the export as every stack must hold it, across examples


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seq=st.lists(ops, min_size=1, max_size=12))
def test_every_pairing_answers_like_the_model(stacks: list[Stack], seq: list[tuple]) -> None:
    """Catches a compiled path that answers differently from the pure one (a wrong byte, a
    missing or different error, a reply lost), or a pairing whose wire formats disagree."""
    for op in seq:
        if op[0] == "reconnect":
            for s in stacks:
                s.reconnect()
            continue
        flags = stacks[0].connect().flags
        want = _expect(op, _MODEL, flags)
        for s in stacks:
            got = _apply(op, s.connect())
            assert got == want, f"{s.name}: {op[0]} answered {[(e, len(d)) for e, d in got]}"
    # the whole export, read back from every stack in 256 KiB requests
    for s in stacks:
        client = s.connect()
        for page in range(0, PAGES, 64):
            err, data = client.request(C.CMD_READ, page * PS, 64 * PS)
            assert err == 0 and data == _MODEL[page * PS : (page + 64) * PS], (s.name, page)


def test_a_replica_killed_mid_write_loses_nothing_in_any_pairing(tmp_path: Path) -> None:
    """Catches a pairing where a memserver dying while writes are in flight fails or loses
    a write: each stack then has one live copy, which must answer every write and read."""
    model = bytearray(SIZE)
    with _stacks(tmp_path) as stacks:
        writes = [(page, page * 7919) for page in range(0, PAGES, 3)]
        flags = stacks[0].connect().flags
        first = _expect(("burst", writes[:40]), model, flags)
        for s in stacks:
            assert _apply(("burst", writes[:40]), s.connect()) == first
        rest = writes[40:]
        want = _expect(("burst", rest), model, flags)
        for s in stacks:  # the burst leaves, then one memserver of the stack dies under it
            client = s.connect()
            cookies = [client.send(C.CMD_WRITE, p * PS, PS, _data(seed, 1)) for p, seed in rest]
            s.memservers[1].send_signal(signal.SIGKILL)
            replies = dict((c, (e, d)) for c, e, d in (client.reply({}) for _ in cookies))
            assert [replies[c] for c in cookies] == want, s.name
        for s in stacks:
            client = s.connect()
            for page in range(0, PAGES, 64):
                err, data = client.request(C.CMD_READ, page * PS, 64 * PS)
                assert err == 0 and data == model[page * PS : (page + 64) * PS], (s.name, page)
            assert s.memservers[1].wait(10) == -signal.SIGKILL
