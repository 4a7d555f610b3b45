"""`duvm daemon --workers N` (duvm.node.daemon.workers): one export served by N processes over
two real memservers, encrypted, two copies, through real NBD connections (test_standby.py's
`Node` and `KernelStandIn`, a blocking NBD client).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from duvm.base import control_socket
from duvm.base.procstat import stat_fields
from duvm.node.attach import attach_state
from duvm.node.daemon import workers
from duvm.node.lifecycle import (
    control,
    resume,
    standby_process,
    supervise,
    supervisor_process,
    warm_start,
)
from duvm.store import state_files as sf
from test_standby import PAGE, SIZE, KernelStandIn, Node, _wait_said, node  # noqa: F401

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon locks its memory as root")


def _page(p: int, version: int) -> bytes:
    """A page whose every 8 bytes say which page and version it is."""
    return (p.to_bytes(4, "little") + version.to_bytes(4, "little")) * (PAGE // 8)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _cpu_ticks(pid: int) -> int:
    f = stat_fields(pid)
    assert f is not None
    return int(f[11]) + int(f[12])  # utime + stime


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = stat_fields(pid)
        if st is None or st[0] == "Z":
            return True
        time.sleep(0.02)
    return False


def _attached_by(stand: Node, connections: int) -> None:
    """Record the device as attached by `connections`, as `duvm enable --workers N` does."""
    path = control.state_path(stand.state_dir)
    att = attach_state.load_state(path)
    assert att is not None
    att.connections = connections
    attach_state.save_state(path, att)


def _two_workers(stand: Node) -> tuple[int, int, KernelStandIn, KernelStandIn]:
    if "--workers" not in stand.daemon_args:
        stand.daemon_args += ["--workers", "2"]
    daemon = stand.start_daemon()
    kids = _children(daemon.pid)
    assert len(kids) == 1, kids
    a = KernelStandIn(stand.socket)  # accepted first: worker 0's turn
    b = KernelStandIn(stand.socket)  # then worker 1's
    return daemon.pid, kids[0], a, b


@needs_root
def test_two_workers_serve_a_connection_each_and_read_each_others_writes(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches connections left with worker 0 (one core again, whatever --workers says) and a
    worker that does not see the pages another one wrote (its own page tables, not the shared
    mapping)."""
    daemon, worker, a, b = _two_workers(node)
    try:
        for p in range(64):
            (a if p % 2 else b).write(p * PAGE, _page(p, 1))
        for p in range(64):
            assert a.read(p * PAGE, PAGE) == _page(p, 1), p
            assert b.read(p * PAGE, PAGE) == _page(p, 1), p
        b.write(3 * PAGE, _page(3, 2))
        a.write(4 * PAGE, _page(4, 2))
        assert a.read(3 * PAGE, PAGE) == _page(3, 2)
        assert b.read(4 * PAGE, PAGE) == _page(4, 2)
        # the mechanism: requests on b cost the worker's CPU, not worker 0's
        before = _cpu_ticks(worker), _cpu_ticks(daemon)
        for i in range(5000):
            assert b.read((i % 64) * PAGE, PAGE)[:4] == (i % 64).to_bytes(4, "little")
        spent = _cpu_ticks(worker) - before[0], _cpu_ticks(daemon) - before[1]
        assert spent[0] >= 5 and spent[0] > 3 * spent[1], spent
        status = control_socket.query(control_socket.default_path(node.socket))
        assert status["workers"] == [daemon, worker]
        shown = control.format_status(control.status(node.state_dir))
        assert f"workers: pids {daemon} {worker}, connections 1" in shown  # Node attached one
    finally:
        a.close()
        b.close()


@needs_root
def test_each_worker_seals_with_nonces_of_its_own(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches two workers counting nonces from one counter: both would seal their first page
    under nonce 1 with the shared key, and AES-GCM under a repeated nonce gives away the XOR of
    the two pages and lets the tags be forged."""
    _, _, a, b = _two_workers(node)
    try:
        for p in range(32):
            (a if p < 16 else b).write(p * PAGE, _page(p, 1))
        nonces = _nonces(node, range(32))
        tables = _tables(node)
        counters = tables.worker_counter(0), tables.worker_counter(1)
        tables.close()
        assert len(set(nonces)) == 32 and 0 not in nonces
        assert [n >> 64 for n in nonces] == [0] * 16 + [1] * 16  # the sealing worker's index
        assert counters[0] >= 16 and counters[1] >= 16
    finally:
        a.close()
        b.close()


@needs_root
def test_a_page_another_worker_wrote_is_never_read_from_a_stale_window(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches readahead left on with several workers: worker 0 fetches ahead of a sequential
    reader, worker 1 writes a page of that window, and a window, which only this process's
    writes drop, no longer holds the page's bytes (seen with the rule broken: the read of the
    page failed with EIO)."""
    _, _, a, b = _two_workers(node)
    try:
        for p in range(256):
            a.write(p * PAGE, _page(p, 1))
        for first in range(0, 64, 8):  # 32 KiB sequential reads, as swap-in does
            a.read(first * PAGE, 8 * PAGE)
        b.write(80 * PAGE, _page(80, 2))
        for first in range(64, 96, 8):
            got = a.read(first * PAGE, 8 * PAGE)
            for i in range(8):
                want = _page(first + i, 2 if first + i == 80 else 1)
                assert got[i * PAGE : (i + 1) * PAGE] == want, first + i
    finally:
        a.close()
        b.close()


@needs_root
def test_workers_stop_before_worker_0_releases_and_die_with_it(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches a worker left running after a clean stop, pages left reserved by it, and a
    worker that outlives a worker 0 that was killed (it would serve beside the daemon that
    resumes). Each worker has two ways to end with worker 0 (PR_SET_PDEATHSIG, and end of file
    on its socket pair): seen failing with both removed."""
    daemon, worker, a, b = _two_workers(node)
    a.write(0, _page(0, 1))
    b.write(PAGE, _page(1, 1))
    assert node.stored_pages() == [2, 2]
    a.close()
    b.close()
    os.kill(daemon, signal.SIGTERM)
    assert node.procs[-1].wait(30) == 0
    assert _gone(worker)
    assert node.stored_pages() == [0, 0]  # released, by worker 0, once
    assert not os.path.exists(node.socket)
    assert "ended; its connections are gone" not in (node.state_dir / "daemon.log").read_text()
    daemon, worker, a, b = _two_workers(node)
    a.close()
    b.close()
    os.kill(daemon, signal.SIGKILL)
    assert _gone(worker), "a worker outlived worker 0"


@needs_root
def test_a_worker_that_dies_alone_leaves_the_rotation(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches connections still handed to a worker that died (seen with the rotation and the
    hand-over both blind to it: the connection closed during its handshake). Worker 0 serves
    every later connection itself and says what happened."""
    _, worker, a, b = _two_workers(node)
    a.write(0, _page(0, 1))
    os.kill(worker, signal.SIGKILL)
    assert _gone(worker)
    b.close()
    log = node.state_dir / "daemon.log"
    deadline = time.monotonic() + 10
    while "worker 1 (pid" not in log.read_text() or stat_fields(worker) is not None:
        assert time.monotonic() < deadline, log.read_text()  # said, and collected: no zombie
        time.sleep(0.02)
    for version in (2, 3, 4):  # three connections: none of them lands on the dead worker
        c = KernelStandIn(node.socket)
        c.sock.settimeout(10)
        c.write(PAGE, _page(1, version))
        assert c.read(PAGE, PAGE) == _page(1, version)
        assert c.read(0, PAGE) == _page(0, 1)
        c.close()
    a.close()


@needs_root
def test_a_new_cluster_secret_reaches_every_worker(tmp_path: Path) -> None:
    """Catches SIGHUP (a rotated cluster secret) reloaded by worker 0 alone: the other workers'
    connections would keep the old secret and fail their next authentication once the
    memservers drop it."""
    secret = tmp_path / "secret"
    cli = [sys.executable, "-m", "duvm.cli", "secret"]
    subprocess.run([*cli, "generate", str(secret)], check=True, capture_output=True)
    stand = Node(tmp_path, ("--secret-file", str(secret)))
    try:
        stand.daemon_args += ["--secret-file", str(secret)]
        daemon, _, a, b = _two_workers(stand)
        a.write(0, _page(0, 1))
        b.write(PAGE, _page(1, 1))
        subprocess.run([*cli, "add", str(secret)], check=True, capture_output=True)
        os.kill(daemon, signal.SIGHUP)
        log = stand.state_dir / "daemon.log"
        deadline = time.monotonic() + 10
        while log.read_text().count("SIGHUP: re-read") < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        assert b.read(0, PAGE) == _page(0, 1) and a.read(PAGE, PAGE) == _page(1, 1)
        a.close()
        b.close()
    finally:
        stand.close()


def test_the_supervisor_keeps_no_standby_for_a_daemon_of_several_workers(tmp_path: Path) -> None:
    """Catches a standby started for a daemon of several workers: a standby is one process,
    refuses `--workers` (it would serve every connection on one core, or not start at all), and
    would hold memory for nothing. A crash of such a daemon starts a new one (all its workers)
    by `--resume`; the reason is said once and recorded for `duvm status`."""
    said: list[str] = []
    starts: list[int] = []

    def spawn(state_dir: Path, daemon: control.DaemonInfo) -> standby_process.Standby:
        starts.append(daemon.pid)
        raise OSError("not started in this test")

    spares = standby_process.Spares(
        tmp_path, said.append, spawn=spawn, available=lambda: 1 << 40, retry_s=0
    )
    args = ["--state-dir", "/run/duvm/daemon-state"]
    several = control.DaemonInfo(
        os.getpid(), "s", [], 1, 1, "l", 0.0, "c", ["--workers", "2", *args]
    )
    for _ in range(3):
        spares.tend(several)
    assert starts == [] and said == [
        "no standby: a daemon of 2 workers has none yet (DECISIONS.md D49); "
        "a crash starts a new daemon"
    ]
    status = supervisor_process.standby_status(tmp_path)
    assert status is not None and "2 workers" in status["none"]
    one = control.DaemonInfo(os.getpid(), "s", [], 1, 1, "l", 0.0, "c", ["--workers=1", *args])
    spares.tend(one)
    assert starts == [os.getpid()]  # one worker: a standby as ever


@needs_root
def test_a_supervised_daemon_of_two_workers_killed_comes_back_with_both(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """The supervisor's restart of a daemon of two workers, the kernel's part played by two
    clients that hold their requests across the death (one per connection): the daemon is
    SIGKILLed, its worker dies with it, the supervisor forks `--resume --workers 2` from its
    loaded code and hands the device two new connections. Catches a restart with one worker,
    one connection handed (the second client's held request never served), or pages lost."""
    assert warm_start.preload() == []  # as `duvm supervise` does when it starts
    daemon, worker, a, b = _two_workers(node)
    for p in range(16):
        (a if p % 2 else b).write(p * PAGE, _page(p, 1))
    _attached_by(node, 2)
    clients = (a, b)

    def reattach(att: attach_state.Attachment, where: str | None = None) -> None:
        for client in clients[: att.connections]:  # the driver's one socket per connection
            client.reattach(att, where)

    log: list[str] = []
    seen: dict = {}
    errors: list[BaseException] = []

    def events() -> None:
        try:
            _wait_said(log, f"watching daemon pid {daemon}")
            os.kill(daemon, signal.SIGKILL)
            for p in range(16):  # each held across the death, then served by a new worker
                assert (b if p % 2 else a).read(p * PAGE, PAGE) == _page(p, 1), p
            b.write(40 * PAGE, _page(40, 2))
            assert a.read(40 * PAGE, PAGE) == _page(40, 2)
            _wait_said(log, "resumed: daemon pid")
            new = control.load_daemon(node.state_dir)
            assert new is not None
            seen["workers"] = _children(new.pid)
            seen["worker_gone"] = _gone(worker)
        except BaseException as exc:
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # ends watch()

    started: list[resume.Started] = []

    def starting(cmd: list[str], out: Path) -> resume.Started:
        proc = warm_start.fork_daemon(cmd, out)
        started.append(proc)
        return proc

    t = threading.Thread(target=events, daemon=True)
    t.start()
    try:
        rc = supervise.watch(
            node.state_dir,
            say=log.append,
            resume_fn=functools.partial(resume.resume, reattach=reattach),
            start=starting,
            give_up=lambda att, why: errors.append(AssertionError(why)),
            reattach=reattach,
            make_room=lambda need_kib, say: contextlib.nullcontext(),
            link_events=lambda say: None,
        )
        t.join(30)
    finally:
        a.close()
        b.close()
        for proc in started:
            proc.kill()
            proc.wait(10)
    assert not errors, (errors, log)
    assert rc == 0 and a.reconnects == 1 and b.reconnects == 1, log
    assert len(seen["workers"]) == 1 and seen["worker_gone"], (seen, log)
    assert any("no standby: a daemon of 2 workers" in m for m in log), log
    assert not any("failed" in m for m in log), log  # the first try, a fork, served


def _tables(stand: Node) -> sf.PageTables:
    return sf.PageTables.open(stand.state_dir / "daemon-state" / sf.PAGES_FILE, SIZE // PAGE, True)


def _nonces(stand: Node, pages: range) -> list[int]:
    tables = _tables(stand)
    try:
        assert tables.meta is not None
        return [
            int.from_bytes(tables.meta[p * sf.META : p * sf.META + 12], "little") for p in pages
        ]
    finally:
        tables.close()


@needs_root
def test_a_resumed_daemon_serves_with_all_its_workers_and_never_reuses_their_nonces(
    node: Node,  # noqa: F811 - the fixture
) -> None:
    """Catches a restart (`duvm enable --resume`, the kernel's device live) that comes back
    with one worker, or starts a worker's nonces from 0 again (the new worker 1 would seal its
    first page under the dead worker 1's first nonce: seen with the counter slot not read)."""
    daemon, worker, a, b = _two_workers(node)
    for p in range(8):
        (a if p % 2 else b).write(p * PAGE, _page(p, 1))
    _attached_by(node, 2)
    os.kill(daemon, signal.SIGKILL)
    assert _gone(worker)
    a.close()
    b.close()
    handed: list[KernelStandIn] = []

    def reattach(att: attach_state.Attachment) -> None:  # the driver's part: one per connection
        handed.extend(KernelStandIn(att.socket) for _ in range(att.connections))

    info, _ = resume.resume(node.state_dir, reattach=reattach)
    try:
        assert "--workers" in info.daemon_args
        assert len(handed) == 2 and len(_children(info.pid)) == 1
        c, d = handed
        for p in range(8):
            assert (c if p % 2 else d).read(p * PAGE, PAGE) == _page(p, 1), p
        d.write(20 * PAGE, _page(20, 2))  # worker 1 again, a new process
        assert c.read(20 * PAGE, PAGE) == _page(20, 2)
        nonces = _nonces(node, range(21))
        ones = [n for n in nonces if n >> 64 == 1]
        assert len(ones) == 5 and len(set(ones)) == 5, ones  # pages 0, 2, 4, 6 and 20
        assert nonces[20] > max(nonces[p] for p in (0, 2, 4, 6))
    finally:
        for h in handed:
            h.close()  # the resumed daemon is in daemon.json: `Node.close` ends it


def test_a_worker_that_cannot_join_is_ended_and_worker_0_serves_alone() -> None:
    """Catches a worker that could not join left running, or left in the rotation: worker 0's
    `serve` logs the failure and serves every connection itself (failing instead would
    release the pages of a live device). A sleeping process stands in for the worker; this
    test answers on its socket pair as the worker would."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    team = workers.Workers([workers._Child(1, stand_in.pid, mine)])

    async def main() -> object:
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)

        async def worker() -> bytes:
            got = await loop.sock_recv(theirs, 64)
            await loop.sock_sendall(theirs, workers.FAILED + b"cannot open the tables")
            return got

        answered = asyncio.ensure_future(worker())
        with pytest.raises(workers.WorkerError, match="worker 1 cannot serve: cannot open"):
            await team.start(7, timeout=10)
        assert await answered == workers.GO + b"7"
        return team.take()

    try:
        assert asyncio.run(main()) is None  # every connection stays with worker 0
        assert team.pids == [] and not Path(f"/proc/{stand_in.pid}").exists()
    finally:
        theirs.close()
        if stand_in.poll() is None:
            stand_in.kill()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--workers", "0"], "--workers must be 1..64"),
        (["--workers", "65"], "--workers must be 1..64"),
        (["--workers", "2"], "--workers needs --state-dir"),
        (["--workers", "2", "--memory"], "--memory keeps them in one process"),
    ],
)
def test_bad_worker_counts_are_refused_before_anything_starts(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    sock = tmp_path / "nbd.sock"
    peers = [] if "--memory" in extra else ["--peers", "127.0.0.1:9"]
    cmd = [sys.executable, "-m", "duvm.cli", "daemon", "--socket", str(sock), "--size", "8M"]
    out = subprocess.run(
        [*cmd, *peers, "--no-mlock", *extra], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert says in out.stderr
    assert not sock.exists()
