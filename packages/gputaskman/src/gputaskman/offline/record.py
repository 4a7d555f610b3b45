"""``gputaskman record FILE``: append one ``--json`` object per sample to a JSON Lines file.

Theory of operation
-------------------
Each sample is taken the way the TUI takes it: one `Collector` kept for the whole run,
with the TUI's process-scan budget (`collector.SCAN_BUDGET`; never ``scan_budget=None``,
no priming sample, no probe of our own), so recording costs what watching costs. The line
written is exactly ``report.to_json_dict(snapshot, system, selected_gpu)`` serialised
compactly: unknown stays ``null`` and nothing is added or summed here.

Durability: the whole line (newline included) is built in memory first and handed to the
kernel with ``os.write`` on an ``O_APPEND`` descriptor, so a sample is either entirely in
the file or not at all:

* Ctrl+C / SIGTERM / SIGHUP are caught by `stop_signals`; one that arrives during the
  write is held until the line is complete, so a stop lands before or after a line, never
  inside one, and a sample that was being taken when it came writes nothing.
* A write that fails part-way (disk full) is undone with ``ftruncate`` to the size before
  it, and recording stops with the reason.
* SIGKILL cannot be blocked: the kernel may then leave the last line short. Readers skip
  an incomplete last line, and the next ``record`` into the same file first ends that
  torn line with a newline, so its own samples stay whole and the torn line is reported
  as malformed rather than glued to a good one.

Lines are not fsync'd one by one: once ``write`` returns the data is the kernel's, so a
killed recorder loses nothing; only a power loss or kernel crash could drop the last
seconds, and a disk flush per sample is not worth that. The file is fsync'd when
recording ends. Appending to a non-empty file that is not a record file is refused, so a
mistyped path never damages another file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from gputaskman.base.argtypes import positive_count, positive_seconds
from gputaskman.offline.recordfile import MAX_LINE_BYTES, parse_line
from gputaskman.render import report

# Every record line begins with this (to_json_dict's first keys, compact separators).
LINE_PREFIX = b'{"schema":"gputaskman.snapshot"'
FLEET_LINE_PREFIX = b'{"schema":"gputaskman.fleet"'  # and every fleet record line with this
# Stop requests held back while a line is written.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class RecordError(Exception):
    """Recording cannot start or continue; the message is for the user."""


class Sampler(Protocol):
    def sample_with_system(self) -> tuple[Any, Any]: ...

    def close(self) -> None: ...


def make_collector(gpu: int | None) -> Sampler:
    """The collector the TUI uses: budgeted scanning, one instance for the whole run."""
    from gputaskman.sampling.collector import SCAN_BUDGET, Collector

    return Collector(gpu=gpu, scan_budget=SCAN_BUDGET)


def encode_line(doc: dict[str, Any]) -> bytes:
    """One record line: the compact JSON object and its newline, ASCII only."""
    return (json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n").encode("ascii")


def _check_existing(path: Path, fd: int, prefix: bytes) -> None:
    """Refuse a non-empty regular file that is not a record file of this kind (`prefix`:
    snapshot lines, or fleet lines); end a torn last line."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return
    with open(path, "rb") as f:
        first = f.readline(MAX_LINE_BYTES)
        if not first.startswith(prefix):
            doc, why = parse_line(first.rstrip(b"\n"))
            if prefix != LINE_PREFIX or doc is None:
                what = "fleet record" if prefix == FLEET_LINE_PREFIX else "record"
                raise RecordError(
                    f"{path} is not a gputaskman {what} file (line 1: "
                    f"{why or 'a snapshot record line'}); not appending to it"
                )
        f.seek(st.st_size - 1)
        last = f.read(1)
    if last != b"\n":
        # An earlier recorder was killed mid-line: terminate that line so ours stay whole.
        os.write(fd, b"\n")


def open_record(path: Path, prefix: bytes = LINE_PREFIX) -> int:
    """An append-only descriptor for `path` (created 0644 when missing), a record file of
    the kind whose lines begin with `prefix`."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RecordError(f"cannot open {path} for appending: {exc.strerror or exc}") from None
    try:
        _check_existing(path, fd, prefix)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Guard:
    """Stop requests that arrive while a line is being written (and counted) wait for it."""

    writing = False
    pending: str | None = None


def _on_stop_signal(signum: int, _frame: object) -> None:
    # Python runs signal handlers in the main thread between bytecodes, which is where
    # write_line runs, so this check cannot race with the write it protects.
    name = signal.Signals(signum).name
    if _Guard.writing:
        _Guard.pending = name
        return
    raise KeyboardInterrupt(name)


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """A stop signal that arrives inside the block waits until the block is done, then stops
    (KeyboardInterrupt): a line is written and counted, or neither. Nests."""
    outer = _Guard.writing
    _Guard.writing = True
    pending = None
    try:
        yield
    finally:
        _Guard.writing = outer
        if not outer:
            pending, _Guard.pending = _Guard.pending, None
    if pending is not None:  # not reached when the block failed: that ends the run anyway
        raise KeyboardInterrupt(pending)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Ctrl+C, SIGTERM and SIGHUP stop recording between lines, never inside one."""
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def write_line(fd: int, data: bytes) -> None:
    """Append one whole line or nothing (see the module docstring). A caller that counts the
    line holds stops over both (`stops_held`), so a stop never falls between them."""
    with stops_held():
        size = os.fstat(fd).st_size
        done = 0
        try:
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError as exc:
            if done:
                # if even this fails, readers still skip the torn line
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
            raise RecordError(f"writing the record failed: {exc.strerror or exc}") from None


@dataclass
class RecordResult:
    samples: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)  # distinct failure messages
    stopped_by: str | None = None  # "interrupt", "count", "duration", "error"


class Recorder:
    """Samples `source` every `interval` seconds and appends each sample to `fd`.

    Stops after `count` samples or when the next sample would start at or after
    `duration` seconds, or on KeyboardInterrupt (the caller maps SIGTERM/SIGHUP to it).
    A sample that raises writes nothing; the error is counted and recording goes on.
    """

    def __init__(
        self,
        fd: int,
        source: Sampler,
        *,
        selected_gpu: int | None = None,
        interval: float = 1.0,
        duration: float | None = None,
        count: int | None = None,
        on_sample: Callable[[RecordResult], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.fd = fd
        self.source = source
        self.selected_gpu = selected_gpu
        self.interval = interval
        self.duration = duration
        self.count = count
        self.on_sample = on_sample
        self.on_error = on_error
        self.clock = clock
        self.sleep = sleep
        self.result = RecordResult()

    def sample_once(self) -> None:
        try:
            snapshot, system = self.source.sample_with_system()
            data = encode_line(report.to_json_dict(snapshot, system, self.selected_gpu))
        except Exception as exc:  # a broken probe costs one sample, not the recording
            self.result.failures += 1
            msg = f"{type(exc).__name__}: {exc}"
            if msg not in self.result.errors:
                self.result.errors.append(msg)
                if self.on_error:
                    self.on_error(msg)
            return
        with stops_held():  # a stop between the write and the count would lose the count
            write_line(self.fd, data)
            self.result.samples += 1
        if self.on_sample:
            self.on_sample(self.result)

    def run(self) -> RecordResult:
        return paced(
            self.sample_once,
            self.result,
            interval=self.interval,
            count=self.count,
            duration=self.duration,
            clock=self.clock,
            sleep=self.sleep,
        )


def paced(
    step: Callable[[], None],
    result: RecordResult,
    *,
    interval: float,
    count: int | None = None,
    duration: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RecordResult:
    """Call `step` (which writes one line, counted in `result.samples`, or counts a failure)
    every `interval` seconds from the first call, until `count` lines are written, the next
    call would start at or after `duration` seconds, KeyboardInterrupt (the caller maps
    SIGTERM/SIGHUP to it) or a `RecordError` (the file cannot be written). A slow step skips
    the ticks it missed instead of bursting to catch up. The recorder of one host and the
    fleet's share it."""
    start = clock()
    tick = 0
    try:
        while True:
            if count is not None and result.samples >= count:
                result.stopped_by = "count"
                break
            step()
            elapsed = clock() - start
            tick = max(tick + 1, int(elapsed / interval) + 1)
            next_at = tick * interval
            if duration is not None and next_at >= duration:
                result.stopped_by = "duration"
                break
            if count is not None and result.samples >= count:
                result.stopped_by = "count"
                break
            wait = next_at - (clock() - start)
            if wait > 0:
                sleep(wait)
    except KeyboardInterrupt:
        result.stopped_by = "interrupt"
    except RecordError as exc:
        result.stopped_by = "error"
        result.errors.append(str(exc))
    return result


# ---------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="record file to append to (JSON Lines)")
    # own dest: the top-level --interval (TUI refresh) still applies when this is not given
    p.add_argument(
        "--interval",
        dest="record_interval",
        type=positive_seconds,
        metavar="S",
        help="seconds between samples (default: the TUI's --interval, 1.0)",
    )
    p.add_argument(
        "--duration",
        type=positive_seconds,
        metavar="S",
        help="stop after S seconds (default: never)",
    )
    p.add_argument("--count", type=positive_count, metavar="N", help="stop after N samples")


class _Progress:
    """The live sample count on stderr when it is a terminal; quiet lines otherwise."""

    def __init__(self, path: Path, interval: float, out: TextIO) -> None:
        self.path, self.interval, self.out = path, interval, out
        self.tty = out.isatty()
        self.t0 = time.monotonic()

    def start(self) -> None:
        self.out.write(f"recording to {self.path} every {self.interval:g}s (Ctrl+C stops)\n")
        self.out.flush()

    def sample(self, r: RecordResult) -> None:
        if not self.tty:
            return
        secs = int(time.monotonic() - self.t0)
        failed = f", {r.failures} failed" if r.failures else ""
        self.out.write(
            f"\r\x1b[K{r.samples} samples{failed}  "
            f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"
        )
        self.out.flush()

    def error(self, msg: str) -> None:
        self.out.write(("\n" if self.tty else "") + f"sample failed (nothing written): {msg}\n")
        self.out.flush()

    def end(self, r: RecordResult) -> None:
        if self.tty:
            self.out.write("\n")
        failed = f"; {r.failures} samples failed and were not written" if r.failures else ""
        self.out.write(f"recorded {r.samples} samples to {self.path}{failed}\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    interval = args.record_interval or args.interval or 1.0  # the TUI's --interval is top-level
    gpu = args.gpu
    err = sys.stderr
    try:
        fd = open_record(path)
    except RecordError as exc:
        print(f"gputaskman record: {exc}", file=err)
        return 2
    progress = _Progress(path, interval, err)
    source: Sampler | None = None
    with stop_signals():
        try:
            progress.start()
            source = make_collector(gpu)
            recorder = Recorder(
                fd,
                source,
                selected_gpu=gpu,
                interval=interval,
                duration=args.duration,
                count=args.count,
                on_sample=progress.sample,
                on_error=progress.error,
            )
            result = recorder.run()
        except KeyboardInterrupt:  # before the first sample (while the collector started)
            result = RecordResult(stopped_by="interrupt")
        finally:
            try:
                if source is not None:
                    source.close()
                os.fsync(fd)
            except (OSError, KeyboardInterrupt):
                pass  # the lines are written; a failed flush to disk is not worth a traceback
            finally:
                os.close(fd)
    progress.end(result)
    if result.stopped_by == "error":
        print(f"gputaskman record: {result.errors[-1]}", file=err)
        return 1
    return 0
