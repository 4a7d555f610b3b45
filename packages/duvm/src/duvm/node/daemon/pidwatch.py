"""Watching another process end: `Watched` (pid, start time, pidfd), and `GuardKeeper`, which
keeps the request-timer guard (`duvm.wire.nbdguard`) the supervisor hands a daemon process and
restores the device's request timeout when the supervisor ends.

Theory of operation: the supervisor sets the kernel nbd driver's request timeout to 0 while it
watches (requests of a crashed daemon are then requeued to its successor at once), and puts it
back when it exits. SIGKILLed, it cannot: so the daemon (told over its control socket) and the
standby (told over its socket pair) each keep a guard, watch the supervisor's pidfd on their
event loop, and the first to see it end restores the timeout (the second finds it done, or
restores it again: the same value). The restore runs in a thread of its own: it sets the
queue's timer through sysfs, waits for the requests in flight to drain once (which needs the
event loop answering them: `duvm.wire.nbdguard.set_back` says why the live connection needs
the wait), then makes one netlink request. Nothing is read from /run, which may wait for the
very device this process serves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from duvm.base import procstat
from duvm.wire import nbdguard
from duvm.wire.nbdguard import TimerGuard

log = logging.getLogger("duvm.node.daemon.pidwatch")
log.setLevel(logging.INFO)  # a guard firing is rare and always worth its line


class Watched:
    """A process watched for its end (the daemon a standby stands in for, the supervisor a
    guard names), named by pid and start time and held by a pidfd, so a recycled pid is never
    taken for it."""

    def __init__(self, spec: str) -> None:
        pid, _, start = spec.partition(":")
        self.pid, self.start = int(pid), int(start) if start else None
        self._fd: int | None = None
        self._no_pidfd = False  # a kernel without pidfd_open: /proc is asked instead
        try:
            self._fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            pass
        except (OSError, AttributeError):
            self._no_pidfd = True
        # another process on the pid now (no start time recorded: the pid alone names it)
        if self._fd is not None and not self._alive_in_proc():
            os.close(self._fd)
            self._fd = None

    def _alive_in_proc(self) -> bool:
        return procstat.pid_alive(self.pid, self.start)

    def gone(self, wait_s: float = 2.0) -> bool:
        """True once that daemon has exited (its pidfd turns readable when its last thread
        has), waiting up to `wait_s` for it: /proc may show a SIGKILLed daemon's first thread
        a zombie while its others still exit."""
        if self._no_pidfd:
            deadline = time.monotonic() + wait_s
            while self._alive_in_proc() and time.monotonic() < deadline:
                time.sleep(0.01)
            return not self._alive_in_proc()
        if self._fd is None:
            return True
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return bool(p.poll(int(wait_s * 1000)))

    def fileno(self) -> int | None:
        """The pidfd (readable once the process has ended); None when the process was gone
        already or the kernel has no pidfd (`pollable`)."""
        return self._fd

    @property
    def pollable(self) -> bool:
        return not self._no_pidfd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _restore(guard: TimerGuard) -> str | None:
    return guard.restore()


class GuardKeeper:
    """The request-timer guard this process holds: `take` one (replacing the last) and the
    supervisor it names is watched on the running event loop; when that ends, `restore` is
    called once with it (default `TimerGuard.restore`). `describe` says where it stands."""

    def __init__(self, restore: Callable[[TimerGuard], str | None] = _restore) -> None:
        self._restore = restore
        self.guard: TimerGuard | None = None  # the last taken
        self.fired: str | None = None  # "restored" or why not, once its supervisor ended
        self._watched: Watched | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # the restore, once fired

    @property
    def watching(self) -> bool:
        return self._watched is not None

    def describe(self) -> dict[str, object] | None:
        """For the daemon's status: the guard's device and supervisor, whether it is still
        watched and what came of it (None: no guard was ever taken)."""
        if self.guard is None:
            return None
        return {
            "device": self.guard.device,
            "supervisor_pid": self.guard.supervisor_pid,
            "watching": self.watching,
            "fired": self.fired,
        }

    def take(self, guard: TimerGuard) -> None:
        """Keep `guard` from now on (call on the event loop). A supervisor already gone
        fires it at once. The guard already held and watched is kept as it is (a standby that
        took over is told again the guard it had as a standby): its pidfd and the loop's
        reader are not replaced by equal ones."""
        if guard == self.guard and self._watched is not None and self.fired is None:
            return
        self._drop()
        self.guard, self.fired, self._thread = guard, None, None
        watched = Watched(f"{guard.supervisor_pid}:{guard.supervisor_start or ''}")
        fd = watched.fileno()
        if fd is None:
            watched.close()
            if watched.pollable:  # gone already (or its pid is another process's now)
                self._fire()
            else:
                log.warning("no pidfd here: the supervisor's end is not watched")
            return
        self._watched, self._loop = watched, asyncio.get_running_loop()
        self._loop.add_reader(fd, self._fire)

    def settle(self, wait_s: float) -> None:
        """Before this process exits because its supervisor's socket closed: a SIGKILLed
        supervisor closes its sockets before its pidfd turns readable, so wait up to `wait_s`
        for that and fire then, and let the restore finish."""
        if self._watched is not None and self._watched.gone(wait_s):
            self._fire()
        if self._thread is not None:
            self._thread.join(nbdguard.IDLE_WAIT_S + 5)

    def close(self) -> None:
        """Stop watching (a clean stop: the supervisor restores the timeout itself)."""
        self._drop()

    def _fire(self) -> None:
        guard = self.guard
        self._drop()
        if guard is None or self.fired is not None or self._thread is not None:
            return
        # not on the loop: the restore waits for the requests in flight, which the loop answers
        self._thread = threading.Thread(
            target=self._restore_now, args=(guard,), name="duvm-guard", daemon=True
        )
        self._thread.start()

    def _restore_now(self, guard: TimerGuard) -> None:
        why = self._restore(guard)
        self.fired = why or "restored"
        if why is None:
            log.warning(
                "supervisor pid %d ended: %s's request timeout is %d s again (nobody would "
                "resend a crash's requests now; the kernel's timers end them)",
                guard.supervisor_pid,
                guard.device,
                guard.timeout_s,
            )
        else:
            log.warning(
                "supervisor pid %d ended: %s's request timeout left as it is: %s",
                guard.supervisor_pid,
                guard.device,
                why,
            )

    def _drop(self) -> None:
        if self._watched is not None:
            fd = self._watched.fileno()
            if self._loop is not None and fd is not None and not self._loop.is_closed():
                self._loop.remove_reader(fd)
            self._watched.close()
        self._watched, self._loop = None, None
