"""The request-timer guard: what a duvm process that outlives the supervisor owes the device.

Theory of operation
-------------------
While `duvm supervise` watches a kernel nbd device it sets the driver's request timeout to 0
(`duvm.node.attach.attach_kernel.RequestTimer`): the driver then never cuts a live daemon's
connection, and a request whose connection was replaced is requeued at the queue's next check.
But with timeout 0 nothing in the kernel ends the requests of a dead connection that nobody
replaces: a supervisor SIGKILLed together with its daemon would leave them waiting for ever.
So the supervisor hands a `TimerGuard` to each daemon process it owns (the daemon over its
control socket, a standby over its socket pair): whoever sees the supervisor end first puts the
driver's timeout back (`restore`), and the requests of a later crash fail after the kernel's
timers instead of hanging the node. Only the device connected by the connection recorded at
attach is touched (``/sys/block/nbdN/pid``), since the number is reused once it is free.

A guard crosses a socket as a JSON object; `from_json` refuses anything malformed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from duvm.wire import nbdnetlink

MAX_TIMEOUT_S = 86400  # a request timeout longer than a day is no timer
IDLE_WAIT_S = 30.0  # at most this long for the requests in flight to drain


def set_back(
    device: str,
    timeout_s: int,
    *,
    set_timeout: Callable[[str, int], None] = nbdnetlink.set_timeout,
    sys_root: Path = Path("/sys"),
    wait: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    idle_wait_s: float = IDLE_WAIT_S,
) -> None:
    """Put `device`'s request timeout back to `timeout_s` without cutting the live connection
    (raises OSError when the kernel refuses). Blocks until the device's requests in flight
    have drained once (at most `idle_wait_s`): never call it on the loop that answers them.

    A request started under the quick requeue's short queue timer (``queue/io_timeout``, 250
    ms) keeps that timeout for life: the block layer re-arms it with its own, not the queue's.
    With the driver's timeout 0 its expiry only re-arms it; with the driver's timeout back, the
    same expiry marks the connection dead ("Connection timed out, retrying"), and with nobody
    to reconnect the held requests fail a minute later (in the QEMU guest a supervisor
    SIGKILLed during trims panicked the node so). So the queue's timer goes to the full
    timeout first (every request started from then on gets it), and the driver's timeout
    follows once no request started before is left: when ``inflight`` reads 0 once. A device
    under constant load may never read 0; after `idle_wait_s` a request started before is one
    held that long, which a live daemon does not do, and ending such a request is what the
    driver's timer is put back for."""
    name = Path(device).name
    knob = sys_root / "block" / name / "queue" / "io_timeout"
    try:
        before_ms = int(knob.read_text())
    except (OSError, ValueError):
        before_ms = None
    if before_ms is not None and before_ms < timeout_s * 1000:
        knob.write_text(str(timeout_s * 1000))
        deadline = clock() + idle_wait_s
        while _in_flight(sys_root / "block" / name / "inflight") and clock() < deadline:
            wait(0.01)
    set_timeout(device, timeout_s)


def _in_flight(path: Path) -> bool:
    """Whether the device has requests in flight (``inflight``: reads and writes); False when
    it cannot be read."""
    try:
        return any(int(n) for n in path.read_text().split())
    except (OSError, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class TimerGuard:
    """Restore `device`'s request timeout to `timeout_s` once the supervisor (`supervisor_pid`,
    started at `supervisor_start` in clock ticks after boot, None: unknown) has ended, if the
    device is still connected by `nbd_pid`'s connection."""

    device: str
    nbd_pid: str
    timeout_s: int
    supervisor_pid: int
    supervisor_start: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: object) -> TimerGuard:
        """The guard `obj` describes; ValueError saying what is wrong otherwise."""
        if not isinstance(obj, dict):
            raise ValueError("a timer guard is a JSON object")
        device, conn = obj.get("device"), obj.get("nbd_pid")
        timeout, pid, start = (
            obj.get(k) for k in ("timeout_s", "supervisor_pid", "supervisor_start")
        )
        if not isinstance(device, str):
            raise ValueError("'device' must be a string")
        try:
            nbdnetlink.device_index(device)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if device != f"/dev/{Path(device).name}":
            raise ValueError("'device' must be /dev/nbdN")
        if not isinstance(conn, str) or not conn.isdigit() or len(conn) > 10:
            raise ValueError("'nbd_pid' must be a process id as a string of digits")
        if not _int(timeout) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"'timeout_s' must be an integer from 1 to {MAX_TIMEOUT_S}")
        if not _int(pid) or pid <= 0:
            raise ValueError("'supervisor_pid' must be a positive integer")
        if start is not None and (not _int(start) or start < 0):
            raise ValueError("'supervisor_start' must be a non-negative integer or null")
        return cls(device, conn, timeout, pid, start)

    def restore(
        self,
        *,
        set_timeout: Callable[[str, int], None] = nbdnetlink.set_timeout,
        sys_root: Path = Path("/sys"),
        wait: Callable[[float], None] = time.sleep,
    ) -> str | None:
        """Set the driver's request timeout back (`set_back`: the connection is live, so this
        waits for its requests in flight to drain once); None when done, else why not."""
        if nbd_pid(self.device, sys_root) != self.nbd_pid:
            return f"{self.device} is not connected by duvm's connection any more"
        try:
            set_back(
                self.device, self.timeout_s, set_timeout=set_timeout, sys_root=sys_root, wait=wait
            )
        except OSError as exc:
            return f"{exc.strerror or exc}"
        return None


def nbd_pid(device: str, sys_root: Path = Path("/sys")) -> str | None:
    """/sys/block/nbdN/pid: set when the device is connected, kept across a reconfigure, so
    it tells our connection from someone else's on the same device number. `sys_root` is
    where sysfs is mounted."""
    try:
        return (sys_root / "block" / Path(device).name / "pid").read_text().strip() or None
    except OSError:
        return None


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
