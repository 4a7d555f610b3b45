"""Runs inside the QEMU test guest (imported by guest_check.py): a crash the supervisor must
answer without a standby, by forking itself into a new daemon (D52).

Theory of operation: after the workload, while the supervisor watches, its standby is
SIGKILLed; once the supervisor has seen it end (it removes its standby record, and waits
`RETRY_S` before starting another), the daemon is SIGKILLed too, as a second crash before
the next standby is ready would. A direct read of one block of the device, sent once the
daemon is dead, measures how soon the new daemon serves; the facts say whether it is a fork
of the supervisor (its parent, its log's first line) and whether its command line reads as a
resumed daemon's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from guest_cut import timed_read  # beside this script


def _words(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def _dead(pid: int) -> bool:
    """Gone, or a zombie (one read of /proc/PID/stat)."""
    from duvm.base.procstat import stat_fields

    fields = stat_fields(pid)
    return fields is None or fields[0] in ("Z", "X")


def _parent(pid: int) -> int | None:
    from duvm.base.procstat import stat_fields

    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def _until(what, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fork_check(state_dir: str, device: str = "/dev/nbd0", wait_s: float = 30.0) -> dict[str, Any]:
    """End the standby, then the daemon; read the device; the facts for the host's test."""
    from duvm.node.lifecycle import control, supervisor_process

    state = Path(state_dir)
    daemon = control.load_daemon(state)
    supervisor = supervisor_process.load(state)
    if daemon is None or supervisor is None:
        return {"error": "no daemon or no supervisor recorded"}
    out: dict[str, Any] = {"old_pid": daemon.pid, "supervisor_pid": supervisor["pid"]}
    standby = supervisor_process.standby_status(state) or {}
    out["standby_pid"] = spare = standby.get("pid")
    if spare:
        os.kill(spare, signal.SIGKILL)
        # the supervisor removes the record of a standby it saw end
        out["standby_forgotten"] = _until(
            lambda: (supervisor_process.standby_status(state) or {}).get("pid") != spare, 10
        )
    t = time.monotonic()
    os.kill(daemon.pid, signal.SIGKILL)
    # the read waits for the death: sent before it, the dying daemon could still answer it
    _until(lambda: _dead(daemon.pid), wait_s)
    out["dead_after_s"] = round(time.monotonic() - t, 3)
    out["served_after_s"], out["read_error"] = timed_read(device, 8192, wait_s)

    def replaced() -> bool:
        new = control.load_daemon(state)
        return new is not None and new.pid != daemon.pid and control.daemon_alive(new)

    out["replaced"] = _until(replaced, wait_s)
    new = control.load_daemon(state)
    if new is not None and new.pid != daemon.pid:
        out["new_pid"] = new.pid
        out["new_parent"] = _parent(new.pid)
        out["new_words"] = _words(new.pid)
        try:
            out["new_log"] = Path(new.log).read_text(errors="replace")[:3000]
        except OSError as exc:
            out["new_log"] = f"unreadable: {exc}"
    out["supervisor_log"] = (state / "supervisor.log").read_text(errors="replace")[-2000:]
    return out
