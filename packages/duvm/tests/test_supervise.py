"""`duvm supervise`: the watcher that resumes a crashed daemon.

Real processes stand in for the daemon (a sleeping Python whose command line reads like
`duvm.cli daemon`, so the PID checks accept it) and are SIGKILLed; the resume itself needs a
kernel nbd device, which this machine lacks, so here `resume_fn` is a stand-in that starts a
new stand-in daemon and records it, as `duvm.resume.resume` does. The real resume under the
real supervisor is tested in the QEMU guest (test_kernel_nbd_qemu.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from duvm import attach, control, supervise

STAND_IN = "import time; time.sleep(120)"


class Daemons:
    """Stand-in daemons started by this test, all ended at teardown."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> int:
        p = subprocess.Popen([sys.executable, "-c", STAND_IN, "duvm.cli", "daemon"])
        self.procs.append(p)
        info = control.DaemonInfo(p.pid, str(self.state_dir / "nbd.sock"), ["127.0.0.1:1"],
                                  1 << 20, 1, str(self.state_dir / "daemon.log"), time.time(),
                                  "client", ["--state-dir", str(self.state_dir / "ds")])
        control.daemon_path(self.state_dir).write_text(json.dumps(asdict(info)))
        return p.pid

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def node(tmp_path: Path):
    att = attach.Attachment(socket=str(tmp_path / "nbd.sock"), method=attach.METHOD_KERNEL,
                            device="/dev/nbd7", nbd_device="/dev/nbd7", nbd_netlink=True)
    attach.save_state(control.state_path(tmp_path), att)
    d = Daemons(tmp_path)
    yield d
    d.close()


def _later(delay: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), fn()), daemon=True)
    t.start()
    return t


def test_a_killed_daemon_is_resumed_and_the_new_one_watched(node: Daemons) -> None:
    first = node.start()
    resumed: list[int] = []
    log: list[str] = []

    def resume_fn(state_dir: Path) -> None:
        assert not control.daemon_alive(control.load_daemon(state_dir))  # only after a death
        resumed.append(node.start())
        if len(resumed) == 1:  # the second daemon dies too, later
            _later(0.3, lambda: node.kill(resumed[0]))
        else:  # then duvm is disabled: the state goes and the supervisor is told to stop
            def disable() -> None:
                control.state_path(node.state_dir).unlink()
                os.kill(os.getpid(), signal.SIGTERM)
            _later(0.3, disable)

    _later(0.3, lambda: node.kill(first))
    before = signal.getsignal(signal.SIGTERM)
    assert supervise.watch(node.state_dir, resume_fn=resume_fn, say=log.append) == 0
    assert len(resumed) == 2 and control.load_daemon(node.state_dir).pid == resumed[1]
    assert [m for m in log if m.startswith("watching daemon pid")] == [
        f"watching daemon pid {p} serving /dev/nbd7" for p in (first, *resumed)]
    assert log[-1] == "stopped"
    # the process's own signal handling is back; the last stand-in still runs (not ours to end)
    assert signal.getsignal(signal.SIGTERM) is before
    assert node.procs[-1].poll() is None


def test_a_failing_resume_is_retried_then_given_up(node: Daemons,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "RETRY_DELAYS", (0.01, 0.02))
    node.kill(node.start())
    calls: list[float] = []

    def resume_fn(state_dir: Path) -> None:
        calls.append(time.monotonic())
        raise control.ControlError("a memserver is unreachable")

    log: list[str] = []
    assert supervise.watch(node.state_dir, resume_fn=resume_fn, say=log.append) == 1
    assert len(calls) == 3  # the first try and one per delay
    assert log.count("resume failed: a memserver is unreachable") == 3
    assert log[-1] == "could not resume the daemon: giving up"


def test_a_daemon_that_keeps_dying_is_not_restarted_forever(
        node: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "MAX_RESTARTS", 2)
    node.kill(node.start())

    def resume_fn(state_dir: Path) -> None:
        node.kill(node.start())  # crashes again at once

    log: list[str] = []
    assert supervise.watch(node.state_dir, resume_fn=resume_fn, say=log.append) == 1
    assert sum(m.startswith("resumed:") for m in log) == 2
    assert "giving up" in log[-1]


def test_a_resume_done_by_hand_meanwhile_is_taken_as_done(
        node: Daemons, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervise, "RETRY_DELAYS", (0.05,))
    first = node.start()
    by_hand: list[int] = []

    def resume_fn(state_dir: Path) -> None:
        by_hand.append(node.start())  # `duvm enable --resume` won the lock first
        _later(0.2, lambda: (control.state_path(state_dir).unlink(),
                             os.kill(os.getpid(), signal.SIGTERM)))
        raise control.ControlError(f"the daemon (pid {by_hand[0]}) still runs")

    _later(0.2, lambda: node.kill(first))
    log: list[str] = []
    assert supervise.watch(node.state_dir, resume_fn=resume_fn, say=log.append) == 0
    assert f"daemon pid {by_hand[0]} already serves it (resumed by hand)" in log


@pytest.mark.parametrize("method", [attach.METHOD_FUSE, "kernel-ioctl"])
def test_nothing_to_supervise_where_a_device_cannot_take_a_new_daemon(
        tmp_path: Path, method: str) -> None:
    att = attach.Attachment(socket="s", method=attach.METHOD_KERNEL if method != attach.METHOD_FUSE
                            else method, device="/dev/x", nbd_netlink=False)
    assert not supervise.wanted(att, ["--state-dir", "d"])
    att.method, att.nbd_netlink = attach.METHOD_KERNEL, True
    assert supervise.wanted(att, ["--state-dir", "d"])
    assert not supervise.wanted(att, [])  # a daemon without its state cannot be resumed


@pytest.mark.skipif(os.geteuid() != 0, reason="duvm supervise runs as root")
def test_the_supervisor_process_starts_and_stops(node: Daemons) -> None:
    daemon = node.start()
    pid = supervise.start(node.state_dir)
    info = supervise.load(node.state_dir)
    assert info is not None and info["pid"] == pid
    deadline = time.monotonic() + 30
    log = Path(info["log"])
    while "watching daemon pid" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and attach.pid_alive(pid), log.read_text()
        time.sleep(0.05)
    assert supervise.alive(info)
    st = control.status(node.state_dir)
    assert st["supervisor"] == {"pid": pid, "running": True, "log": str(log)}
    supervise.stop(node.state_dir)
    assert not attach.pid_alive(pid) and supervise.load(node.state_dir) is None
    assert "stopped" in log.read_text()
    assert attach.pid_alive(daemon)  # stopping the supervisor leaves the daemon alone
