"""Real `duvm` processes for tests: started as a user would (`python -m duvm.cli ...`), each in
its own session with its output in a log file, and stopped with SIGTERM (SIGKILL if it does
not go within the timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start(
    args: list[str],
    ready: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> subprocess.Popen:
    """`duvm ARGS`, once `ready` appears in its log; stopped and AssertionError otherwise."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "duvm.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env if env is not None else dict(os.environ),
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise AssertionError(f"duvm {args[0]} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after `timeout` s; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
