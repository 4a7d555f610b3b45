"""`duvm daemon --trace FILE`: one line per NBD request, for finding where time goes.

Why: averages hide the shape of a swap workload. Timestamps per request show which reads
wait for a memserver, how many writes are in flight when the next arrives, and how long the
daemon sits idle between requests while the kernel, the frontend and the program work
(`benchmarks/nbd_trace.py` summarises a file). Each line is written when the request's reply
is queued:

    ARRIVAL_NS DONE_NS COMMAND OFFSET LENGTH ERRNO

ARRIVAL_NS is when the daemon decoded the request, DONE_NS when its reply was queued, both
from `time.perf_counter_ns` (CLOCK_MONOTONIC); COMMAND is read, write, flush, trim or
write_zeroes; ERRNO is 0 for success. Lines go through a 1 MiB buffer, written out when it
fills and when the daemon stops: a daemon killed by SIGKILL loses the last buffer. Writing a
line costs about 1.5 µs of the daemon's CPU per request (timeit, development VM).
"""

from __future__ import annotations

from typing import IO

from duvm.wire.nbdconst import CMD_NAMES

FORMAT = "duvm-nbd-trace 1"  # the first line of a trace starts with "# " and this
COMMANDS = {cmd: name.lower() for cmd, name in CMD_NAMES.items()}


class RequestTrace:
    """An open trace file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self._f: IO[str] = open(path, "w", buffering=1 << 20)  # noqa: SIM115 (closed by close())
        self._f.write(f"# {FORMAT}: arrival_ns done_ns command offset length errno\n")

    def record(self, cmd: int, offset: int, length: int, t0: int, t1: int, err: int) -> None:
        self._f.write(f"{t0} {t1} {COMMANDS.get(cmd, cmd)} {offset} {length} {err}\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
