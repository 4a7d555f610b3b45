"""The long-lived helper processes a node starts (the daemon, its supervisor, the nbd holder,
nbdfuse): started in their own session so they outlive `duvm enable`, and told apart from a
recycled PID before anyone waits for or signals them.

A PID alone names no process for long: once a process is reaped the kernel hands its PID to
the next fork. A process is therefore named by its PID and its start time (/proc/PID/stat,
clock ticks after boot), which no later process shares. Nothing here caches what a PID was:
each answer is read from /proc when asked, and a child is reaped only by its own Popen."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# re-exported: callers name a helper process through this module
from duvm.base.procstat import pid_alive as pid_alive
from duvm.base.procstat import start_time as start_time


def spawn_detached(
    cmd: list[str],
    log: Path,
    preexec: Callable[[], object] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start a long-lived helper in its own session, so it outlives `duvm enable`; `preexec`
    runs in the child before the program starts, `pass_fds` stay open in it. Record
    `start_time(proc.pid)` beside the pid: it is what later tells this process from a
    recycled PID."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=preexec,
            pass_fds=pass_fds,
        )


def wait_pid_exit(pid: int, timeout: float, start: int | None = None) -> bool:
    """Wait up to `timeout` s for `pid` (the process that started at `start`) to end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid, start):
            return True
        time.sleep(0.05)
    return not pid_alive(pid, start)


def send_signal(pid: int, sig: int, start: int | None = None) -> bool:
    """Signal `pid` if it is still the process that started at `start`; False when it is not
    (gone, or a later process on its pid). Sent through a pidfd (Linux 5.3+), which names the
    process checked, so a pid recycled between the check and the signal is never hit."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (OSError, AttributeError):  # no pidfd here: check, then signal the number
        if not pid_alive(pid, start):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            return True
        return False
    try:
        if not pid_alive(pid, start):
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is an ended child of this process (a daemon the
    supervisor forked); nothing otherwise."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


CMDLINE_WAIT_S = 0.5


def _cmdline(pid: int) -> bytes:
    """/proc/PID/cmdline. A process still inside execve reads as empty for a moment (the
    kernel lets a vfork parent, such as Popen, go on before it sets the new command line), so
    an empty answer from a live process is read again for up to CMDLINE_WAIT_S."""
    deadline = time.monotonic() + CMDLINE_WAIT_S
    while True:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
        if cmd or not pid_alive(pid) or time.monotonic() > deadline:
            return cmd
        time.sleep(0.002)


def pid_runs(pid: int | None, name: str, start: int | None = None) -> bool:
    """`pid` is alive and is still the program we started: its start time is `start` (when
    recorded; records from before start times were kept fall back to the name alone)."""
    return pid is not None and pid_alive(pid, start) and name.encode() in _cmdline(pid)


def duvm_runs(pid: int, subcommand: str, start: int | None = None) -> bool:
    """`pid` is alive and is `duvm SUBCOMMAND` (python -m duvm.cli), started at `start`."""
    if not pid_alive(pid, start):
        return False
    cmd = _cmdline(pid).split(b"\0")
    return b"duvm.cli" in cmd and subcommand.encode() in cmd
