"""The long-lived helper processes a node starts (the daemon, its supervisor, the nbd holder,
nbdfuse): started in their own session so they outlive `duvm enable`, and told apart from a
recycled PID before anyone waits for or signals them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

# Children this process started and has not reaped: polling their Popen reaps them cleanly.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def spawn_detached(
    cmd: list[str], log: Path, preexec: Callable[[], object] | None = None
) -> subprocess.Popen[bytes]:
    """Start a long-lived helper in its own session, so it outlives `duvm enable`; `preexec`
    runs in the child before the program starts."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=preexec,
        )
    _CHILDREN[proc.pid] = proc
    return proc


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; reaps it first if it is our own exited child."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is None:
            return True
        del _CHILDREN[pid]
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_pid_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def pid_runs(pid: int | None, name: str) -> bool:
    """`pid` is alive and is still the program we started (guards against PID reuse)."""
    if pid is None or not pid_alive(pid):
        return False
    try:
        return name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def duvm_runs(pid: int, subcommand: str) -> bool:
    """`pid` is alive and is `duvm SUBCOMMAND` (python -m duvm.cli), not a recycled PID."""
    if not pid_alive(pid):
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"duvm.cli" in cmd and subcommand.encode() in cmd
