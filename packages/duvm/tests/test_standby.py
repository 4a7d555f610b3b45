"""The standby daemon (duvm.node.daemon.standby, duvm.node.lifecycle.standby_process): a real
daemon over real memservers is SIGKILLed and the standby `duvm supervise` kept beside it serves
the same NBD client again, without any process being started.

The kernel's nbd driver is absent here, so `KernelStandIn` plays its part over the daemon's
socket: it keeps its requests until they are answered, and when its connection dies it waits
for the connection the supervisor hands it (`reattach`, which on a real node is
`NBD_CMD_RECONFIGURE`) and sends them again, as the driver resends what a dead daemon left
unanswered. The same takeover with the kernel's driver runs in the QEMU guest
(tools/qemu_guest/stress.py, the ``:dkill`` set-ups).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import duvm_processes
import pytest
from duvm.base import pressure
from duvm.node.attach import attach_state, kernelnbd, processes
from duvm.node.lifecycle import (
    control,
    linkmend,
    resume,
    standby_process,
    supervise,
    supervisor_process,
)
from duvm.node.lifecycle.enable import no_standby
from duvm.store import daemon_state as ds
from duvm.store import state_files as sf
from duvm.store.memserver_status import query_status
from duvm.wire import nbdconst as C
from duvm.wire import nbdnetlink
from duvm.wire.nbdguard import TimerGuard

STAND_IN = "import time; time.sleep(60)"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the supervisor and resume run as root")

SIZE = 8 << 20
PAGE = 4096
_REQ = struct.Struct(">IHHQQI")
_REPLY = struct.Struct(">IIQ")


class KernelStandIn:
    """An NBD client that behaves like the kernel's driver across a daemon's death: one
    request at a time, kept until answered, sent again on the connection `reattach` hands
    it."""

    def __init__(self, path: str) -> None:
        self.sock, _ = kernelnbd.connect_unix(path)
        self.handed: queue.Queue[socket.socket] = queue.Queue()
        self._handle = 0
        self.reconnects = 0
        self.given = 0  # connections `reattach` was given
        self.drops = 0  # of those to come, how many to drop as the 6.1 driver may (see below)
        self.hold_s = 60.0  # a request's wait for a new connection (the dead-connection timeout)

    def reattach(self, att: attach_state.Attachment, path: str | None = None) -> None:
        """The supervisor's `reattach`: a new connection for the device (NBD_CMD_RECONFIGURE),
        to the daemon at `path` (a standby's own socket) or `att.socket`. While `drops` is
        above 0, the connection is closed instead of kept, as the driver does (answering
        success) with one it is given before it has marked the dead daemon's dead."""
        sock, _ = kernelnbd.connect_unix(path or att.socket)
        self.given += 1
        if self.drops > 0:
            self.drops -= 1
            sock.close()
            return
        self.handed.put(sock)

    def _exchange(self, cmd: int, offset: int, length: int, data: bytes) -> bytes:
        self._handle += 1
        self.sock.sendall(_REQ.pack(C.REQUEST_MAGIC, 0, cmd, self._handle, offset, length) + data)
        magic, err, handle = _REPLY.unpack(self._recv(_REPLY.size))
        assert (magic, handle) == (C.SIMPLE_REPLY_MAGIC, self._handle)
        if err:
            raise OSError(err, f"NBD error {err} at {offset}")
        return self._recv(length) if cmd == C.CMD_READ else b""

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise ConnectionResetError("the daemon closed the connection")
            buf += got
        return buf

    def request(self, cmd: int, offset: int, length: int, data: bytes = b"") -> bytes:
        while True:
            try:
                return self._exchange(cmd, offset, length, data)
            except (ConnectionError, BrokenPipeError):
                self.sock.close()
                self.sock = self.handed.get(timeout=self.hold_s)  # held, like the kernel's
                self.reconnects += 1

    def write(self, offset: int, data: bytes) -> None:
        self.request(C.CMD_WRITE, offset, len(data), data)

    def cut(self, reports: socket.socket, family: int) -> None:
        """What the driver's receive worker of a dead connection does when it ends late: the
        connection that took its slot meanwhile is shut down, and the cut reported
        (NBD_CMD_LINK_DEAD for /dev/nbd7, as `nbd_mcast_index` sends it) on `reports`."""
        self.sock.shutdown(socket.SHUT_RDWR)
        index = nbdnetlink.nla_u32(nbdnetlink.NBD_ATTR_INDEX, 7)
        reports.send(
            nbdnetlink.genl_message(family, nbdnetlink.NBD_CMD_LINK_DEAD, index, 0, flags=0)
        )

    def read(self, offset: int, length: int) -> bytes:
        return self.request(C.CMD_READ, offset, length)

    def close(self) -> None:
        self.sock.close()


class Node:
    """Two memservers, and a daemon started and recorded as `duvm enable` does on kernel nbd
    over netlink (an attachment of /dev/nbd7 that never reaches a kernel here)."""

    def __init__(self, tmp: Path, memserver_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.memserver_args = memserver_args
        self.state_dir = tmp / "run"
        self.state_dir.mkdir()
        self.procs: list[subprocess.Popen] = []
        self.memservers: list[subprocess.Popen] = []
        self.ports = [self._memserver(i) for i in range(2)]
        self.socket = str(self.state_dir / "nbd.sock")
        self.daemon_args = ["--state-dir", str(self.state_dir / "daemon-state"), "--encrypt"]
        attach_state.save_state(
            control.state_path(self.state_dir),
            attach_state.Attachment(
                socket=self.socket,
                method=attach_state.METHOD_KERNEL,
                device="/dev/nbd7",
                nbd_device="/dev/nbd7",
                nbd_netlink=True,
                dead_conn_timeout_s=60,
            ),
        )

    def _memserver(self, i: int) -> int:
        log = self.tmp / f"ms{i}.log"
        self.memservers.append(
            duvm_processes.start(
                [
                    *("memserver", "--listen", "127.0.0.1:0", "--capacity", "64M", "--no-mlock"),
                    *self.memserver_args,
                ],
                "listening on",
                log,
            )
        )
        return int(log.read_text().split("listening on ")[1].split()[0].rsplit(":", 1)[1])

    def start_daemon(self) -> control.DaemonInfo:
        peers = [f"127.0.0.1:{p}" for p in self.ports]
        log = self.state_dir / "daemon.log"
        proc = processes.spawn_detached(
            [
                sys.executable,
                "-m",
                "duvm.cli",
                "daemon",
                "--socket",
                self.socket,
                "--peers",
                ",".join(peers),
                "--size",
                str(SIZE),
                "--client-id",
                "test-standby",
                "--replicas",
                "2",
                *self.daemon_args,
            ],
            log,
        )
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        info = control.DaemonInfo(
            proc.pid,
            self.socket,
            peers,
            SIZE,
            2,
            str(log),
            time.time(),
            "test-standby",
            list(self.daemon_args),
            processes.start_time(proc.pid),
        )
        control.daemon_path(self.state_dir).write_text(json.dumps(asdict(info)))
        return info

    def stored_pages(self) -> list[int]:
        """Our namespace's pages on each memserver (0 when it has none)."""
        import asyncio

        out = []
        for port in self.ports:
            st = asyncio.run(query_status("127.0.0.1", port))
            ns = [n for n in st["namespaces"] if n["client_id"] == "test-standby"]
            out.append(ns[0]["stored_pages"] if ns else 0)
        return out

    def close(self) -> None:
        daemon = control.load_daemon(self.state_dir)
        if daemon is not None:  # the standby that took over, say: not our child
            processes.send_signal(daemon.pid, signal.SIGKILL, daemon.start)
        for p in [*reversed(self.procs), *self.memservers]:
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()


def _pattern(page: int, version: int) -> bytes:
    return bytes([(page * 7 + version) & 0xFF]) * PAGE


def _ready(spare: standby_process.Standby, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not spare.ready:
        assert spare.ended is None and time.monotonic() < deadline, spare.log.read_text()
        import select

        select.select([spare.sock], [], [], 0.2)
        spare.poll()


def test_a_killed_daemon_is_taken_over_by_its_standby_and_the_same_client_is_served(
    node: Node,
) -> None:
    """The whole path but the kernel: the supervisor keeps a standby, the daemon is SIGKILLed
    with a request of the client held, the standby serves it, no process is started, every
    page written before the kill (also after the standby started) reads back, and a new
    standby follows. Catches a supervisor that starts a new daemon although a standby is
    ready (`resume_fn` is never called), and a standby that allocates or faults in memory
    at the takeover (its resident memory may grow by at most 256 KiB: without the faulting
    in of `standby._warm` it grows by about 0.7 MiB)."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    for p in range(0, 256, 3):
        kernel.write(p * PAGE, _pattern(p, 1))
    log: list[str] = []
    slow: list[object] = []
    seen: dict[str, float] = {}
    errors: list[BaseException] = []

    def events() -> None:
        try:
            _wait_said(log, "standby pid", "ready")
            for p in range(1, 256, 3):  # written while the standby stands by: it must see them
                kernel.write(p * PAGE, _pattern(p, 2))
            seen["t_kill"] = time.monotonic()
            os.kill(daemon.pid, signal.SIGKILL)
            assert kernel.read(0, PAGE) == _pattern(0, 1)  # held across the death, then served
            seen["t_served"] = time.monotonic()
            for p in range(256):
                want = _pattern(p, 1) if p % 3 == 0 else _pattern(p, 2) if p % 3 == 1 else None
                got = kernel.read(p * PAGE, PAGE)
                assert got == (want or bytes(PAGE)), f"page {p}"
            kernel.write(300 * PAGE, _pattern(300, 3))
            assert kernel.read(300 * PAGE, PAGE) == _pattern(300, 3)
            _wait_said(log, "took over")
            new = control.load_daemon(node.state_dir)
            assert new is not None
            st = _status(node.socket + ".ctl")
            seen["status_pid"] = st["pid"]
            seen["swap_device"] = st.get("swap_device")  # told by the supervisor (adopt)
            seen["rss_after"] = float(pressure.rss_kib(new.pid) or -1)
            _wait_said(log, "standby pid", "ready", after="took over")  # the next standby
            seen["status"] = control.format_status(control.status(node.state_dir))
        except BaseException as exc:  # judged in the main thread
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # ends watch(): its _Stop notes it

    t = threading.Thread(target=events, daemon=True)
    t.start()
    rc = supervise.watch(
        node.state_dir,
        say=log.append,
        resume_fn=lambda *a, **k: slow.append(a),
        give_up=lambda att, why: slow.append(why),
        reattach=kernel.reattach,
        make_room=lambda need_kib, say: contextlib.nullcontext(),  # never this machine's OOM
    )
    t.join(30)
    kernel.close()
    assert not errors, (errors, log)
    assert rc == 0 and slow == [] and kernel.reconnects == 1, log
    took = next(m for m in log if "took over" in m)
    new = control.load_daemon(node.state_dir)
    assert new is not None and f"standby pid {new.pid} took over /dev/nbd7" in took
    assert "--standby-fd" in Path(f"/proc/{new.pid}/cmdline").read_text()  # no new process
    assert seen["status_pid"] == new.pid  # `duvm status` finds it under the daemon's names
    assert seen["swap_device"] == "/dev/nbd7"  # so gputaskman labels swapped bytes the pool's
    # its log stays its own (never renamed while the device may still owe its writer a page)
    assert new.log.endswith("daemon-standby-1.log") and "took over in" in Path(new.log).read_text()
    # the standby started after the takeover is gone with the supervisor (it released nothing)
    after = log[log.index(took) + 1 :]
    nxt = int(next(m for m in after if m.endswith("starting")).split()[2])
    assert processes.wait_pid_exit(nxt, 10), "the supervisor left its standby running"
    assert f"standby: pid {nxt} ready (" in seen["status"], seen["status"]  # `duvm status`
    told = int(took.split(" when told")[0].rsplit(" ", 1)[1])
    grew = seen["rss_after"] - told
    print(
        f"served {1000 * (seen['t_served'] - seen['t_kill']):.0f} ms after the SIGKILL; "
        f"standby resident {told} KiB when told to take over, +{grew:.0f} KiB after it"
    )
    assert grew <= 256, took


def _wait_said(log: list[str], *words: str, after: str | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        lines = log
        if after is not None:
            marks = [i for i, m in enumerate(log) if after in m]
            lines = log[marks[0] + 1 :] if marks else []
        if any(all(w in m for w in words) for m in lines):
            return
        assert time.monotonic() < deadline, f"never said {words}: {log}"
        time.sleep(0.02)


def test_a_standby_never_takes_over_from_a_daemon_that_still_runs(node: Node) -> None:
    """Catches a standby that takes over while the daemon lives (two writers of one page
    table and one namespace): asked anyway, it refuses and the daemon goes on serving."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.write(0, _pattern(0, 1))
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        with pytest.raises(standby_process.StandbyError, match=f"pid {daemon.pid} still runs"):
            spare.take_over(timeout=30)
        assert kernel.read(0, PAGE) == _pattern(0, 1) and kernel.reconnects == 0
        assert spare.proc.wait(30) == 1  # a refused standby exits, saying why in its log
        assert f"cannot take over: the daemon pid {daemon.pid} still runs" in spare.log.read_text()
    finally:
        spare.kill()
        kernel.close()


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of `pid`."""
    return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_standby_prepares_at_normal_priority_and_is_realtime_once_ready(node: Node) -> None:
    """Catches a standby that prepares at realtime priority (seconds of CPU under emulation:
    in the QEMU guest the standby started right after a takeover starved the kernel's workers
    that resend the held requests, which waited 9 s) and one that turns only its main thread
    realtime when ready (its log writer would wait behind every other task). The standby is
    held in its preparation by a stopped memserver, once its memory is locked (the protections
    it applies first), then let go."""
    if pressure.become_realtime() is not None:
        pytest.skip("SCHED_RR is not allowed here: nothing to tell apart")
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    daemon = node.start_daemon()
    stopped = node.memservers[1]
    stopped.send_signal(signal.SIGSTOP)
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        deadline = time.monotonic() + 60
        while pressure.rss_kib(spare.pid, "VmLck") in (None, 0):  # protections applied
            assert spare.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        assert not spare.ready and spare.proc.poll() is None
        assert _policies(spare.pid) == {os.SCHED_OTHER}
        stopped.send_signal(signal.SIGCONT)
        _ready(spare)
        assert _policies(spare.pid) == {os.SCHED_RR}
        assert len(os.listdir(f"/proc/{spare.pid}/task")) > 1  # the log writer's thread too
    finally:
        stopped.send_signal(signal.SIGCONT)
        spare.kill()


@pytest.mark.parametrize("how", ["eof", "sigterm"])
def test_a_standby_that_is_stopped_releases_nothing(node: Node, how: str) -> None:
    """Catches a standby whose stop RELEASEs the namespaces (as a daemon's clean stop does):
    the pages of the device the daemon serves would be gone from every memserver."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    for p in range(8):
        kernel.write(p * PAGE, _pattern(p, 1))
    before = node.stored_pages()
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        if how == "eof":
            spare.stop()
        else:
            spare.proc.send_signal(signal.SIGTERM)
        assert spare.proc.wait(30) == 0
        assert before == [8, 8] and node.stored_pages() == before
        assert kernel.read(7 * PAGE, PAGE) == _pattern(7, 1)
    finally:
        spare.kill()
        kernel.close()


@pytest.mark.parametrize("end", ["killed", "stopped"])
def test_a_standby_restores_the_timer_when_its_supervisor_is_killed(node: Node, end: str) -> None:
    """Catches a standby that exits on its supervisor's EOF without keeping the guard it was
    handed: a SIGKILLed supervisor closes the socket before its pidfd turns readable, so a
    standby that does not wait for that (`GuardKeeper.settle`) never restores the timer, and
    a supervisor killed with its daemon leaves requests waiting for ever. And one that fires
    the guard when the supervisor only told it to stop (it would undo the quick requeue of a
    supervisor that lives on). The restore runs for real: no /sys/block/nbd5 here, so it
    finds the device not duvm's and says so in its log."""
    daemon = node.start_daemon()
    sup = subprocess.Popen(["sleep", "600"])
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        spare.send_guard(
            TimerGuard("/dev/nbd5", "4242", 60, sup.pid, processes.start_time(sup.pid))
        )
        if end == "killed":  # as the kernel does it: the socket first, the pidfd a moment later
            spare.sock.close()
            time.sleep(0.2)
            sup.kill()
        else:
            spare.stop()
            sup.kill()
        assert spare.proc.wait(30) == 0
        log = spare.log.read_text()
        fired = f"supervisor pid {sup.pid} ended: /dev/nbd5's request timeout left as it is"
        if end == "killed":
            assert fired in log and "the supervisor is gone" in log
        else:
            assert fired not in log and "told to stop" in log
    finally:
        spare.kill()
        if sup.poll() is None:
            sup.kill()
        sup.wait(10)


def test_a_standby_seals_with_nonces_after_those_the_dead_daemon_used(node: Node) -> None:
    """Catches a standby that keeps the nonce counter it read when it started: the daemon
    sealed pages after that, and the standby would seal new pages under the same key with the
    same nonces (AES-GCM then leaks the XOR of the plaintexts, and forgeries become possible)."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.write(0, _pattern(0, 1))
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        for p in range(1, 9):  # sealed by the daemon after the standby read the counter
            kernel.write(p * PAGE, _pattern(p, 1))
        os.kill(daemon.pid, signal.SIGKILL)
        processes.wait_pid_exit(daemon.pid, 10, daemon.start)
        kernel.reattach(_att(node), spare.take_over(timeout=30))
        spare.handed()
        kernel.write(20 * PAGE, _pattern(20, 2))
        assert kernel.read(5 * PAGE, PAGE) == _pattern(5, 1)
        tables = ds.PageTables.open(
            node.state_dir / "daemon-state" / sf.PAGES_FILE, SIZE // PAGE, encrypted=True
        )
        try:
            assert tables.meta is not None
            nonces = [bytes(tables.meta[p * 28 : p * 28 + 12]) for p in (*range(9), 20)]
            assert len(set(nonces)) == len(nonces), "a nonce was used twice under the key"
            assert tables.nonce_counter == 10
        finally:
            tables.close()
    finally:
        spare.kill()
        kernel.close()


def test_no_standby_is_started_while_memory_is_short_and_that_is_said_once(tmp_path: Path) -> None:
    """Catches a supervisor that starts a standby on a node already short of memory (it would
    take what the programs need: the standby holds about what the daemon holds), or that logs
    the refusal at every retry. This process stands in for the daemon (its size is what a
    standby is expected to hold); `spawn` records the starts instead of starting one."""
    said: list[str] = []
    starts: list[int] = []
    free = [1024]

    def spawn(state_dir: Path, daemon: control.DaemonInfo) -> standby_process.Standby:
        starts.append(daemon.pid)
        raise OSError("not started in this test")

    spares = standby_process.Spares(
        tmp_path, said.append, spawn=spawn, available=lambda: free[0], retry_s=0
    )
    me = control.DaemonInfo(os.getpid(), "s", [], 1, 1, "l", 0.0)
    for _ in range(3):
        spares.tend(me)
    assert starts == [] and len(said) == 1 and said[0].startswith("no standby: 1024 KiB available")
    # ... and recorded, so that `duvm enable` warns and `duvm status` says why
    why = supervisor_process.standby_status(tmp_path)
    assert why is not None and why["pid"] is None
    assert why["none"].startswith("1024 KiB available, ") and "KiB wanted (1.5 x" in why["none"]
    assert no_standby(tmp_path, wait_s=0) == why["none"]
    shown = control.format_status(control.status(tmp_path))
    assert f"standby: none ({why['none']}): a crash starts a new daemon" in shown
    free[0] = 1 << 40
    spares.tend(me)
    assert starts == [os.getpid()]
    assert said[-1] == "no standby: it cannot be started (not started in this test)"
    assert no_standby(tmp_path, wait_s=0) == "it cannot be started: not started in this test"


def test_a_standby_is_started_where_half_its_memory_stays_available_beside_it(
    tmp_path: Path,
) -> None:
    """The bound itself: a standby expected to add 40,000 KiB (what the last one held) starts
    at 60,000 KiB available, not at 59,999. Catches the old bound (twice its memory: the 384
    MiB RDMA guest, 79 MiB available against 83 wanted, then had none and waited seconds for a
    new daemon at a crash) and a bound below one and a half (the standby would leave the node
    less than half its size)."""
    starts: list[int] = []

    def spawn(state_dir: Path, daemon: control.DaemonInfo) -> standby_process.Standby:
        starts.append(daemon.pid)
        raise OSError("not started in this test")

    free = [59_999]
    spares = standby_process.Spares(
        tmp_path, lambda _: None, spawn=spawn, available=lambda: free[0], retry_s=0
    )
    spares.last_ready_anon_kib = 40_000
    me = control.DaemonInfo(os.getpid(), "s", [], 1, 1, "l", 0.0)
    spares.tend(me)
    assert starts == []
    assert no_standby(tmp_path, wait_s=0) == (
        "59999 KiB available, 60000 KiB wanted (1.5 x a standby's own memory)"
    )
    free[0] = 60_000
    spares.tend(me)
    assert starts == [os.getpid()]


def test_a_standby_starting_is_recorded_at_once(tmp_path: Path) -> None:
    """Catches a standby recorded only once ready (seconds under TCG): `duvm enable` would wait
    its whole grace on every node, and `duvm status` would show nothing meanwhile."""
    procs: list[subprocess.Popen[bytes]] = []
    socks: list[socket.socket] = []

    def spawn(state_dir: Path, daemon: control.DaemonInfo) -> standby_process.Standby:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)", "duvm.cli", "daemon"]
        )
        procs.append(proc)
        mine, theirs = socket.socketpair()
        socks.extend((mine, theirs))
        return standby_process.Standby(proc, mine, state_dir / "standby.log", daemon.pid)

    spares = standby_process.Spares(
        tmp_path, lambda m: None, spawn=spawn, available=lambda: 1 << 40
    )
    try:
        spares.tend(control.DaemonInfo(os.getpid(), "s", [], 1, 1, "l", 0.0))
        sb = supervisor_process.standby_status(tmp_path)
        assert sb is not None and sb["pid"] == procs[0].pid and sb["ready"] is False
        assert no_standby(tmp_path, wait_s=5) is None  # at once: the record is there
        shown = control.format_status(control.status(tmp_path))
        assert f"standby: pid {procs[0].pid} starting\n" in shown + "\n", shown
    finally:
        for p in procs:  # a stand-in does not answer EOF by exiting as a standby does
            p.kill()
            p.wait()
        spares.stop()
        for so in socks:
            so.close()
    assert supervisor_process.standby_status(tmp_path) is None  # stopped: its record is gone


def _att(node: Node) -> attach_state.Attachment:
    att = attach_state.load_state(control.state_path(node.state_dir))
    assert att is not None
    return att


def _status(ctl: str) -> dict:
    """The daemon's own report (its control socket, as `duvm status` asks it)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(ctl)
        s.sendall(b'{"cmd": "status"}\n')
        buf = b""
        while not buf.endswith(b"\n"):
            buf += s.recv(65536)
    return json.loads(buf)


def test_a_standby_serves_the_slab_map_the_daemon_saved_last(node: Node) -> None:
    """Catches a standby that serves the slab map it read when it started: the daemon dropped
    a dead memserver's copies since (and saved the map as a new file), and the standby would
    still count them as live replicas (no repair, a degraded device reported healthy, reads
    sent to a dead memserver first). Also catches a takeover refused because one memserver
    of two is down although every slab has its other copy (seen: the whole device then failed
    at the end of the kernel's hold)."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.write(0, _pattern(0, 1))
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        state = node.state_dir / "daemon-state" / sf.STATE_FILE
        before = state.stat().st_ino
        node.memservers[1].kill()  # its copies are dropped at the next write
        node.memservers[1].wait(10)
        deadline = time.monotonic() + 60
        p = 1
        while state.stat().st_ino == before or any(
            1 in s for s in ds.StateDir(state.parent).load().sets
        ):
            assert time.monotonic() < deadline, "the daemon never dropped the dead memserver"
            kernel.write(p * PAGE, _pattern(p, 1))
            p = p % 2000 + 1
            time.sleep(0.05)
        os.kill(daemon.pid, signal.SIGKILL)
        processes.wait_pid_exit(daemon.pid, 10, daemon.start)
        kernel.reattach(_att(node), spare.take_over(timeout=30))
        spare.handed()
        assert kernel.read(0, PAGE) == _pattern(0, 1)
        # (its control socket keeps the standby's name: only the supervisor renames it)
        store = _status(node.socket + ".ctl.standby")["store"]
        assert store["degraded_slabs"] == SIZE // PAGE // 256, store  # every slab: 1 of 2
    finally:
        spare.kill()
        kernel.close()


class _DirEvents:
    """What happens to the names in one directory (inotify: opens, creations, deletions,
    renames; not writes into files already open), as the kernel reports it, whoever does it."""

    MASK = 0x20 | 0x100 | 0x200 | 0x40 | 0x80  # IN_OPEN, CREATE, DELETE, MOVED_FROM, MOVED_TO
    HEADER = struct.Struct("iIII")

    def __init__(self, directory: Path) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(directory), self.MASK) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {directory}")

    def take(self) -> list[str]:
        names: list[str] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return names
            at = 0
            while at < len(buf):
                _wd, mask, _cookie, size = self.HEADER.unpack_from(buf, at)
                at += self.HEADER.size
                names.append(f"{mask:#x} {buf[at : at + size].rstrip(bytes(1)).decode() or '.'}")
                at += size

    def close(self) -> None:
        os.close(self.fd)


def test_a_takeover_touches_no_name_on_run_until_the_device_has_its_connection(
    node: Node,
) -> None:
    """Catches a standby whose event loop binds, renames or opens a file on /run before the
    device is handed its connection: another task may hold a lock there while it waits for the
    device this very loop serves. Seen in a QEMU guest (kernel stacks): the standby's log
    writer waited for a swap-in holding its log's inode lock, the supervisor's rename of that
    log waited on it holding the directory's lock, and the new daemon's event loop waited in
    its own rename of its socket for that: nothing served the swap-in, and the kernel's request
    timer cut the new connection 60 s later."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.write(0, _pattern(0, 1))
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    try:
        _ready(spare)
        att = _att(node)
        events = _DirEvents(node.state_dir)
        os.kill(daemon.pid, signal.SIGKILL)
        processes.wait_pid_exit(daemon.pid, 10, daemon.start)
        events.take()  # the dead daemon's own
        path = spare.take_over(timeout=30)
        kernel.reattach(att, path)
        assert kernel.read(0, PAGE) == _pattern(0, 1)
        during = events.take()
        spare.handed()
        time.sleep(0.5)
        assert during == [], during
        events.close()
    finally:
        spare.kill()
        kernel.close()


def test_a_connection_the_device_drops_is_handed_again(node: Node) -> None:
    """Catches a takeover that trusts NBD_CMD_RECONFIGURE's answer. The 6.1 driver takes a new
    connection only in place of one it has marked dead, and answers success when it drops it
    (no dead one yet: its receive worker had not run, the supervisor and the standby being
    realtime). Seen in the QEMU guest (384:95:sequential:dkill25, 2 of 10 runs): the standby
    served, the device had no connection to it, and every request waited for the 60 s
    dead-connection timeout. `resume.adopt` asks the standby whether a client holds the
    connection (``check``) and hands another until one is held."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.write(0, _pattern(0, 1))
    spare = standby_process.Standby.spawn(node.state_dir, daemon)
    lock = resume.resume_lock(node.state_dir)
    try:
        _ready(spare)
        os.kill(daemon.pid, signal.SIGKILL)
        processes.wait_pid_exit(daemon.pid, 10, daemon.start)
        kernel.drops = 2
        info, _ = resume.adopt(node.state_dir, (_att(node), daemon), spare, lock, kernel.reattach)
        assert (kernel.given, kernel.drops, info.pid) == (3, 0, spare.pid)
        assert kernel.read(0, PAGE) == _pattern(0, 1)  # on the one connection kept
        assert kernel.reconnects == 1
    finally:
        spare.kill()
        kernel.close()
        lock.close()


def test_a_connection_the_kernel_cuts_after_a_takeover_is_handed_again(node: Node) -> None:
    """Catches a supervisor that takes a takeover for done once the device kept the standby's
    connection. The driver's receive worker of the dead daemon's connection marks its slot
    dead when it ends, whatever socket the slot holds by then. Seen in the QEMU guest
    (384:95:sequential:dkill25, host loaded, 3 of 23 runs): a send had marked the slot dead,
    the standby's connection took it, and the old worker, kept off the CPU by the realtime
    supervisor and standby, ended 68 ms later and cut it; every request then waited for the
    60 s dead-connection timeout while the new daemon idled. The driver reports the cut
    (NBD_CMD_LINK_DEAD); the supervisor hands the device a new connection
    (`duvm.node.lifecycle.linkmend`), and only for its own device's report."""
    daemon = node.start_daemon()
    kernel = KernelStandIn(node.socket)
    kernel.hold_s = 20  # far beyond a mending; a test that fails need not wait 60 s
    kernel.write(0, _pattern(0, 1))
    reports, heard = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    family = 0x1D
    log: list[str] = []
    errors: list[BaseException] = []

    def events() -> None:
        try:
            _wait_said(log, "standby pid", "ready")
            os.kill(daemon.pid, signal.SIGKILL)
            assert kernel.read(0, PAGE) == _pattern(0, 1)  # the standby serves
            _wait_said(log, "took over")
            other = nbdnetlink.nla_u32(nbdnetlink.NBD_ATTR_INDEX, 3)  # another device's
            reports.send(nbdnetlink.genl_message(family, nbdnetlink.NBD_CMD_LINK_DEAD, other, 0))
            deadline = time.monotonic() + 10
            while select.select([heard], [], [], 0)[0]:  # until the supervisor has read it
                assert time.monotonic() < deadline, "the supervisor never read its reports"
                time.sleep(0.01)
            time.sleep(20 * linkmend.SETTLE_S)  # a handing for it would have come by now
            kernel.cut(reports, family)
            kernel.write(PAGE, _pattern(1, 2))  # held, then sent on the connection handed
            assert kernel.read(0, 2 * PAGE) == _pattern(0, 1) + _pattern(1, 2)
            _wait_said(log, "connection dead while daemon pid", "handed it a new one")
        except BaseException as exc:  # judged in the main thread
            errors.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=events, daemon=True)
    t.start()
    rc = supervise.watch(
        node.state_dir,
        say=log.append,
        resume_fn=lambda *a, **k: errors.append(AssertionError("a new daemon was started")),
        give_up=lambda att, why: errors.append(AssertionError(why)),
        reattach=kernel.reattach,
        make_room=lambda need_kib, say: contextlib.nullcontext(),
        link_events=lambda say: nbdnetlink.LinkDeadEvents(heard, family),
    )
    t.join(30)
    kernel.close()
    reports.close()
    assert not errors, (errors, log)
    new = control.load_daemon(node.state_dir)
    assert rc == 0 and new is not None and new.pid != daemon.pid, log
    # one connection at the takeover, one for the cut; none for the other device's report
    assert (kernel.given, kernel.reconnects) == (2, 2), log
    assert heard.fileno() == -1  # the supervisor closed its reports socket
