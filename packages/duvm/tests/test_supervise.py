"""`duvm supervise`: the watcher that resumes a crashed daemon.

Real processes stand in for the daemon (a sleeping Python whose command line reads like
`duvm.cli daemon`, so the PID checks accept it) and are SIGKILLed. Resuming for real needs a
kernel nbd device, which this machine lacks: the loop tests pass a `resume_fn` that starts a
new stand-in and records it, as `duvm.node.lifecycle.resume.resume` does; the process tests run the
real `duvm supervise` with the real resume, which here can only fail (its daemon finds no
memserver), to check retries and stopping. The whole path, resume included, runs under the
real supervisor in the QEMU guest (test_kernel_nbd_qemu.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from duvm.base import pressure
from duvm.node.attach import attach_kernel, attach_state, processes
from duvm.node.lifecycle import control, resume, room, supervise, supervisor_process

STAND_IN = "import time; time.sleep(120)"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="duvm supervise and resume run as root")


class Node:
    """A state directory with a kernel-nbd-over-netlink attachment and stand-in daemons."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gave_up: list[str] = []
        att = attach_state.Attachment(
            socket=str(state_dir / "nbd.sock"),
            method=attach_state.METHOD_KERNEL,
            device="/dev/nbd7",
            nbd_device="/dev/nbd7",
            nbd_netlink=True,
            dead_conn_timeout_s=60,
        )
        attach_state.save_state(control.state_path(state_dir), att)

    def start(self) -> int:
        p = subprocess.Popen([sys.executable, "-c", STAND_IN, "duvm.cli", "daemon"])
        self.procs.append(p)
        info = control.DaemonInfo(
            p.pid,
            str(self.state_dir / "nbd.sock"),
            ["127.0.0.1:1"],
            1 << 20,
            1,
            str(self.state_dir / "daemon.log"),
            time.time(),
            "client",
            ["--state-dir", str(self.state_dir / "ds")],
        )
        control.daemon_path(self.state_dir).write_text(json.dumps(asdict(info)))
        return p.pid

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def disable(self, last: int) -> None:
        """What `duvm disable` leaves for a supervisor that missed its SIGTERM: no state, and
        the daemon gone."""
        control.state_path(self.state_dir).unlink()
        self.kill(last)

    def watch(self, **kw: object) -> int:
        """The supervisor's loop without a standby (this file tests the restarts; the standby
        is test_standby.py's), its give-ups recorded in `gave_up` instead of failing a
        device's requests, and no room made for a restart unless a test asks (the real room
        would end the largest program on this machine), nor the kernel's reports of dead
        connections heard (test_standby.py's; this machine has no nbd driver)."""
        kw.setdefault("make_room", lambda need_kib, say: contextlib.nullcontext())
        kw.setdefault("link_events", lambda say: None)
        return supervise.watch(
            self.state_dir,
            spares=None,
            give_up=lambda att, why: self.gave_up.append(why),
            **kw,  # type: ignore[arg-type]
        )

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def node(tmp_path: Path):
    n = Node(tmp_path)
    yield n
    n.close()


def _later(delay: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()), daemon=True)
    t.start()
    return t


def _when_watched(log: list[str], pid: int, fn) -> threading.Thread:
    """Runs `fn` once the supervisor says it watches `pid` (a fixed delay would race its
    first read on a loaded machine, and the daemon would die unwatched)."""

    def wait_then_run() -> None:
        deadline = time.monotonic() + 30
        while f"watching daemon pid {pid} serving /dev/nbd7" not in log:
            if time.monotonic() > deadline:
                break  # then the assertions say what was not watched
            time.sleep(0.01)
        fn()

    t = threading.Thread(target=wait_then_run, daemon=True)
    t.start()
    return t


def test_a_killed_daemon_is_resumed_and_the_new_one_watched(node: Node) -> None:
    first = node.start()
    resumed: list[int] = []
    timeouts: list[float] = []
    log: list[str] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        timeouts.append(timeout)
        resumed.append(node.start())
        if len(resumed) == 1:  # the second daemon dies too, once watched
            _when_watched(log, resumed[0], lambda: node.kill(resumed[0]))
        else:
            _when_watched(log, resumed[1], lambda: node.disable(resumed[1]))

    _when_watched(log, first, lambda: node.kill(first))
    before = signal.getsignal(signal.SIGTERM)
    assert node.watch(resume_fn=resume_fn, say=log.append) == 0
    assert len(resumed) == 2
    assert [m for m in log if m.startswith("watching daemon pid")] == [
        f"watching daemon pid {p} serving /dev/nbd7" for p in (first, *resumed)
    ]
    # each resume may take at most what is left of the kernel's 60 s hold
    assert all(55 < t <= 60 for t in timeouts), timeouts
    assert log[-1] == "duvm was disabled: supervisor exits"
    assert signal.getsignal(signal.SIGTERM) is before  # the process's handling is back


def test_a_failing_resume_is_retried_then_given_up(node: Node) -> None:
    node.kill(node.start())
    calls: list[float] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        calls.append(time.monotonic())
        raise control.ControlError("a memserver is unreachable")

    log: list[str] = []
    assert (
        node.watch(
            resume_fn=resume_fn,
            say=log.append,
            policy=supervise.RestartPolicy(retry_delays=(0.01, 0.02)),
        )
        == 1
    )
    assert len(calls) == 3  # the first try and one per delay
    assert log.count("resume failed: a memserver is unreachable") == 3
    assert log[-1].startswith("giving up: could not resume the daemon; /dev/nbd7's held requests")
    assert node.gave_up == ["could not resume the daemon"]  # failed now, not after the hold
    # and `duvm status` says why nothing serves the device any more
    (node.state_dir / supervisor_process.SUPERVISOR_FILE).write_text('{"pid": 1, "log": "l"}')
    st = control.status(node.state_dir)
    assert st["supervisor"]["gave_up"].endswith(" could not resume the daemon"), st
    assert "; gave up at " in control.format_status(st)


def test_tries_stop_at_the_kernels_dead_connection_timeout(node: Node) -> None:
    att = attach_state.load_state(control.state_path(node.state_dir))
    assert att is not None
    att.dead_conn_timeout_s = 2  # 5 or 6 tries 0.4 s apart: 2 even after a 1.5 s stall
    attach_state.save_state(control.state_path(node.state_dir), att)
    node.kill(node.start())
    calls: list[float] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        calls.append(timeout)
        raise control.ControlError("no memserver answers")

    log: list[str] = []
    t = time.monotonic()
    assert (
        node.watch(
            resume_fn=resume_fn,
            say=log.append,
            policy=supervise.RestartPolicy(retry_delays=(0.4,) * 20),
        )
        == 1
    )
    assert time.monotonic() - t < 30 and 2 <= len(calls) <= 6, calls  # not 20 tries
    assert "within the kernel's 2 s" in log[-1] and len(node.gave_up) == 1


def test_a_daemon_that_keeps_dying_is_not_restarted_forever(node: Node) -> None:
    node.kill(node.start())

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        node.kill(node.start())  # crashes again at once

    log: list[str] = []
    assert (
        node.watch(
            resume_fn=resume_fn,
            say=log.append,
            policy=supervise.RestartPolicy(max_restarts=2),
        )
        == 1
    )
    assert sum(m.startswith("resumed:") for m in log) == 2
    assert "after 2 restarts" in log[-1] and "giving up" in log[-1]
    assert len(node.gave_up) == 1


def test_a_resume_done_by_hand_meanwhile_is_taken_as_done(node: Node) -> None:
    first = node.start()
    by_hand: list[int] = []
    log: list[str] = []

    def disable_once_seen() -> None:
        # not after a fixed delay: on a loaded machine the supervisor's next look (0.05 s
        # after the failed try) may come later, find no daemon and give up
        deadline = time.monotonic() + 30
        while not any("resumed by hand" in m for m in log) and time.monotonic() < deadline:
            time.sleep(0.01)
        node.disable(by_hand[0])

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        by_hand.append(node.start())  # `duvm enable --resume` won the lock first
        if len(by_hand) == 1:
            threading.Thread(target=disable_once_seen, daemon=True).start()
        raise control.ControlError(f"the daemon (pid {by_hand[0]}) still runs")

    _when_watched(log, first, lambda: node.kill(first))
    assert (
        node.watch(
            resume_fn=resume_fn,
            say=log.append,
            policy=supervise.RestartPolicy(retry_delays=(0.05,)),
        )
        == 0
    )
    assert f"daemon pid {by_hand[0]} already serves it (resumed by hand)" in log


def test_no_pidfd_here_still_notices_the_death(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    first = node.start()
    resumed: list[int] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        resumed.append(node.start())
        _later(0.2, lambda: node.disable(resumed[0]))

    _later(0.2, lambda: node.kill(first))
    t = time.monotonic()
    assert node.watch(resume_fn=resume_fn, say=lambda m: None) == 0
    assert len(resumed) == 1 and time.monotonic() - t < 10


def test_only_a_device_that_can_take_a_new_daemon_is_supervised() -> None:
    att = attach_state.Attachment(socket="s", method=attach_state.METHOD_FUSE, device="/dev/loop3")
    assert not supervisor_process.wanted(att, ["--state-dir", "d"])  # nbdfuse+loop
    att.method = attach_state.METHOD_KERNEL
    assert not supervisor_process.wanted(att, ["--state-dir", "d"])  # kernel nbd via ioctls
    att.nbd_netlink = True
    assert supervisor_process.wanted(att, ["--state-dir", "d"])
    assert not supervisor_process.wanted(att, [])  # a daemon without its state cannot be resumed


def _wait_log(log: Path, text: str, pid: int, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        said = log.read_text() if log.exists() else ""
        if text in said:
            return said
        assert time.monotonic() < deadline and processes.pid_alive(pid), said
        time.sleep(0.05)


@root_only
def test_the_supervisor_process_starts_reports_and_stops(node: Node) -> None:
    daemon = node.start()
    pid, problem = supervisor_process.start(node.state_dir)
    try:
        assert problem is None  # start() returns once it watches the daemon
        info = supervisor_process.load(node.state_dir)
        assert info is not None and info["pid"] == pid and supervisor_process.alive(info)
        assert f"watching daemon pid {daemon}" in Path(info["log"]).read_text()
        # on the swap path like the daemon: realtime by default, so the daemon it restarts
        # inherits the class from its first instruction (duvm.base.pressure)
        assert os.sched_getscheduler(pid) == os.SCHED_RR
        st = control.status(node.state_dir)
        assert st["supervisor"] == {
            "pid": pid,
            "running": True,
            "log": info["log"],
            "gave_up": None,
        }
        assert f"supervisor: pid {pid} running" in control.format_status(st)
    finally:
        supervisor_process.stop(node.state_dir)
    assert not processes.pid_alive(pid) and supervisor_process.load(node.state_dir) is None
    assert Path(info["log"]).read_text().rstrip().endswith("stopped")
    assert processes.pid_alive(daemon)  # stopping the supervisor leaves the daemon alone


@root_only
def test_a_stop_during_the_retries_ends_them(node: Node) -> None:
    """The real resume fails here (its daemon finds no memserver at 127.0.0.1:1): the
    supervisor waits between tries, and SIGTERM then ends it at once, without another try."""
    first = node.start()
    pid, problem = supervisor_process.start(node.state_dir)
    log = node.state_dir / "supervisor.log"
    try:
        assert problem is None
        node.kill(first)
        _wait_log(log, "resume failed:", pid)
        tries = log.read_text().count("resume failed:")
        # the real resume ran: it started `duvm daemon --resume`, whose failure the log shows
        assert "duvm enable --resume at" in (node.state_dir / "daemon.log").read_text()
        t = time.monotonic()
    finally:
        supervisor_process.stop(node.state_dir)
    said = log.read_text()
    assert time.monotonic() - t < 30 and not processes.pid_alive(pid)
    assert said.rstrip().endswith("stopped") and "giving up" not in said
    assert said.count("resume failed:") <= tries + 1  # at most the try under way finished
    # the daemons the tries started are gone with them (resume kills its own on failure)
    assert _processes_with(f"{node.state_dir}/ds".encode()) == []


def _processes_with(text: bytes) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if text in (d / "cmdline").read_bytes() and processes.pid_alive(int(d.name)):
                    found.append(int(d.name))
    return found


@root_only
def test_resume_waits_for_one_under_way_then_finds_the_daemon_running(node: Node) -> None:
    node.start()
    result: list[BaseException | None] = []
    with open(node.state_dir / resume.RESUME_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another resume holds the lock
        t = threading.Thread(target=lambda: result.append(_catch(resume.resume, node.state_dir)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not result  # it waits its turn
    t.join(10)
    assert isinstance(result[0], control.ControlError) and "still runs" in str(result[0])


def _catch(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as exc:  # the assertion above judges it
        return exc
    return None


@root_only
def test_disable_keeps_the_supervisor_through_swapoff_and_refuses_with_a_dead_daemon(
    node: Node,
) -> None:
    seen: list[bool] = []

    def detach(path: Path, force: bool = False) -> attach_state.Attachment | None:
        """attach.detach's part here: swapoff is when the supervisor must still watch."""
        seen.append(supervisor_process.alive(supervisor_process.load(node.state_dir)))
        att = attach_state.load_state(path)
        path.unlink()
        return att

    daemon = node.start()
    pid, _ = supervisor_process.start(node.state_dir)
    try:
        # a dead daemon and nobody resuming it: disable refuses instead of losing the pages
        supervisor_process.stop(node.state_dir)
        node.kill(daemon)
        processes.wait_pid_exit(daemon, 10)
        with pytest.raises(control.ControlError, match="enable --resume` first"):
            control.disable(node.state_dir, detach=detach)
        assert seen == [] and control.state_path(node.state_dir).exists()  # nothing undone
        daemon = node.start()
        pid, _ = supervisor_process.start(node.state_dir)
        assert control.disable(node.state_dir, detach=detach) is True
        assert seen == [True]  # the supervisor watched through the swapoff
        assert not processes.pid_alive(pid) and not processes.pid_alive(daemon)
        assert "resuming" not in (node.state_dir / "supervisor.log").read_text()
    finally:
        supervisor_process.stop(node.state_dir)


def test_enable_tells_how_starting_the_supervisor_went(capsys: pytest.CaptureFixture[str]) -> None:
    from duvm.node.lifecycle.enable import say_supervisor

    say_supervisor(4321, None, "watches the daemon again")
    say_supervisor(None, "no pidfd support", "unused")
    say_supervisor(None, None, "unused")  # not wanted (no kernel nbd): nothing to say
    out, err = capsys.readouterr()
    assert out == "duvm enable: supervisor pid 4321 watches the daemon again\n"
    assert err == (
        "duvm enable: warning: no pidfd support; nothing will restart a crashed "
        "daemon (`duvm enable --resume` does it by hand)\n"
    )


@root_only
def test_the_supervisor_follows_the_daemons_no_realtime_opt_out(node: Node) -> None:
    node.start()
    info = json.loads(control.daemon_path(node.state_dir).read_text())
    info["daemon_args"].append("--no-realtime")
    control.daemon_path(node.state_dir).write_text(json.dumps(info))
    pid, problem = supervisor_process.start(node.state_dir)
    try:
        assert problem is None
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    finally:
        supervisor_process.stop(node.state_dir)


class _Opens:
    """The names of the files opened in one directory, as the kernel reports them (inotify
    IN_OPEN): every reader is seen, whichever function it reads through."""

    IN_OPEN = 0x20
    HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), self.IN_OPEN) < 0:
            os.close(self.fd)
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")

    def take(self) -> list[str]:
        """The opens reported since the last take ("." for the directory itself)."""
        names: list[str] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return names
            at = 0
            while at < len(buf):
                _wd, _mask, _cookie, size = self.HEADER.unpack_from(buf, at)
                at += self.HEADER.size
                names.append(buf[at : at + size].rstrip(b"\0").decode() or ".")
                at += size

    def close(self) -> None:
        os.close(self.fd)


def test_no_record_is_read_between_the_death_and_the_resume(node: Node) -> None:
    """Catches a supervisor that rereads state.json or daemon.json after the daemon died: on a
    node under pressure their pages may be on the device whose server is dead, and the read
    waits out the kernel's dead-connection timeout, so the resume comes too late (seen in CI:
    swap I/O errors, then a kernel panic). The kernel reports every open in the state
    directory (inotify), whichever function reads it."""
    first = node.start()
    try:
        opens = _Opens(node.state_dir)
    except OSError as exc:
        pytest.skip(f"no inotify here to see the reads: {exc}")
    dead = threading.Event()
    read_while_alive: list[str] = []
    records = {"state.json", "daemon.json"}
    reads_while_dead: list[str] = []
    handed: list[object] = []
    resumed: list[int] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        if dead.is_set():
            reads_while_dead.extend(opens.take())
        handed.append(known)
        resumed.append(node.start())
        dead.clear()  # a daemon serves again
        _later(0.2, lambda: node.disable(resumed[0]))

    def kill() -> None:
        # only once the supervisor has read both records: on a loaded machine its first
        # reads may come after 0.2 s, and would then count as reads of the dead
        deadline = time.monotonic() + 30
        while not records <= set(read_while_alive) and time.monotonic() < deadline:
            read_while_alive.extend(opens.take())
            time.sleep(0.01)
        dead.set()
        node.kill(first)

    _later(0.2, kill)
    try:
        assert node.watch(resume_fn=resume_fn, say=lambda m: None) == 0
    finally:
        opens.close()
    assert records <= set(read_while_alive)  # the opens are seen
    assert reads_while_dead == []
    att, daemon = handed[0]  # type: ignore[misc]
    assert daemon.pid == first and att.device == "/dev/nbd7"


def test_giving_up_fails_only_the_requests_of_a_device_still_ours() -> None:
    """Catches a supervisor that, giving up, disconnects an nbd device that is no longer its
    own: the number is reused once free, and another user's device would lose its
    connection. The device's connection pid is stood in for (no nbd driver here)."""
    att = attach_state.Attachment(
        socket="s",
        method=attach_state.METHOD_KERNEL,
        device="/dev/nbd7",
        nbd_device="/dev/nbd7",
        nbd_netlink=True,
        extra={"nbd_pid": "131"},
    )
    cut: list[str] = []
    for now, want in (("131", ["/dev/nbd7"]), ("4242", []), (None, [])):
        cut.clear()
        done = supervise.fail_held_io(
            att, "gave up", connection_pid=lambda dev, now=now: now, disconnect=cut.append
        )
        assert cut == want and done is bool(want), now
    att.extra.pop("nbd_pid")  # a record from before the pid was kept: never ours for sure
    ours = supervise.fail_held_io(att, "x", connection_pid=lambda d: "131", disconnect=cut.append)
    assert not ours and cut == []


class KernelTimer:
    """The kernel's side of `attach_kernel.RequestTimer`, as drivers/block/nbd.c (6.1) does it:
    NBD_ATTR_TIMEOUT 0 sets the block queue's io_timeout to 30 s, any other value to itself;
    a sysfs tree under tmp_path holds the device's pid and io_timeout."""

    def __init__(self, root: Path, device: str = "nbd7", pid: str = "4242") -> None:
        self.root, self.calls = root, []
        self.waits: list[tuple[float, str]] = []  # (seconds, io_timeout meanwhile)
        self.queue = root / "block" / device / "queue"
        self.queue.mkdir(parents=True)
        (root / "block" / device / "pid").write_text(pid + "\n")
        self.io_timeout.write_text("60000\n")
        self.inflight.write_text("0 0\n")

    @property
    def io_timeout(self) -> Path:
        return self.queue / "io_timeout"

    def set_timeout(self, device: str, timeout_s: int) -> None:
        self.calls.append((device, timeout_s))
        self.io_timeout.write_text(f"{(timeout_s or 30) * 1000}\n")

    def wait(self, seconds: float) -> None:  # each poll sees one request in flight complete
        self.waits.append((seconds, self.io_timeout.read_text().strip()))
        left = max(0, int(self.inflight.read_text().split()[0]) - 1)
        self.inflight.write_text(f"{left} 0\n")

    @property
    def inflight(self) -> Path:
        return self.queue.parent / "inflight"

    def timer(self) -> attach_kernel.RequestTimer:
        return attach_kernel.RequestTimer(
            set_timeout=self.set_timeout, sys_root=self.root, wait=self.wait
        )


def _ours(node: Node, pid: str = "4242") -> None:
    att = attach_state.load_state(control.state_path(node.state_dir))
    assert att is not None
    att.extra["nbd_pid"] = pid
    attach_state.save_state(control.state_path(node.state_dir), att)


def test_while_watched_a_dead_connections_requests_are_resent_within_a_second(
    node: Node, tmp_path: Path
) -> None:
    """Catches a supervisor that leaves the driver's 60 s request timer on (requests in flight
    at a crash then wait a minute after the standby took over, issue 48), that sets the block
    queue's timer before the driver's timeout (the kernel then resets it to 30 s), or that
    leaves the driver's timeout at 0 when it exits (nothing would end a dead connection's
    requests then)."""
    kernel = KernelTimer(tmp_path / "sys")
    _ours(node)
    first = node.start()
    log: list[str] = []
    _when_watched(log, first, lambda: node.disable(first))
    assert node.watch(say=log.append, timer=kernel.timer()) == 0
    # armed once a daemon served: the driver never cuts a connection, the queue looks each second
    assert kernel.calls == [("/dev/nbd7", 0), ("/dev/nbd7", 60)]
    every = (
        f"requests in flight on /dev/nbd7 are looked at every {attach_kernel.REQUEUE_CHECK_MS} ms"
    )
    assert every in log[0]
    # and restored on the way out
    assert kernel.io_timeout.read_text().strip() == "60000"
    assert log[-1] == "/dev/nbd7's request timeout is the kernel's again"


def _netlink_att() -> attach_state.Attachment:
    """/dev/nbd7 connected over netlink by the connection of pid 4242 (`KernelTimer`'s)."""
    return attach_state.Attachment(
        socket="s",
        method=attach_state.METHOD_KERNEL,
        device="/dev/nbd7",
        nbd_device="/dev/nbd7",
        nbd_netlink=True,
        extra={"nbd_pid": "4242"},
    )


def test_the_timer_is_set_in_the_order_the_kernel_needs(tmp_path: Path) -> None:
    """Catches a restore that sets the driver's timeout while requests started under the
    quick requeue's 250 ms timer are still in flight: the next expiry then marks the live
    connection dead, and with nobody to reconnect the held reads fail a minute later (the
    QEMU guest's 1 GiB RDMA run panicked so when its supervisor was SIGKILLed). The queue's
    timer goes to the full timeout first, the requests in flight drain, then the driver's."""
    kernel = KernelTimer(tmp_path)
    att = _netlink_att()
    assert kernel.timer().quick_requeue(att) is None
    assert kernel.io_timeout.read_text().strip() == str(attach_kernel.REQUEUE_CHECK_MS)
    kernel.inflight.write_text("2 0\n")  # two requests started under the 250 ms timer
    assert kernel.timer().restore(att, 60) is None
    assert kernel.calls == [("/dev/nbd7", 0), ("/dev/nbd7", 60)]
    # the driver's timeout only once they drained, the queue's timer at 60 s meanwhile
    assert kernel.waits == [(0.01, "60000"), (0.01, "60000")]
    # after a crash there is no live connection to spare: at once
    assert kernel.timer().quick_requeue(att) is None
    assert kernel.timer().restore(att, 60, live=False) is None
    assert len(kernel.waits) == 2 and kernel.calls[-1] == ("/dev/nbd7", 60)


@pytest.mark.parametrize(
    "change",
    [
        {"extra": {"nbd_pid": "999"}},  # the number was reused by someone else's connection
        {"extra": {}},  # no connection recorded at attach
        {"nbd_netlink": False},  # an ioctl holder: no reconfigure
        {"method": attach_state.METHOD_FUSE},
    ],
)
def test_a_device_that_is_not_ours_is_left_alone(tmp_path: Path, change: dict) -> None:
    """Catches a timer set on a device number that another connection took over since."""
    kernel = KernelTimer(tmp_path)
    att = _netlink_att()
    for k, v in change.items():
        setattr(att, k, v)
    assert kernel.timer().quick_requeue(att) is not None
    assert kernel.timer().restore(att, 60) is not None
    assert kernel.calls == [] and kernel.io_timeout.read_text().strip() == "60000"


def test_the_kernels_timer_is_back_before_a_restart_the_slow_way(
    node: Node, tmp_path: Path
) -> None:
    """Catches a supervisor that starts a new daemon (no standby ready) with the driver's timer
    still off: that start can stall on the node's memory (seen over RDMA in the QEMU guest:
    kthreadd and kswapd blocked for good), and then nothing would ever end the requests in
    flight at the crash. With the driver's timeout back first they wait for a new connection
    and fail after the dead-connection timeout whatever happens to the supervisor."""
    kernel = KernelTimer(tmp_path / "sys")
    _ours(node)
    first = node.start()
    log: list[str] = []
    seen_at_resume: list[list] = []

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        seen_at_resume.append(list(kernel.calls))
        new = node.start()
        _when_watched(log, new, lambda: node.disable(new))

    _when_watched(log, first, lambda: node.kill(first))
    assert node.watch(resume_fn=resume_fn, say=log.append, timer=kernel.timer()) == 0
    # armed, back to the kernel's before the resume, armed again once the new daemon serves
    assert seen_at_resume == [[("/dev/nbd7", 0), ("/dev/nbd7", 60)]]
    assert kernel.calls == [
        ("/dev/nbd7", 0),
        ("/dev/nbd7", 60),
        ("/dev/nbd7", 0),
        ("/dev/nbd7", 60),
    ]


def test_a_restart_the_slow_way_short_of_memory_gets_room_by_ending_a_program(
    node: Node,
) -> None:
    """Catches a supervisor whose restart the slow way (no standby ready) waits out the
    kernel's 60 s on a node with no memory to give a new daemon: the held swap reads then fail
    and whoever waited on them dies, init included (a kernel panic in the 256 MiB RDMA guest).
    The restart runs inside `make_room`, told what the dead daemon held of its own (measured
    while it lived); the room is asked only while no daemon serves."""
    first = node.start()
    settled, last = 0, None  # the stand-in done starting: its memory no longer grows
    deadline = time.monotonic() + 10
    while settled < 5 and time.monotonic() < deadline:
        now = pressure.rss_kib(first, "RssAnon")
        settled, last = (settled + 1 if now == last else 0), now
        time.sleep(0.05)
    expected: list[int] = []  # read when the supervisor has measured it too, just before the kill
    log: list[str] = []
    kills: list[float] = []
    needs: list[int] = []
    served_at: list[float] = []

    def make_room(need_kib: int, say):
        needs.append(need_kib)
        return room.making_room(
            need_kib,
            say,
            after_s=0.1,
            every_s=0.1,
            available=lambda: 1024,
            pick=lambda: room.Victim(4242, "hog", 99_999),
            kill=lambda pid: kills.append(time.monotonic()),
        )

    def resume_fn(state_dir: Path, timeout: float, known: object = None) -> None:
        time.sleep(0.5)  # a new daemon stalled for memory
        new = node.start()
        served_at.append(time.monotonic())
        _when_watched(log, new, lambda: _later(0.5, lambda: node.disable(new)))

    def measure_then_kill() -> None:
        expected.append((pressure.rss_kib(first, "RssAnon") or 0) + (8 << 10))
        node.kill(first)

    _when_watched(log, first, measure_then_kill)
    assert node.watch(resume_fn=resume_fn, say=log.append, make_room=make_room) == 0
    assert len(needs) == 1 and abs(needs[0] - expected[0]) < 2048, (needs, expected)
    assert 1 <= len(kills) <= 3, kills
    assert all(t < served_at[0] for t in kills)  # none once a daemon serves again
    asked = [m for m in log if "to make room" in m]
    assert len(asked) == len(kills)
    assert asked[0].startswith(f"no daemon serves yet and 1024 KiB are available of the {needs[0]}")
    assert "ended pid 4242 (hog, 99999 KiB resident)" in asked[0]
