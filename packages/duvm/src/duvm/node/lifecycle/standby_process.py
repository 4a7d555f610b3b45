"""The standby daemon seen from the supervisor: start it beside the daemon when memory allows,
know when it is ready, tell it to take the device over, stop it.

Theory of operation
-------------------
`duvm supervise` keeps one standby (`duvm daemon --standby-fd`, `duvm.node.daemon.standby`)
beside the daemon it watches. It starts it with one end of a socket pair (the standby's
``--standby-fd``) and keeps the other: the standby says ``ready`` once its store is built and
its memory faulted in, and the supervisor, once the daemon is dead, says ``takeover`` and waits
for ``serving`` with the socket it listens on (or ``refused REASON``), hands the device a
connection to it, asks with ``check`` whether the device kept it (``kept`` or ``dropped``:
`duvm.node.lifecycle.resume.adopt` hands another until one is kept), and says ``handed``.
Closing its end (EOF) makes a standby exit releasing
nothing. The pair is in the supervisor's poll set, so a standby that dies or refuses is
noticed at once, and another is started after `RETRY_S`.

A standby costs about the daemon's own memory. It is started only when ``MemAvailable`` is
at least `HEADROOM` times what it is expected to add (the anonymous memory the last one held
when ready, else the daemon's plus the heap a standby keeps; the files it maps are the
daemon's too), so that half a standby's memory stays available beside it: on a node already
that short the slow path (a new daemon) is left, and another try comes `RETRY_S` later. Not
more: a restart the slow way needs about the same memory, at the worst moment (D48, D50).
After a takeover the next standby is started the same way, so never before the device is
served again.

What `duvm status` shows comes from ``STATE_DIR/standby.json``, written by the supervisor only
while a daemon serves (a file on /run may be swapped out while none does): the standby from
when it starts (``ready`` false until it says so), or why there is none (memory short, or it
cannot be started), which `duvm enable` reads to warn that a crash will cost a restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from duvm.base import pressure
from duvm.node.attach import processes
from duvm.node.lifecycle import control
from duvm.node.lifecycle.resume import resume_command
from duvm.node.lifecycle.supervisor_process import STANDBY_LOGS, standby_path, workers_arg
from duvm.wire.nbdguard import TimerGuard

T = TypeVar("T")

HEADROOM = 1.5  # MemAvailable must hold this many standbys of the expected size
HEAP_RESERVE_MIB = 8  # the heap a standby keeps for its takeover (duvm.node.daemon.standby)
RETRY_S = 10.0  # between tries to start one (memory short, or the last one ended)
READY_TIMEOUT_S = 120.0  # a standby not ready by then is stopped (Python under TCG: ~5 s)


class StandbyError(Exception):
    """The standby could not take over; the message says why."""


class Standby:
    """One standby process and the supervisor's end of its socket pair."""

    def __init__(
        self, proc: subprocess.Popen[bytes], sock: socket.socket, log: Path, for_pid: int
    ) -> None:
        self.proc, self.sock, self.log, self.for_pid = proc, sock, log, for_pid
        self.pid = proc.pid
        self.start = processes.start_time(proc.pid)
        self.started = time.monotonic()
        self.ready_kib: int | None = None  # resident when it said ready
        self.ready_anon_kib: int | None = None  # of it anonymous (its own, not shared files)
        self.announced = False  # its readiness was said and recorded
        self.told_kib: int | None = None  # resident when it was told to take over
        self.serving_kib: int | None = None  # resident when it said it serves
        self.serving_ms: float | None = None  # its own time for the takeover
        self.ended: str | None = None  # why it is no standby any more
        self.guarded: TimerGuard | None = None  # the guard it was handed last
        self._buf = b""

    @classmethod
    def spawn(cls, state_dir: Path, daemon: control.DaemonInfo) -> Standby:
        """Start a standby for `daemon`. Its log is STATE_DIR/daemon-standby-1.log or -2,
        whichever is not the daemon's (a standby that took over keeps its log, which was
        the other's); what was there before is kept once, as .1."""
        log = next(
            state_dir / name
            for name in STANDBY_LOGS
            if str(state_dir / name) != daemon.log and Path(daemon.log).name != name
        )
        with contextlib.suppress(FileNotFoundError):  # a dead daemon's, or a standby's that ended
            os.replace(log, log.with_name(log.name + ".1"))
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cmd = [
                *resume_command(daemon),
                "--standby-fd",
                str(theirs.fileno()),
                "--standby-for",
                f"{daemon.pid}:{daemon.start if daemon.start is not None else ''}",
            ]
            proc = processes.spawn_detached(cmd, log, pass_fds=(theirs.fileno(),))
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        return cls(proc, mine, log, daemon.pid)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def ready(self) -> bool:
        return self.ready_kib is not None and self.ended is None

    def _lines(self) -> list[bytes]:
        """Whole lines received so far; sets `ended` at EOF."""
        while True:
            try:
                data = self.sock.recv(512)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                data, self.ended = b"", self.ended or f"its socket failed ({exc})"
            if not data:
                self.ended = self.ended or self._exit_text()
                break
            self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.strip() for ln in lines]

    def _exit_text(self) -> str:
        rc = self.proc.poll()
        return "it exited" + ("" if rc is None else f" ({rc})") + f"; see {self.log}"

    def poll(self) -> None:
        """Read what the standby said (call when its socket is readable)."""
        for line in self._lines():
            word, _, rest = line.partition(b" ")
            if word == b"ready":
                kib, anon = [*rest.split(), b"", b""][:2]
                self.ready_kib = int(kib) if kib.isdigit() else 0
                self.ready_anon_kib = int(anon) if anon.isdigit() else None
            elif word == b"refused":
                self.ended = f"it refused: {rest.decode(errors='replace')}"

    def take_over(self, timeout: float = 30.0) -> str:
        """Tell the standby to take over and wait until it serves; the socket it listens on
        (the daemon's name is given to it once `handed` says the device has a connection).
        Sets `serving_kib` and `serving_ms` (resident memory then, and its own time).
        StandbyError when it refuses, ends or does not answer in `timeout` s (it is killed
        then: a half-done takeover must not serve later beside another daemon)."""
        self._say(b"takeover")

        def serving(line: bytes) -> str | None:
            word, _, rest = line.partition(b" ")
            if word == b"serving":
                told, kib, ms, path = [*rest.decode(errors="replace").split(" ", 3), *"   "][:4]
                self.told_kib = int(told) if told.isdigit() else None
                self.serving_kib = int(kib) if kib.isdigit() else None
                with contextlib.suppress(ValueError):
                    self.serving_ms = float(ms)
                return path
            if word == b"refused":
                self.ended = rest.decode(errors="replace")
                self.stop(timeout=5)  # it exits by itself, having said why in its log
                raise StandbyError(f"the standby (pid {self.pid}) refused: {self.ended}")
            return None

        return self._answer(serving, timeout, "serve")

    def send_guard(self, guard: TimerGuard) -> None:
        """Hand it the request-timer guard (`duvm.wire.nbdguard`): it watches this supervisor
        and restores the device's request timeout if this process is killed."""
        with contextlib.suppress(OSError):
            self.sock.sendall(b"guard " + json.dumps(guard.to_json()).encode() + b"\n")
        self.guarded = guard

    def kept(self, timeout: float = 5.0) -> bool:
        """Whether the connection just handed to the device is still held by its client (the
        kernel's driver). StandbyError when the standby ends or does not answer in `timeout`
        s."""
        self._say(b"check")
        held = {b"kept": True, b"dropped": False}
        return self._answer(held.get, timeout, "answer")

    def _say(self, word: bytes) -> None:
        try:
            self.sock.sendall(word + b"\n")
        except OSError as exc:
            raise StandbyError(f"the standby (pid {self.pid}) is gone ({exc})") from None

    def _answer(self, pick: Callable[[bytes], T | None], timeout: float, what: str) -> T:
        """The first line `pick` makes something of. StandbyError when the standby ends or
        does not `what` in `timeout` s (it is killed then: a half-done takeover must not
        serve later beside another daemon)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self._lines():
                got = pick(line)
                if got is not None:
                    return got
            if self.ended is not None:
                raise StandbyError(f"the standby (pid {self.pid}) ended: {self.ended}")
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise StandbyError(f"the standby (pid {self.pid}) did not {what} in {timeout} s")
            select.select([self.sock], [], [], left)

    def handed(self) -> None:
        """The device has a connection to it: it takes the daemon's socket name and control
        socket now (not before: other users of /run may have been waiting for the device)."""
        with contextlib.suppress(OSError):
            self.sock.sendall(b"handed\n")
        self.sock.close()

    def kill(self) -> None:
        """SIGKILL (never SIGTERM once it may serve: a clean stop releases the pages)."""
        processes.send_signal(self.pid, signal.SIGKILL, self.start)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.sock.close()

    def stop(self, timeout: float = 10.0) -> None:
        """End a standby that did not take over: ``stop`` and EOF on its socket (it exits
        releasing nothing; EOF alone would be this supervisor's end, which it waits for to
        keep its guard), SIGKILL after `timeout` s."""
        with contextlib.suppress(OSError):
            self.sock.sendall(b"stop\n")
        self.sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


class Spares:
    """The supervisor's standby: started when memory allows, watched, replaced when it ends.
    `say` gets one line per kind of event (a standby refused for memory is said once until
    the reason changes, not every `RETRY_S`)."""

    def __init__(
        self,
        state_dir: Path,
        say: Callable[[str], None],
        *,
        spawn: Callable[[Path, control.DaemonInfo], Standby] = Standby.spawn,
        available: Callable[[], int | None] = pressure.mem_available_kib,
        retry_s: float = RETRY_S,
    ) -> None:
        self.state_dir, self.say = state_dir, say
        self._spawn, self._available, self.retry_s = spawn, available, retry_s
        self.current: Standby | None = None
        self.last_ready_kib: int | None = None
        self.last_ready_anon_kib: int | None = None
        self._next_try = 0.0
        self._said: str | None = None
        self._failures = 0  # standbys in a row that ended without taking over
        self._none: str | None = None  # why there is none, as standby.json says it

    def _note(self, kind: str, text: str) -> None:
        """Say `text` unless the last thing said was of the same `kind`."""
        if kind != self._said:
            self._said = kind
            self.say(text)

    def fds(self) -> list[int]:
        return [self.current.fileno()] if self.current is not None else []

    def next_wake(self) -> float | None:
        """Seconds until `tend` has something to do again (None: only on an event)."""
        if self.current is not None and not self.current.ready:
            return max(0.05, self.current.started + READY_TIMEOUT_S - time.monotonic())
        if self.current is None:
            return max(0.05, self._next_try - time.monotonic())
        return None

    def tend(self, daemon: control.DaemonInfo, guard: TimerGuard | None = None) -> None:
        """Read what the standby said; replace one that ended or was never ready; start one
        when there is none and memory allows; hand a ready one `guard` (the supervisor's
        request-timer guard, None: none armed). Call while `daemon` serves. Standbys that keep
        ending are tried again after `retry_s`, doubling up to 64 times that, and only the
        first of such a run is said."""
        cur = self.current
        if cur is not None:
            cur.poll()
            late = time.monotonic() - cur.started > READY_TIMEOUT_S
            if cur.ended is None and not cur.ready and late:
                cur.ended = f"not ready after {READY_TIMEOUT_S:.0f} s"
            if cur.ended is None and cur.for_pid != daemon.pid:  # a new daemon was started
                cur.stop()
                self.current = None
                self._write(None)
                cur = None
        if cur is not None:
            if cur.ended is not None:
                self._failures += 1
                backoff = self.retry_s * 2 ** min(self._failures - 1, 6)
                self._note("ended", f"standby pid {cur.pid} ended: {cur.ended}")
                cur.stop()
                self.current = None
                self._next_try = time.monotonic() + backoff
                self._write(None)
            elif cur.ready and not cur.announced:
                cur.announced = True
                self._failures = 0
                self.last_ready_kib = cur.ready_kib
                self.last_ready_anon_kib = cur.ready_anon_kib
                self._note("ready", f"standby pid {cur.pid} ready ({cur.ready_kib} KiB resident)")
                self._write(cur)
        cur = self.current
        if cur is not None and cur.ready and guard is not None and cur.guarded != guard:
            cur.send_guard(guard)
        if self.current is not None or time.monotonic() < self._next_try:
            return
        if (workers := workers_arg(daemon.daemon_args)) > 1:
            why = f"a daemon of {workers} workers has none yet (DECISIONS.md D49)"
            self._note("workers", f"no standby: {why}; a crash starts a new daemon")
            self._record_none(why)
            self._next_try = time.monotonic() + self.retry_s
            return
        # what a standby adds: its anonymous memory (the files it maps are the daemon's too),
        # as the last one held it, else as the daemon holds it plus the kept heap
        own = self.last_ready_anon_kib or (
            (pressure.rss_kib(daemon.pid, "RssAnon") or 0) + (HEAP_RESERVE_MIB << 10)
        )
        need = int(HEADROOM * own)
        have = self._available()
        if have is not None and have < need:
            why = f"{have} KiB available, {need} KiB wanted ({HEADROOM:g} x a standby's own memory)"
            self._note(
                "memory",
                f"no standby: {why}; a crash now starts a new daemon. Trying again every "
                f"{self.retry_s:.0f} s",
            )
            self._record_none(why)
            self._next_try = time.monotonic() + self.retry_s
            return
        try:
            self.current = self._spawn(self.state_dir, daemon)
        except (OSError, control.ControlError) as exc:
            self._note("spawn", f"no standby: it cannot be started ({exc})")
            self._record_none(f"it cannot be started: {exc}")
            self._next_try = time.monotonic() + self.retry_s
            return
        self._none = None
        self._write(self.current)  # "starting": what `duvm enable` waits for
        if not self._failures:
            self._note("starting", f"standby pid {self.current.pid} starting")

    def take(self, daemon_pid: int) -> Standby | None:
        """The ready standby of the daemon `daemon_pid`, now the supervisor's to hand the
        device to (None: none ready for it)."""
        cur = self.current
        if cur is None or cur.for_pid != daemon_pid:
            return None
        cur.poll()
        if not cur.ready:
            return None
        self.current = None
        self._said = None
        return cur

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None
        with contextlib.suppress(OSError):
            standby_path(self.state_dir).unlink()

    def _record_none(self, why: str) -> None:
        if self._none != why:  # written when the reason changes, not every try
            self._none = why
            self._write(None, none=why)

    def _write(self, cur: Standby | None, none: str | None = None) -> None:
        """standby.json for `duvm status` and `duvm enable` (only while the daemon serves: see
        the module doc): the ready standby, or why there is none (`none`), or nothing."""
        path = standby_path(self.state_dir)
        with contextlib.suppress(OSError):
            if cur is None and none is None:
                path.unlink(missing_ok=True)
                return
            record: dict[str, object] = {"pid": None, "none": none}
            if cur is not None:
                record = {
                    "pid": cur.pid,
                    "ready": cur.ready,
                    "start": cur.start,
                    "ready_kib": cur.ready_kib,
                    "ready_anon_kib": cur.ready_anon_kib,
                    "log": str(cur.log),
                }
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(record) + "\n")
            os.replace(tmp, path)
