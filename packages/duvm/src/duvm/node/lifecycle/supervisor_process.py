"""The supervisor (`duvm supervise`) seen from outside: start it, find it, stop it, and whether
a device wants one. `duvm enable`/`disable`/`status` use these; the watcher itself is
`duvm.node.lifecycle.supervise`, which imports the daemon's control and resume code. Kept apart so
that the control layer never imports the watcher (no import cycle)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from duvm.node.attach import attach_state, processes


def _option(daemon_args: list[str], name: str) -> str | None:
    """The value of option `name` among `daemon_args` (the last one wins, as in argparse)."""
    found = None
    for i, a in enumerate(daemon_args):
        if a == name and i + 1 < len(daemon_args):
            found = daemon_args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def state_dir_arg(daemon_args: list[str]) -> Path | None:
    """The daemon's `--state-dir` among `daemon_args`."""
    found = _option(daemon_args, "--state-dir")
    return Path(found) if found is not None else None


def workers_arg(daemon_args: list[str]) -> int:
    """The daemon's `--workers` among `daemon_args` (1 when not given)."""
    found = _option(daemon_args, "--workers")
    return int(found) if found is not None and found.isdigit() else 1


def keeps_state(daemon_args: list[str]) -> bool:
    """The daemon runs with `--state-dir`, so a restarted one can serve its pages again."""
    return state_dir_arg(daemon_args) is not None


SUPERVISOR_FILE = "supervisor.json"
GAVE_UP_FILE = "supervisor-gave-up.txt"
STANDBY_FILE = "standby.json"  # written by the supervisor (`standby_process.Spares`)
STANDBY_LOGS = ("daemon-standby-1.log", "daemon-standby-2.log")  # (standby_process.spawn)


def supervisor_path(state_dir: Path) -> Path:
    return state_dir / SUPERVISOR_FILE


def wanted(att: attach_state.Attachment, daemon_args: list[str]) -> bool:
    """A restarted daemon can take this device back only on kernel nbd over netlink, and only
    if the daemon keeps its state (`--state-dir`, which `duvm enable` always gives)."""
    return att.method == attach_state.METHOD_KERNEL and att.nbd_netlink and keeps_state(daemon_args)


def start(state_dir: Path, ready_timeout: float = 30.0) -> tuple[int, str | None]:
    """Start the supervisor of `state_dir` in its own session and wait until it watches the
    daemon. Returns its pid and, when it is not watching, why (a warning for the user)."""
    log = state_dir / "supervisor.log"
    size = log.stat().st_size if log.exists() else 0
    (state_dir / GAVE_UP_FILE).unlink(missing_ok=True)  # a new supervisor: an old give-up ends
    proc = processes.spawn_detached(
        [sys.executable, "-m", "duvm.cli", "supervise", "--state-dir", str(state_dir)], log
    )
    record = {"pid": proc.pid, "start": processes.start_time(proc.pid), "log": str(log)}
    record["started"] = time.time()
    supervisor_path(state_dir).write_text(json.dumps(record) + "\n")
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(size)
            said = f.read().decode(errors="replace")
        if "watching daemon pid" in said:
            return proc.pid, None
        if proc.poll() is not None:
            return proc.pid, (
                f"the supervisor exited ({proc.returncode}): {said.strip()[-500:] or 'no output'}"
            )
        time.sleep(0.05)
    return proc.pid, f"the supervisor is not watching the daemon after {ready_timeout:.0f} s"


def load(state_dir: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(supervisor_path(state_dir).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None


def alive(info: dict[str, Any] | None) -> bool:
    return info is not None and processes.duvm_runs(info["pid"], "supervise", _start(info))


def _start(info: dict[str, Any]) -> int | None:
    """The recorded start time (None in records from before it was kept)."""
    start = info.get("start")
    return start if isinstance(start, int) else None


def stop(state_dir: Path, timeout: float = 180.0) -> None:
    """SIGTERM the supervisor and wait for it (a resume under way finishes first: up to the
    resume timeout), then forget it."""
    info = load(state_dir)
    if alive(info):
        assert info is not None
        pid, start = info["pid"], _start(info)
        processes.send_signal(pid, signal.SIGTERM, start)
        if not processes.wait_pid_exit(pid, timeout, start):
            processes.send_signal(pid, signal.SIGKILL, start)
            processes.wait_pid_exit(pid, 10, start)
    supervisor_path(state_dir).unlink(missing_ok=True)


def record_give_up(state_dir: Path, why: str) -> None:
    """Keep why the supervisor gave up, for `duvm status` (a new file: nothing to swap in)."""
    with contextlib.suppress(OSError):
        (state_dir / GAVE_UP_FILE).write_text(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {why}\n")


def status(state_dir: Path) -> dict[str, Any] | None:
    """The supervisor as `duvm status` shows it: pid, running, log, and why it gave up."""
    info = load(state_dir)
    if info is None:
        return None
    try:
        gave_up: str | None = (state_dir / GAVE_UP_FILE).read_text().strip() or None
    except OSError:
        gave_up = None
    return {"pid": info["pid"], "running": alive(info), "log": info.get("log"), "gave_up": gave_up}


def standby_path(state_dir: Path) -> Path:
    return state_dir / STANDBY_FILE


NO_STANDBY = (
    "a crash starts a new daemon (seconds, not the standby's milliseconds), and where memory "
    "is too short for one the supervisor ends the program holding the most to make room"
)


def standby_status(state_dir: Path) -> dict[str, Any] | None:
    """The supervisor's standby daemon as `duvm status` shows it: pid, running, resident KiB
    when it said it was ready, log; or ``{"pid": None, "none": why}`` when memory is too short
    for one."""
    try:
        info = json.loads(standby_path(state_dir).read_text())
        if info.get("pid") is None and isinstance(info.get("none"), str):
            return {"pid": None, "none": info["none"]}
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    start = info.get("start") if isinstance(info.get("start"), int) else None
    return {
        "pid": pid,
        "running": processes.duvm_runs(pid, "daemon", start),
        "ready": info.get("ready", True) is not False,
        "ready_kib": info.get("ready_kib"),
        "ready_anon_kib": info.get("ready_anon_kib"),
        "log": info.get("log"),
    }


def standby_line(sb: dict[str, Any]) -> str:
    """`duvm status`'s line for `standby_status`'s answer."""
    if sb["pid"] is None:
        return f"standby: none ({sb['none']}): {NO_STANDBY}"
    kib, own = sb["ready_kib"], sb.get("ready_anon_kib")
    state = "NOT RUNNING" if not sb["running"] else "ready" if sb["ready"] else "starting"
    if not isinstance(kib, int):
        return f"standby: pid {sb['pid']} {state}"
    mine = f", {own >> 10} MiB its own" if isinstance(own, int) else ""
    return f"standby: pid {sb['pid']} {state} ({kib >> 10} MiB resident{mine})"
