"""Sending a signal to the process a table row shows, and nothing else.

A row is a process as it was when sampled; by the time a user confirms, it may have exited and
its PID been reused. So the signal goes only to a process whose start time is the row's
(`create_time`, the same value psutil reports), and every refusal says why: the process is
gone, the PID now belongs to another process, the row's start time is unknown, the process
belongs to another OS (WSL: a Windows host process), or the OS did not permit it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from gputaskman.base.readings import ProcGpu

# The signals offered, the default first.
CHOICES: tuple[tuple[str, int], ...] = (
    ("TERM", int(signal.SIGTERM)),
    ("INT", int(signal.SIGINT)),
    # signal.SIGKILL: POSIX only (Windows has none; TERM stands in)
    ("KILL", int(getattr(signal, "SIGKILL", signal.SIGTERM))),
)


@dataclass(frozen=True)
class SignalResult:
    sent: bool
    message: str


def send(row: ProcGpu, name: str) -> SignalResult:
    """Send signal `name` (one of `CHOICES`) to the process of `row`, if it is still that one."""
    signum = dict(CHOICES)[name]
    what = f"{row.name or 'process'} ({row.pid})"
    if row.host is not None:
        return SignalResult(False, f"{what} is a {row.host} process: not signalled from here")
    if row.create_time is None:
        return SignalResult(
            False,
            f"{what}: its start time is unknown, so it cannot be told "
            "apart from a later process with the same PID",
        )
    import psutil  # here: only k needs it, and its import is ~40 ms of the TUI's start-up

    try:
        proc = psutil.Process(row.pid)
        if proc.create_time() != row.create_time:
            return SignalResult(False, f"{what} has exited; PID {row.pid} is another process now")
        proc.send_signal(signum)
    except psutil.NoSuchProcess:
        return SignalResult(False, f"{what} has exited")
    except psutil.AccessDenied:
        return SignalResult(False, f"SIG{name} to {what} not permitted (another user's process)")
    except OSError as e:
        return SignalResult(False, f"SIG{name} to {what} failed: {e.strerror or e}")
    return SignalResult(True, f"sent SIG{name} to {what}")
