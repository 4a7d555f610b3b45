"""Logging for the swap path's processes that can neither stall them nor flood their log.

Theory of operation
-------------------
The daemon's and the supervisor's logs are files on /run, a tmpfs: its pages can be swapped out
like any other memory, to the very device the daemon serves. A write to such a file whose last
page is out must first swap it in, and a daemon blocked in that write cannot answer the
swap-in: the node hangs (a supervisor blocked in it resumes a dead daemon too late). So log records
never touch the file from the event loop. `start_background` hands them to a bounded queue
(stdlib `logging.handlers.QueueHandler`) drained by one writer thread (`QueueListener`): a
write that waits for a swap-in blocks only that thread while the event loop serves the swap-in.
When the queue is full, records are dropped and counted, and the count is logged when there is
room again; the log never grows memory without bound.

`QuietLog` keeps a failure from writing one line per page or slab: the first event of a kind
(say, copies dropped on one memserver) is logged at once, repeats are counted, and `flush`
(called periodically) logs one line per kind with the count. One memserver lost on a 512 MiB
device used to log 341 near-identical lines; now it logs one, then one summary.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import queue
import sys
import threading
import time
from typing import TextIO

QUEUE_RECORDS = 1000


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """QueueHandler that never blocks and never raises: a full queue drops the record."""

    def __init__(self, q: queue.Queue) -> None:
        super().__init__(q)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        if self.dropped:
            note = logging.makeLogRecord(
                {
                    "name": record.name,
                    "levelno": logging.WARNING,
                    "levelname": "WARNING",
                    "msg": f"{self.dropped} log record(s) dropped (the log writer fell behind)",
                }
            )
            try:
                self.queue.put_nowait(note)
            except queue.Full:
                self.dropped += 1
                return
            self.dropped = 0
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Writer(logging.handlers.QueueListener):
    """The writer thread; `stop` waits a bounded time for what is queued to be written."""

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread  # type: ignore[attr-defined]
        if thread is None:
            return
        try:
            self.queue.put(self._sentinel, timeout=timeout)  # type: ignore[attr-defined]
        except queue.Full:
            return  # the writer is stuck (its file waits for memory): exit without it
        thread.join(timeout)
        self._thread = None


def start_background(
    level: int, fmt: str, stream: TextIO | None = None, capacity: int = QUEUE_RECORDS
) -> logging.handlers.QueueListener:
    """Route the root logger through a bounded queue to a writer thread on `stream`
    (default stderr). Call `stop()` on the result at exit to write what is queued."""
    q: queue.Queue = queue.Queue(capacity)
    out = logging.StreamHandler(stream if stream is not None else sys.stderr)
    out.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_DroppingQueueHandler(q))
    root.setLevel(level)
    listener = _Writer(q, out, respect_handler_level=False)
    listener.start()
    return listener


class Aside:
    """Lines a swap path process prints outside its log (the daemon's "serving" line), written
    in order by a thread of their own: on a file on /run a write can wait for a page out on the
    very device the caller serves (a restarted daemon's event loop stopped in such a write and
    never answered its handshake)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> None:
        """Queue the line `text`; it is written to the stream (default stdout) after those
        queued before it."""
        self._lines.put(text)
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain, name="duvm-aside", daemon=True)
            self._thread.start()

    def _drain(self) -> None:
        while True:
            text = self._lines.get()
            out = self._stream if self._stream is not None else sys.stdout
            with contextlib.suppress(OSError, ValueError):  # closed, or no stream at all
                out.write(text + "\n")
                out.flush()


class QuietLog:
    """One line for the first event of each kind, then one count per `flush`."""

    def __init__(self, logger: logging.Logger, clock=time.monotonic) -> None:
        self.log = logger
        self.clock = clock
        self._repeats: dict[object, list] = {}  # kind -> [count, level, first text]
        self._since = clock()

    def event(self, kind: object, level: int, msg: str, *args: object) -> bool:
        """Log `msg % args` if this is the first event of `kind` since the last flush, else
        count it. True when it was logged."""
        seen = self._repeats.get(kind)
        if seen is not None:
            seen[0] += 1
            return False
        text = msg % args if args else msg
        self._repeats[kind] = [0, level, text]
        self.log.log(level, "%s", text)
        return True

    def flush(self) -> int:
        """Log how many repeats each kind had since the last flush and start over. Returns the
        number of lines logged."""
        lines = 0
        took = self.clock() - self._since
        for count, level, text in self._repeats.values():
            if count:
                self.log.log(level, "%s (and %d more like it in %.0f s)", text, count, took)
                lines += 1
        self._repeats.clear()
        self._since = self.clock()
        return lines
