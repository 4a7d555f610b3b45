"""The request-timer guard (`duvm.wire.nbdguard`, `duvm.node.daemon.pidwatch.GuardKeeper`):
while `duvm supervise` watches a kernel nbd device the driver's request timeout is 0, which a
SIGKILLed supervisor can no longer put back; the daemon and the standby it handed the guard to
do. Real processes stand in for the supervisor (SIGKILLed), real control sockets and a real
`duvm daemon` carry the guard; the netlink request itself is faked (no nbd module on this
machine: the QEMU guest test runs it against the kernel), and so is /sys in the unit tests of
`TimerGuard.restore`. The standby's part is in test_standby.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from duvm.base import control_socket
from duvm.node.attach import attach_state, processes
from duvm.node.daemon.daemon import ControlStatus
from duvm.node.daemon.pidwatch import GuardKeeper
from duvm.node.daemon.status import daemon_status
from duvm.node.lifecycle import control
from duvm.node.lifecycle.supervise import _Timing
from duvm.store.memory_store import MemoryStore
from duvm.wire import nbdguard
from duvm.wire.nbdguard import TimerGuard

# the real `duvm daemon` fixture of the swap-device tests
from test_control_swap_device import daemon  # noqa: F401

MiB = 1 << 20


@pytest.fixture
def supervisor() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for `duvm supervise`: the test SIGKILLs it."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _guard(proc: subprocess.Popen[bytes], **kw: object) -> TimerGuard:
    g = TimerGuard("/dev/nbd5", "4242", 60, proc.pid, processes.start_time(proc.pid))
    return replace(g, **kw)  # type: ignore[arg-type]


def _sys(tmp_path: Path, pid: str | None) -> Path:
    """A stand-in /sys with /sys/block/nbd5/pid holding `pid` (None: no such file)."""
    d = tmp_path / "sys" / "block" / "nbd5"
    d.mkdir(parents=True, exist_ok=True)
    if pid is not None:
        (d / "pid").write_text(pid + "\n")
    return tmp_path / "sys"


BAD = [
    ("not an object", "JSON object"),
    ({"device": 5}, "'device' must be a string"),
    ({"device": "/dev/sda"}, "not an nbd device"),
    ({"device": "/tmp/nbd5"}, "must be /dev/nbdN"),
    ({"nbd_pid": 4242}, "'nbd_pid'"),
    ({"nbd_pid": "42x"}, "'nbd_pid'"),
    ({"timeout_s": 0}, "'timeout_s'"),
    ({"timeout_s": True}, "'timeout_s'"),
    ({"timeout_s": 10**9}, "'timeout_s'"),
    ({"timeout_s": "60"}, "'timeout_s'"),
    ({"supervisor_pid": 0}, "'supervisor_pid'"),
    ({"supervisor_pid": None}, "'supervisor_pid'"),
    ({"supervisor_start": -1}, "'supervisor_start'"),
]


def test_a_guard_crosses_a_socket_whole_and_a_malformed_one_is_refused() -> None:
    """Catches a guard that loses a field on the way (the restore would go to the wrong
    device or never fire) and one taken from a malformed request: each field checked, with
    the reason."""
    good = TimerGuard("/dev/nbd5", "4242", 60, 1234, 987654)
    assert TimerGuard.from_json(json.loads(json.dumps(good.to_json()))) == good
    assert (
        TimerGuard.from_json({**good.to_json(), "supervisor_start": None}).supervisor_start is None
    )
    for change, why in BAD:
        obj = change if not isinstance(change, dict) else {**good.to_json(), **change}
        with pytest.raises(ValueError, match=why):
            TimerGuard.from_json(obj)


def test_a_restore_touches_only_the_device_duvm_still_connects(tmp_path: Path) -> None:
    """Catches a restore that sets the timeout of a device number since reused by someone
    else (or left unconnected), and one that raises when the kernel refuses."""
    calls: list[tuple[str, int]] = []
    g = TimerGuard("/dev/nbd5", "4242", 60, 1, None)

    def fake(device: str, timeout: int) -> None:
        calls.append((device, timeout))

    assert g.restore(set_timeout=fake, sys_root=_sys(tmp_path, "4242")) is None
    assert calls == [("/dev/nbd5", 60)]
    for other in ("777", ""):
        why = g.restore(set_timeout=fake, sys_root=_sys(tmp_path, other))
        assert why is not None and "not connected by duvm's connection" in why
    (tmp_path / "sys" / "block" / "nbd5" / "pid").unlink()
    assert g.restore(set_timeout=fake, sys_root=_sys(tmp_path, None)) is not None
    assert calls == [("/dev/nbd5", 60)]

    def refused(device: str, timeout: int) -> None:
        raise OSError(1, "Operation not permitted")

    assert g.restore(set_timeout=refused, sys_root=_sys(tmp_path, "4242")) == (
        "Operation not permitted"
    )


def test_a_guard_spares_the_live_connection_when_it_restores(tmp_path: Path) -> None:
    """Catches a guard that sets the driver's timeout back while requests started under the
    quick requeue's 250 ms queue timer are in flight: a request keeps its timeout for life, so
    its next expiry under the restored driver timeout marks the live daemon's connection dead,
    and with the supervisor gone nobody reconnects (the QEMU guest's 1 GiB RDMA run, twice: the
    supervisor SIGKILLed during trims, the node panicked a minute later; a fixed 1.5 s wait did
    not help). The queue's timer goes to the full timeout first, and the driver's timeout only
    once the requests in flight have drained."""
    root = _sys(tmp_path, "4242")
    queue = root / "block" / "nbd5"
    (queue / "queue").mkdir()
    knob, inflight = queue / "queue" / "io_timeout", queue / "inflight"
    knob.write_text("252\n")
    inflight.write_text("       3        1\n")
    events: list[tuple] = []
    g = TimerGuard("/dev/nbd5", "4242", 60, 1, None)

    def fake(device: str, timeout: int) -> None:
        events.append(("set", knob.read_text().strip(), inflight.read_text().split()))

    def wait(seconds: float) -> None:  # the old requests complete one poll at a time
        events.append(("wait", knob.read_text().strip()))
        left = max(0, int(inflight.read_text().split()[0]) - 1)
        inflight.write_text(f"{left} {left}\n")

    assert g.restore(set_timeout=fake, sys_root=root, wait=wait) is None
    assert events == [("wait", "60000")] * 3 + [("set", "60000", ["0", "0"])]
    events.clear()  # a queue timer already at the full timeout: nothing to wait for
    inflight.write_text("5 5\n")
    assert g.restore(set_timeout=fake, sys_root=root, wait=wait) is None
    assert events == [("set", "60000", ["5", "5"])]
    # never drained: set after the bound, not never
    knob.write_text("252\n")
    ticks = iter(range(100))
    events.clear()
    nbdguard.set_back(
        "/dev/nbd5",
        60,
        set_timeout=fake,
        sys_root=root,
        wait=lambda s: None,
        clock=lambda: float(next(ticks)),
        idle_wait_s=5,
    )
    assert events == [("set", "60000", ["5", "5"])]


async def _until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_the_keeper_restores_once_when_its_supervisor_is_killed(supervisor) -> None:  # type: ignore[no-untyped-def]
    """Catches a keeper that never sees its supervisor die (the timer stays 0 and a later
    crash's requests wait for ever), that fires twice, or that fires for a supervisor it no
    longer holds the guard of (a replaced one, or after a clean stop)."""
    calls: list[TimerGuard] = []
    keeper = GuardKeeper(restore=lambda g: calls.append(g))  # type: ignore[func-returns-value]
    other = subprocess.Popen(["sleep", "600"])
    try:
        old = _guard(other)
        keeper.take(old)
        new = _guard(supervisor, device="/dev/nbd6")
        keeper.take(new)  # the guard replaced: the first supervisor's end means nothing now
        other.kill()
        other.wait(10)
        await asyncio.sleep(0.3)
        assert calls == [] and keeper.watching
        assert keeper.describe() == {
            "device": "/dev/nbd6",
            "supervisor_pid": supervisor.pid,
            "watching": True,
            "fired": None,
        }
        supervisor.send_signal(signal.SIGKILL)
        await _until(lambda: bool(calls))
        await asyncio.sleep(0.2)
        assert calls == [new] and keeper.fired == "restored" and not keeper.watching
    finally:
        if other.poll() is None:
            other.kill()
        other.wait(10)

    # a clean stop: the supervisor's end afterwards fires nothing
    calls.clear()
    third = subprocess.Popen(["sleep", "600"])
    keeper.take(_guard(third))
    keeper.close()
    third.kill()
    third.wait(10)
    await asyncio.sleep(0.3)
    assert calls == [] and not keeper.watching


async def test_the_same_guard_told_again_keeps_its_watch(supervisor) -> None:  # type: ignore[no-untyped-def]
    """Catches a keeper that replaces its pidfd and the loop's reader when told the guard it
    already holds (a standby that took over is told again the guard it had as a standby): the
    churn of a closed and reused descriptor right after a takeover, and a window in which the
    supervisor's end is not watched. The guard still fires once when the supervisor ends."""
    calls: list[TimerGuard] = []
    keeper = GuardKeeper(restore=lambda g: calls.append(g))  # type: ignore[func-returns-value]
    guard = _guard(supervisor)
    keeper.take(guard)
    watched = keeper._watched
    keeper.take(replace(guard))  # equal, another object
    assert keeper._watched is watched and keeper.watching
    supervisor.send_signal(signal.SIGKILL)
    await _until(lambda: bool(calls))
    await asyncio.sleep(0.2)
    assert calls == [guard] and keeper.fired == "restored"


async def test_the_keeper_restores_off_the_event_loop(supervisor) -> None:  # type: ignore[no-untyped-def]
    """Catches a keeper that runs the restore on the event loop. The restore waits until no
    request is in flight on the device (`nbdguard.set_back`), and only this loop answers
    them: on the loop it would wait out its whole bound (30 s) while every request starved.
    Here the restore waits for something only the loop does."""
    answered = threading.Event()
    started: list[bool] = []
    waited: list[bool] = []

    def restore(g: TimerGuard) -> str | None:
        started.append(True)
        waited.append(answered.wait(5))  # a request that only the loop answers
        return None

    async def loop_answers() -> None:
        while not waited:
            if started:
                answered.set()
            await asyncio.sleep(0.01)

    keeper = GuardKeeper(restore=restore)
    keeper.take(_guard(supervisor))
    answering = asyncio.ensure_future(loop_answers())
    supervisor.send_signal(signal.SIGKILL)
    await _until(lambda: bool(waited))
    await answering
    assert waited == [True], "the restore blocked the event loop"
    await _until(lambda: keeper.fired is not None)
    assert keeper.fired == "restored"


async def test_a_guard_whose_supervisor_is_gone_already_fires_at_once(supervisor) -> None:  # type: ignore[no-untyped-def]
    """Catches a keeper that waits for a supervisor that ended before the guard arrived, or
    one whose pid now belongs to another process (its start time differs)."""
    calls: list[TimerGuard] = []
    keeper = GuardKeeper(restore=lambda g: calls.append(g) or "not ours")  # type: ignore[func-returns-value]
    start = processes.start_time(supervisor.pid)
    assert start is not None
    keeper.take(_guard(supervisor, supervisor_start=start + 1))  # a recycled pid
    assert len(calls) == 1 and keeper.fired == "not ours" and not keeper.watching
    supervisor.kill()
    supervisor.wait(10)
    keeper.take(_guard(supervisor, supervisor_start=start))
    assert len(calls) == 2


async def test_a_daemon_takes_a_guard_on_its_control_socket_and_refuses_a_bad_one(
    supervisor,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Catches a control socket that drops the `timer_guard` request or takes a malformed
    one (each refused, the guard held before kept), a process without a keeper that accepts
    one, and a status that does not say the guard fired."""
    store = MemoryStore(4 * MiB)
    report = ControlStatus(lambda: daemon_status(store, None).to_json())
    calls: list[TimerGuard] = []
    report.guards = keeper = GuardKeeper(restore=lambda g: calls.append(g))  # type: ignore[func-returns-value]
    path = str(tmp_path / "d.ctl")
    srv = await control_socket.start(
        path, report, on_timer_guard=lambda obj: keeper.take(TimerGuard.from_json(obj))
    )
    bare = await control_socket.start(str(tmp_path / "m.ctl"), lambda: {"role": "memserver"})
    try:
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["timer_guard"] is None
        g = _guard(supervisor)
        await asyncio.to_thread(control_socket.tell_timer_guard, path, g.to_json())
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["timer_guard"]["supervisor_pid"] == supervisor.pid
        assert st["timer_guard"]["watching"] is True
        for change, why in BAD:
            obj = change if not isinstance(change, dict) else {**g.to_json(), **change}
            with pytest.raises(ValueError, match=why):
                await asyncio.to_thread(control_socket.tell_timer_guard, path, obj)  # type: ignore[arg-type]
        assert keeper.guard == g and keeper.watching
        with pytest.raises(ValueError, match="takes no request-timer guard"):
            await asyncio.to_thread(
                control_socket.tell_timer_guard, str(tmp_path / "m.ctl"), g.to_json()
            )
        supervisor.kill()
        await _until(lambda: bool(calls))
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["timer_guard"]["fired"] == "restored" and st["timer_guard"]["watching"] is False
        assert calls == [g]
    finally:
        srv.close()
        bare.close()
        await store.close()


def test_a_real_daemon_restores_when_its_supervisor_is_sigkilled(
    tmp_path: Path,
    daemon: control.DaemonInfo,  # noqa: F811
    supervisor: subprocess.Popen[bytes],
) -> None:
    """Catches a `duvm daemon` process whose control socket takes no guard, or that holds
    one and never watches its supervisor, and a `duvm status` that does not say so. Its
    restore runs for real: this machine has no /sys/block/nbd5, so it finds the device not
    duvm's and says so (a restore that ignored the connection check would call netlink and
    report its failure instead)."""
    ctl = control_socket.default_path(daemon.socket)
    no_node = tmp_path / "no-node.ctl"
    assert "request timer" not in control.format_status(control.status(tmp_path, no_node))
    g = _guard(supervisor)
    control_socket.tell_timer_guard(ctl, g.to_json())
    assert control_socket.query(ctl)["timer_guard"]["watching"] is True
    text = control.format_status(control.status(tmp_path, no_node))
    assert f"request timer: quick requeue while supervisor pid {supervisor.pid} watches" in text
    supervisor.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (st := control_socket.query(ctl)["timer_guard"])["fired"] is None:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    assert st["fired"] == "/dev/nbd5 is not connected by duvm's connection any more"
    # the log is written by the daemon's writer thread, after the event loop moved on
    while "supervisor pid" not in Path(daemon.log).read_text():
        assert time.monotonic() < deadline, Path(daemon.log).read_text()[-1000:]
        time.sleep(0.05)
    status = control.status(tmp_path, no_node)
    assert status["daemon"]["timer_guard"] == st
    assert (
        f"request timer: supervisor pid {supervisor.pid} ended, not restored: /dev/nbd5 is "
        "not connected" in control.format_status(status)
    )


class _Timer:
    """The driver's timer as `_Timing` sees it (the kernel part is the QEMU guest test's)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def quick_requeue(self, att: attach_state.Attachment) -> str | None:
        self.calls.append("quick")
        return None

    def restore(
        self, att: attach_state.Attachment, timeout_s: int, *, live: bool = True
    ) -> str | None:
        self.calls.append(f"restore {timeout_s}" + ("" if live else " at once"))
        return None


def _info(pid: int, sock: str) -> control.DaemonInfo:
    return control.DaemonInfo(pid, sock, [], MiB, 1, "/dev/null", 0.0, None, [], None)


def test_the_supervisor_hands_each_daemon_it_watches_the_guard_once() -> None:
    """Catches a supervisor that arms the quick requeue but hands no daemon the guard (a
    SIGKILL of both then leaves the timer 0), hands it again on every wake, forgets the
    successor of a takeover (a new pid), or keeps a guard after it restored the timer."""
    told: list[tuple[str, dict]] = []
    said: list[str] = []
    timer = _Timer()
    timing = _Timing(timer, said.append, tell=lambda p, g: told.append((p, g)))  # type: ignore[arg-type]
    att = attach_state.Attachment(
        socket="/run/duvm/nbd.sock",
        method="kernel-nbd",
        device="/dev/nbd2",
        nbd_device="/dev/nbd2",
        nbd_netlink=True,
        extra={"nbd_pid": "31"},
    )
    timing.arm(att, _info(100, "/run/duvm/nbd.sock"))
    timing.arm(att, _info(100, "/run/duvm/nbd.sock"))
    assert timer.calls == ["quick"]
    assert told == [("/run/duvm/nbd.sock.ctl", timing.guard.to_json())]  # type: ignore[union-attr]
    g = TimerGuard.from_json(told[0][1])
    assert (g.device, g.nbd_pid, g.timeout_s, g.supervisor_pid) == (
        "/dev/nbd2",
        "31",
        60,
        os.getpid(),
    )
    assert g.supervisor_start == processes.start_time(os.getpid())
    timing.arm(att, _info(200, "/run/duvm/nbd.sock"))  # the standby that took over
    assert [p for p, _ in told] == ["/run/duvm/nbd.sock.ctl"] * 2
    timing.restore()
    assert timing.guard is None and timer.calls == ["quick", "restore 60"]

    def refuses(path: str, guard: dict) -> None:
        raise OSError(111, "Connection refused")

    timing = _Timing(timer, said.append, tell=refuses)
    timing.arm(att, _info(300, "/run/duvm/nbd.sock"))
    assert any("daemon pid 300 holds no guard" in s for s in said)


def test_a_standby_socket_gets_the_guard_once_it_is_ready(tmp_path: Path) -> None:
    """Catches a supervisor whose standby never holds the guard (a SIGKILL of the supervisor
    and its daemon together then leaves nobody to restore the timer): the guard goes over
    the socket pair as one ``guard JSON`` line, once, after ``ready``."""
    from duvm.node.lifecycle import standby_process

    mine, theirs = socket.socketpair()
    mine.setblocking(False)  # as `Standby.spawn` leaves it
    proc = subprocess.Popen(["sleep", "600"])
    try:
        spare = standby_process.Standby(proc, mine, tmp_path / "s.log", 100)  # type: ignore[arg-type]
        spares = standby_process.Spares(tmp_path, lambda s: None, available=lambda: 1 << 30)
        spares.current = spare
        g = TimerGuard("/dev/nbd2", "31", 60, os.getpid(), None)
        daemon_info = _info(100, str(tmp_path / "nbd.sock"))
        spares.tend(daemon_info, g)  # not ready yet: nothing sent
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(4096)
        theirs.sendall(b"ready 1000 500\n")
        time.sleep(0.05)
        spares.tend(daemon_info, g)
        spares.tend(daemon_info, g)
        line = theirs.recv(4096)
        assert line.count(b"\n") == 1 and line.startswith(b"guard ")
        assert TimerGuard.from_json(json.loads(line[len(b"guard ") :])) == g
    finally:
        proc.kill()
        proc.wait(10)
        mine.close()
        theirs.close()
