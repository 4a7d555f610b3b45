"""A process named by its PID and its start time, read from /proc/PID/stat.

A PID alone names no process for long: once a process is reaped the kernel hands its PID to
the next fork. The start time (clock ticks after boot, field 22) is what no later process on
the same PID shares. Every answer is read from /proc when asked; nothing is cached."""

from __future__ import annotations

from pathlib import Path

_DEAD = ("Z", "X")  # a zombie (exited, not reaped) or one being reaped


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (field 3, the state, first); None
    when no process has `pid`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()  # the name may hold spaces and parentheses


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None when no process has `pid`.
    With the pid it names one process for the machine's uptime."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """True while `pid` runs (an exited, unreaped one does not). With `start` (a recorded
    `start_time`), only while `pid` is still that process and not a later one on its PID."""
    fields = stat_fields(pid)
    if fields is None or len(fields) <= 19 or fields[0] in _DEAD:
        return False
    return start is None or int(fields[19]) == start
