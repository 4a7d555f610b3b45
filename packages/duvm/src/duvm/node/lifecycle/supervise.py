"""`duvm supervise`: bring a crashed daemon back onto its live kernel nbd device by itself.

Theory of operation
-------------------
`duvm enable` on kernel nbd over netlink starts this small watcher beside the daemon (state in
``STATE_DIR/supervisor.json``, log in ``STATE_DIR/supervisor.log``). It waits for the daemon
process to end, event-driven (a pidfd; a 1 s check where the kernel has none). Beside it, when
memory allows, it keeps a standby (`duvm.node.lifecycle.standby_process`): a second daemon with
its store already built and its memory already faulted in. When the daemon dies, the standby
takes over (milliseconds: nothing is started or read) and the device gets a connection to it
(``NBD_CMD_RECONFIGURE``, :func:`duvm.node.lifecycle.resume.adopt`); a new standby follows once
the device is served again. Without a ready standby, or when it cannot take over, it does
exactly what ``duvm enable --resume`` does (:func:`duvm.node.lifecycle.resume.resume`): a new
daemon from the saved state, forked from this process, which loaded the daemon's code when it
started (`duvm.node.lifecycle.warm_start`: no interpreter to start, no module to read from disk);
a retry starts one by its command line. The kernel holds the swap device's requests for the
dead-connection timeout (60 s), so a resume that succeeds within it loses nothing; failed tries
are repeated with backoff inside that time. On a node whose memory is all taken, a new daemon
cannot get its own (only swapping could free it, and the swap device waits for that daemon):
while such a restart has not served, `duvm.node.lifecycle.room` ends the program holding the
most memory (never duvm's own nor init), one at a time, instead of letting the held swap reads
fail after 60 s.

- It runs locked in RAM (mlockall), realtime, as an I/O flusher and last in the OOM killer's
  list, like the daemon (`duvm.base.pressure`): a supervisor whose pages were swapped out to the
  device it watches could not run once that device's server is dead. For the same reason it
  reads no file on /run between the daemon's death and the resume (it keeps the records it
  read while the daemon lived and hands them to the resume) and logs through a writer thread
  (`duvm.base.quietlog`).
- Only a crash is resumed: `duvm disable` stops the supervisor (SIGTERM) before it stops the
  daemon. SIGTERM is only noted: a resume under way finishes first, so the device is never
  left without a server because the supervisor was told to stop half-way through.
- A daemon that keeps dying is not restarted forever: when it dies again after
  ``RestartPolicy.max_restarts`` restarts within its ``restart_window`` seconds, the
  supervisor gives up. Tries of one resume stop at the kernel's dead-connection timeout: after
  it the held I/O has failed and the memservers' lease on the namespaces has run out, so a
  later try would find nothing to serve. Giving up fails the device's held requests at once
  (``NBD_CMD_DISCONNECT``, `fail_held_io`: the node falls back as with a failed swap disk,
  instead of waiting out the rest of the hold) and the reason goes to its log and to
  `duvm status`.
- `duvm disable` stops it only after swapoff brought every page home and the device is gone
  (a daemon crash during that long swapoff is resumed like any other); a daemon that is dead
  when disable starts makes disable refuse (without --force) rather than fail the swapoff.
- Manual ``duvm enable --resume`` and the supervisor never both resume: `resume` takes a lock
  on the state directory, and the second finds the daemon already running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from duvm.base import control_socket, pressure, quietlog
from duvm.node.attach import attach, attach_kernel, attach_state, processes, systools
from duvm.node.lifecycle import (
    control,
    linkmend,
    resume,
    room,
    standby_process,
    supervisor_process,
    warm_start,
)
from duvm.node.lifecycle.supervisor_process import wanted
from duvm.wire import nbdguard, nbdnetlink


@dataclass(frozen=True)
class RestartPolicy:
    """When the supervisor tries again and when it gives up."""

    max_restarts: int = 5  # restarts within `restart_window` before it gives up
    restart_window: float = 600.0  # seconds
    # between failed resume attempts (~60 s in all, the kernel's dead-connection hold)
    retry_delays: tuple[float, ...] = (0.5, 1, 2, 4, 8, 15, 30)


DEFAULT_NEED_KIB = 64 << 10  # a new daemon's own memory until one was measured here


class _Stop:
    """SIGTERM/SIGINT noted (not acted on at once), and a fd that wakes a waiting poll."""

    def __init__(self) -> None:
        self.requested = False
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_fd = signal.set_wakeup_fd(self._w)
        self._old = {sig: signal.signal(sig, self._note) for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self) -> None:
        """Give the process its previous signal handling back."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)

    def _note(self, signum: int, frame: object) -> None:
        self.requested = True

    def wait(
        self,
        pid: int | None,
        timeout: float | None,
        start: int | None = None,
        fds: tuple[int, ...] = (),
    ) -> str:
        """Until `pid` (the process that started at `start`) ends (None: only the timeout), a
        stop is requested, one of `fds` is readable or `timeout` s pass. Says which: "ended",
        "stop", "fd" or "timeout"."""
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        pidfd = -1
        if pid is not None:
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                return "ended"
            except (OSError, AttributeError):  # no pidfd here: look once a second
                pidfd = -1
            else:
                if not processes.pid_alive(pid, start):  # the pidfd names a later process
                    os.close(pidfd)
                    return "ended"
                poller.register(pidfd, select.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self.requested:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return "timeout"
                if pid is not None and pidfd < 0:
                    left = 1.0 if left is None else min(left, 1.0)
                events = poller.poll(None if left is None else max(1, int(left * 1000)))
                with contextlib.suppress(BlockingIOError):
                    os.read(self._r, 512)
                ready = {fd for fd, _ in events}
                if pidfd >= 0 and pidfd in ready:
                    return "ended"
                if pid is not None and pidfd < 0 and not processes.pid_alive(pid, start):
                    return "ended"
                if ready & set(fds):
                    return "fd"
            return "stop"
        finally:
            if pidfd >= 0:
                os.close(pidfd)


SparesFactory = Callable[[Path, Callable[[str], None]], standby_process.Spares]
RoomFactory = Callable[[int, Callable[[str], None]], contextlib.AbstractContextManager[Any]]
LinkEventsFactory = Callable[[Callable[[str], None]], linkmend.LinkEvents | None]


def watch(
    state_dir: Path,
    *,
    resume_fn: Callable[..., Any] | None = None,
    say: Callable[[str], None] | None = None,
    policy: RestartPolicy | None = None,
    spares: SparesFactory | None = standby_process.Spares,
    give_up: Callable[[attach_state.Attachment, str], None] | None = None,
    reattach: Callable[[attach_state.Attachment, str], None] = attach_kernel.reattach,
    timer: attach_kernel.RequestTimer | None = None,
    make_room: RoomFactory = room.making_room,
    link_events: LinkEventsFactory = linkmend.kernel_events,
    start: resume.Starter | None = None,
) -> int:
    """The supervisor's loop (see the module docstring). Returns the exit code: 0 when told to
    stop or when duvm is no longer enabled, 1 when it gave up. `spares` keeps a standby beside
    the daemon (None: none, every restart starts a new daemon); `give_up` fails the device's
    held requests once nobody will serve them (default `fail_held_io`); `reattach` hands the
    device a connection to the standby that took over; `timer` sets how the kernel times the
    device's requests while this watches (`attach_kernel.RequestTimer`); `make_room` watches a
    restart the slow way and ends programs for its memory (`duvm.node.lifecycle.room`);
    `link_events` hears the kernel report a connection dead while a daemon serves
    (`duvm.node.lifecycle.linkmend`: it is handed a new one); `start`, when given, starts the
    first try of each restart the slow way (`duvm.node.lifecycle.warm_start.fork_daemon`),
    whose retries start a daemon the usual way."""
    resume_fn = resume_fn or resume.resume
    say = say or (lambda m: print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {m}", flush=True))
    stopper = _Stop()
    keeper = spares(state_dir, say) if spares is not None else None
    lock = resume.resume_lock(state_dir)  # opened now: the takeover opens no file
    timing = _Timing(timer or attach_kernel.RequestTimer(), say)
    events = link_events(say)
    mender = linkmend.Mender(events, reattach, say) if events is not None else None
    try:
        return _watch(
            state_dir,
            resume_fn,
            say,
            stopper,
            policy or RestartPolicy(),
            keeper,
            give_up or fail_held_io,
            reattach,
            lock,
            timing,
            make_room,
            mender,
            start,
        )
    finally:
        if mender is not None:
            mender.close()
        timing.restore()
        lock.close()
        if keeper is not None:
            keeper.stop()
        stopper.close()


def _watch(
    state_dir: Path,
    resume_fn: Callable[..., Any],
    say: Callable[[str], None],
    stopper: _Stop,
    policy: RestartPolicy,
    keeper: standby_process.Spares | None,
    give_up: Callable[[attach_state.Attachment, str], None],
    reattach: Callable[[attach_state.Attachment, str], None],
    lock: IO[Any],
    timing: _Timing,
    make_room: RoomFactory,
    mender: linkmend.Mender | None,
    start: resume.Starter | None,
) -> int:
    restarts: list[float] = []
    daemon_file = control.daemon_path(state_dir)
    need_kib = DEFAULT_NEED_KIB  # what a new daemon needs: see `duvm.node.lifecycle.room`
    taken: tuple[control.DaemonInfo, attach_state.Attachment] | None = None
    while not stopper.requested:
        if taken is not None:  # not read back: the kernel may cut the new connection yet
            (daemon, att), taken = taken, None
        else:
            # Read while the daemon lives (a swap-in can be served); kept in this locked process.
            att = attach_state.load_state(control.state_path(state_dir))
            daemon = control.load_daemon(state_dir)
        seen = _mtime(daemon_file)
        if att is None or daemon is None:
            say("duvm is not enabled here any more: supervisor exits")
            return 0
        if not wanted(att, daemon.daemon_args):
            say(f"{att.device} via {att.method} cannot take a restarted daemon: nothing to do")
            return 0
        if control.daemon_alive(daemon):  # (a recorded pid that is no daemon any more: dead)
            timing.arm(att, daemon)
            if own := pressure.rss_kib(daemon.pid, "RssAnon"):  # measured while it can be
                need_kib = own + (standby_process.HEAP_RESERVE_MIB << 10)
            say(f"watching daemon pid {daemon.pid} serving {att.device}")
            _serve_watch(att, daemon, stopper, keeper, timing, mender)
            if stopper.requested:
                break
            if control.daemon_alive(daemon):
                continue  # woken, but it still runs
        # From here until a daemon serves again, no file on /run is read: its pages may be on
        # the device whose server just died. Existence and mtime live in the inode, never
        # swapped; `disable` removes the state file.
        if not control.state_path(state_dir).exists():
            say("duvm was disabled: supervisor exits")
            return 0
        processes.reap(daemon.pid)  # a daemon forked here is this process's child
        died = time.monotonic()
        restarts = [t for t in restarts if died - t < policy.restart_window] + [died]
        if len(restarts) > policy.max_restarts:
            return _gave_up(
                state_dir,
                att,
                f"the daemon died again after {policy.max_restarts} restarts within "
                f"{policy.restart_window:.0f} s (see the daemon log)",
                say,
                give_up,
            )
        spare = keeper.take(daemon.pid) if keeper is not None else None
        if spare is not None:
            taken = _hand_over(state_dir, att, daemon, spare, died, say, reattach, lock)
            if taken is not None:
                continue
        # The slow way, which needs memory the node may not have: first the kernel's own
        # timer back, so the requests in flight end even if this process cannot go on (D48).
        timing.restore(live=False)
        # The kernel holds the device's I/O (and the memservers the namespaces) this long.
        hold = att.dead_conn_timeout_s or attach_kernel.DEFAULT_DEAD_CONN_TIMEOUT_S
        deadline = died + hold
        say(
            f"daemon pid {daemon.pid} ended: resuming it onto {att.device} (the kernel holds "
            f"its I/O for {hold} s)"
        )
        with make_room(need_kib, say):
            for tried, delay in enumerate((*policy.retry_delays, None)):
                if stopper.requested:
                    say("stopped")
                    return 0
                mtime = _mtime(daemon_file)
                if mtime != seen:  # rewritten: by our last try or a manual resume
                    seen = mtime
                    current = control.load_daemon(state_dir)
                    if (
                        current is not None
                        and current.pid != daemon.pid
                        and control.daemon_alive(current)
                    ):
                        say(f"daemon pid {current.pid} already serves it (resumed by hand)")
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    return _gave_up(
                        state_dir,
                        att,
                        f"could not resume the daemon within the kernel's {hold} s",
                        say,
                        give_up,
                    )
                how = {"start": start} if start is not None and tried == 0 else {}
                try:
                    resume_fn(state_dir, timeout=max(left, 5.0), known=(att, daemon), **how)
                except Exception as exc:  # ControlError, AttachError, OSError: say it, try again
                    say(f"resume failed: {exc}")
                    if delay is None:
                        return _gave_up(state_dir, att, "could not resume the daemon", say, give_up)
                    stopper.wait(None, min(delay, max(0.0, deadline - time.monotonic())))
                    continue
                new = control.load_daemon(state_dir)  # a daemon serves again: safe to read
                say(f"resumed: daemon pid {new.pid if new else '?'} serves {att.device} again")
                break
    say("stopped")
    return 0


class _Timing:
    """The device's request timing while this supervisor watches: armed once a daemon serves
    (requests in flight at a crash are resent at their next check after the takeover, not
    after the driver's 60 s), restored when the supervisor ends, since nobody else would then
    end the requests of a dead connection, and before a restart the slow way (a new daemon),
    which can stall on the node's memory: with the driver's timer back, the requests in flight
    go to wait for a new connection at their next check and fail after the dead-connection
    timeout if none comes, whatever happens to this process (D48). Armed again once a daemon
    serves again. While armed, each daemon it watches and its standby hold `guard`
    (`duvm.wire.nbdguard`): SIGKILLed, this process cannot restore the timer, so they do."""

    def __init__(
        self,
        timer: attach_kernel.RequestTimer,
        say: Callable[[str], None],
        tell: Callable[[str, dict[str, Any]], None] = control_socket.tell_timer_guard,
    ) -> None:
        self._timer, self._say, self._tell = timer, say, tell
        self._armed: attach_state.Attachment | None = None
        self.guard: nbdguard.TimerGuard | None = None
        self._told: int | None = None  # the daemon pid that holds `guard`

    def arm(self, att: attach_state.Attachment, daemon: control.DaemonInfo) -> None:
        """Arm for `att` unless armed; hand `daemon` the guard unless it holds it."""
        if self._armed is None:
            why = self._timer.quick_requeue(att)
            if why is None:
                self._armed = att
                self.guard = nbdguard.TimerGuard(
                    str(att.nbd_device),
                    str(att.extra.get("nbd_pid")),
                    attach.DEFAULT_NBD_TIMEOUT_S,
                    os.getpid(),
                    processes.start_time(os.getpid()),
                )
                self._say(
                    f"requests in flight on {att.device} are looked at every "
                    f"{attach_kernel.REQUEUE_CHECK_MS} ms (and the block layer's second): a "
                    "crash's are resent to its successor"
                )
            elif att.nbd_netlink:
                self._say(f"requests in flight at a crash wait for the kernel's 60 s timer: {why}")
        if self.guard is not None and self._told != daemon.pid:
            self._told = daemon.pid
            try:
                self._tell(control_socket.default_path(daemon.socket), self.guard.to_json())
            except (OSError, ValueError) as exc:
                self._say(
                    f"daemon pid {daemon.pid} holds no guard ({exc}): if this supervisor is "
                    "killed with it, requests in flight then wait for ever"
                )

    def restore(self, *, live: bool = True) -> None:
        """`live`: a daemon may still serve (this supervisor exits); False before a restart
        the slow way, whose daemon is dead (no connection to spare, and no time to lose)."""
        if self._armed is None:
            return
        att, self._armed = self._armed, None
        self.guard, self._told = None, None
        why = self._timer.restore(att, attach.DEFAULT_NBD_TIMEOUT_S, live=live)
        if why is None:
            self._say(f"{att.device}'s request timeout is the kernel's again")


def _serve_watch(
    att: attach_state.Attachment,
    daemon: control.DaemonInfo,
    stopper: _Stop,
    keeper: standby_process.Spares | None,
    timing: _Timing,
    mender: linkmend.Mender | None,
) -> None:
    """Until the daemon ends or a stop is requested, keep a standby beside it (holding the
    timer's guard), and hand the device a new connection when the kernel cuts its own."""
    while True:
        if keeper is not None:
            keeper.tend(daemon, timing.guard)
        fds = tuple(keeper.fds()) if keeper is not None else ()
        why = stopper.wait(
            daemon.pid,
            keeper.next_wake() if keeper is not None else None,
            daemon.start,
            (*fds, mender.fileno()) if mender is not None else fds,
        )
        if why in ("ended", "stop"):
            return
        if mender is not None:
            mender.mend(att, daemon)


def _hand_over(
    state_dir: Path,
    att: attach_state.Attachment,
    daemon: control.DaemonInfo,
    spare: standby_process.Standby,
    died: float,
    say: Callable[[str], None],
    reattach: Callable[[attach_state.Attachment, str], None],
    lock: IO[Any],
) -> tuple[control.DaemonInfo, attach_state.Attachment] | None:
    """Give the device to the ready standby: the records of its new daemon, or None (the
    standby is gone then) when that failed."""
    marks: dict[str, float] = {}
    given: list[float] = []  # each connection handed (the driver may drop one: `resume.adopt`)

    def hand(a: attach_state.Attachment, path: str) -> None:
        marks.setdefault("serving", time.monotonic())
        reattach(a, path)
        marks["handed"] = time.monotonic()
        given.append(marks["handed"])

    try:
        taken = resume.adopt(state_dir, (att, daemon), spare, lock, hand)
    except (
        standby_process.StandbyError,
        control.ControlError,
        attach_state.AttachError,
        OSError,
    ) as exc:
        say(f"the standby could not take over ({exc}): starting a new daemon")
        spare.kill()
        return None
    ms = (time.monotonic() - died) * 1000
    steps = ", ".join(f"{k} at {(v - died) * 1000:.0f}" for k, v in marks.items())
    again = f", {len(given)} connections given" if len(given) > 1 else ""
    say(
        f"standby pid {spare.pid} took over {att.device} {ms:.0f} ms after daemon pid "
        f"{daemon.pid} ended ({steps} ms{again}; resident {spare.ready_kib} KiB when ready, "
        f"{spare.told_kib} when told, {spare.serving_kib} when serving)"
    )
    return taken


def fail_held_io(
    att: attach_state.Attachment,
    why: str,
    *,
    connection_pid: Callable[[str], str | None] = attach_kernel.nbd_pid,
    disconnect: Callable[[str], None] = nbdnetlink.disconnect,
) -> bool:
    """Nobody will serve the device again: NBD_CMD_DISCONNECT, so the kernel fails every
    request it holds now (a swap-in's process gets SIGBUS or is OOM-killed, a swap-out keeps
    its page) instead of after the rest of its dead-connection timeout. Only a device that is
    still ours: connected, and by the connection recorded at attach (`connection_pid`, the
    device's /sys/block/nbdN/pid), since the number is reused once it is free. True when it
    was disconnected."""
    recorded = att.extra.get("nbd_pid")
    if not (att.nbd_device and recorded and connection_pid(att.nbd_device) == recorded):
        return False
    try:
        disconnect(att.nbd_device)
    except OSError:
        return False
    return True


def _gave_up(
    state_dir: Path,
    att: attach_state.Attachment,
    why: str,
    say: Callable[[str], None],
    give_up: Callable[[attach_state.Attachment, str], None],
) -> int:
    give_up(att, why)  # first: a file written below could wait on the dead device otherwise
    supervisor_process.record_give_up(state_dir, why)
    say(
        f"giving up: {why}; {att.device}'s held requests were failed (its swapped-out pages "
        "are lost); `duvm disable --force` cleans up"
    )
    return 1


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def add_arguments(parser: Any) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=control.DEFAULT_STATE_DIR,
        help=f"as given to enable (default {control.DEFAULT_STATE_DIR})",
    )


def run(args: Any) -> int:
    """`duvm supervise` (started by `duvm enable`; rarely run by hand)."""
    systools.require_root()
    # Like the daemon: a supervisor whose own pages were swapped to the device it watches
    # could not run once that device's server is dead. The daemon it starts inherits the
    # realtime class and the I/O flusher flag from its first instruction on, so even its
    # start-up is served under memory pressure.
    daemon = control.load_daemon(args.state_dir)
    pressure.protect(
        "duvm supervise",
        realtime=pressure.realtime_wanted(daemon.daemon_args if daemon is not None else []),
    )
    # Its log is on /run too: a write waiting for a swapped-out page must not delay a resume.
    writer = quietlog.start_background(logging.INFO, "%(asctime)s %(message)s", sys.stdout)
    say = logging.getLogger("duvm.node.lifecycle.supervise").info
    # The daemon's code, loaded now while the daemon serves: a restart without a standby forks
    # this process instead of starting an interpreter that reads it from disk (warm_start).
    if missing := warm_start.preload(daemon.peers if daemon is not None else []):
        say(f"a restart will import {', '.join(missing)} itself: not importable here")
    start = warm_start.fork_daemon if warm_start.loaded() else None
    try:
        return watch(args.state_dir, say=say, start=start)
    finally:
        writer.stop()
