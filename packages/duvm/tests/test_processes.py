"""Telling our helper processes apart from whatever later holds their PID
(duvm.node.attach.processes): the kernel hands a reaped process's PID to the next process that needs
one, so a PID alone names no process for long."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from duvm.node.attach import processes
from duvm.node.lifecycle import control, supervisor_process

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def _spawn_on_pid(pid: int, cmd: list[str]) -> subprocess.Popen[bytes] | None:
    """Start `cmd` as process `pid` (the kernel gives the next fork ns_last_pid + 1; another
    fork on the machine can take it first, so a few tries). None when it never landed."""
    for _ in range(50):
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(cmd)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.skipif(
    os.geteuid() != 0 or not NS_LAST_PID.exists(),
    reason="forcing a PID's reuse writes /proc/sys/kernel/ns_last_pid (root)",
)
def test_a_reaped_childs_pid_given_to_a_live_process_reads_alive(tmp_path: Path) -> None:
    """Catches a cache of our children that outlives their reaping: a start path reaped its
    failed child with Popen.poll(), the entry stayed, and once the kernel reused the PID
    pid_alive answered from the stale entry that the live process was dead (CI failed on it:
    `duvm enable --resume` ran although a daemon still did, and a long-lived supervisor could
    start a second daemon onto the same device)."""
    child = processes.spawn_detached([sys.executable, "-c", "pass"], tmp_path / "child.log")
    born = processes.start_time(child.pid)
    while child.poll() is None:  # reaped by its Popen, as the start paths do
        time.sleep(0.01)
    reused = _spawn_on_pid(child.pid, ["sleep", "60"])
    if reused is None:
        pytest.skip(f"pid {child.pid} was taken by other forks 50 times in a row")
    try:
        assert processes.pid_alive(child.pid)  # the live `sleep` is alive...
        assert born is not None and processes.start_time(child.pid) != born
        assert not processes.pid_alive(child.pid, born)  # ...but it is not our child
    finally:
        reused.kill()
        reused.wait()
    assert not processes.pid_alive(child.pid)


def _stand_in(*args: str) -> subprocess.Popen[bytes]:
    """A process whose command line reads like duvm's own (`python -c ... duvm.cli daemon`)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])


def test_a_record_names_its_process_by_pid_and_start_time(tmp_path: Path) -> None:
    """Catches identity by PID and command line alone: a recycled PID that now runs another
    duvm daemon (or supervisor) was taken for the recorded one, so `duvm disable` or
    `duvm supervise` would signal or wait for a process that is not theirs."""
    proc = _stand_in("duvm.cli", "daemon")
    try:
        start = processes.start_time(proc.pid)
        assert start is not None
        assert processes.duvm_runs(proc.pid, "daemon", start)
        assert not processes.duvm_runs(proc.pid, "daemon", start - 1)  # a later process
        assert not processes.duvm_runs(proc.pid, "supervise", start)  # another program
        assert processes.pid_runs(proc.pid, "duvm.cli", start)
        assert not processes.pid_runs(proc.pid, "duvm.cli", start + 1)
        assert processes.duvm_runs(proc.pid, "daemon")  # a record from before start times
        info = control.DaemonInfo(proc.pid, "s", [], 1, 1, "l", 0.0, start=start)
        assert control.daemon_alive(info)
        info.start = start - 1
        assert not control.daemon_alive(info)
        # a signal meant for the recorded process never reaches a later one on its pid
        assert not processes.send_signal(proc.pid, signal.SIGKILL, start - 1)
        assert proc.poll() is None
        assert processes.send_signal(proc.pid, signal.SIGKILL, start)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert not processes.pid_alive(proc.pid, start)


def test_a_supervisor_record_is_checked_by_start_time(tmp_path: Path) -> None:
    proc = _stand_in("duvm.cli", "supervise")
    try:
        start = processes.start_time(proc.pid)
        assert start is not None
        path = supervisor_process.supervisor_path(tmp_path)
        for recorded, alive in ((start, True), (start - 1, False), (None, True)):
            start_json = "null" if recorded is None else recorded
            path.write_text(f'{{"pid": {proc.pid}, "start": {start_json}}}')
            assert supervisor_process.alive(supervisor_process.load(tmp_path)) is alive
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_is_not_alive_and_a_gone_pid_has_no_start_time() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while "Z" not in Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[-1][:3]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not processes.pid_alive(proc.pid)  # exited, not yet reaped by its parent (us)
    assert processes.wait_pid_exit(proc.pid, 1)
    proc.wait()
    assert processes.start_time(2**22 + 1) is None  # above any pid_max: never a process


def test_a_process_still_inside_execve_is_read_again(monkeypatch) -> None:
    """Catches a command line read once: right after Popen returns, a child can still be
    inside execve with an empty /proc/PID/cmdline (the kernel releases a vfork parent before
    it sets the new command line). `duvm_runs` then said a supervisor that had just started
    was not running (a fresh-clone CI run failed on it under load)."""
    proc = _stand_in("duvm.cli", "supervise")
    try:
        start = processes.start_time(proc.pid)
        real = Path.read_bytes
        empty = [2]  # the first two reads see the execve in progress

        def read_bytes(self: Path) -> bytes:
            if self.name == "cmdline" and empty[0]:
                empty[0] -= 1
                return b""
            return real(self)

        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        assert processes.duvm_runs(proc.pid, "supervise", start)
        assert empty[0] == 0
    finally:
        proc.kill()
        proc.wait()
    # a process that is gone is not waited for
    t0 = time.monotonic()
    assert not processes.duvm_runs(proc.pid, "supervise")
    assert time.monotonic() - t0 < processes.CMDLINE_WAIT_S


def test_reap_collects_an_ended_forked_child_and_ignores_anything_else() -> None:
    """Catches a supervisor that leaves each forked daemon it outlives as a zombie: `reap`
    (what `supervise` calls when its daemon died) must collect the exit status of an ended
    child, and do nothing, without raising, for a live child or a pid that is not its child."""
    pid = os.fork()
    if pid == 0:  # the child: ends at once, as a SIGKILLed daemon would
        os._exit(0)
    deadline = time.monotonic() + 30
    while "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1][:3]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    processes.reap(pid)
    assert not Path(f"/proc/{pid}").exists()  # collected: no zombie left
    processes.reap(pid)  # no longer a child: nothing happens
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        processes.reap(live.pid)  # a live child is not waited for
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()
    processes.reap(1)  # init: never our child
