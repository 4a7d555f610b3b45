"""`duvm enable --resume`: bring a crashed daemon back onto its live kernel nbd device.

Theory of operation
-------------------
``duvm enable`` attaches kernel nbd over netlink with a dead-connection timeout and starts the
daemon with ``--state-dir`` (``STATE_DIR/daemon-state``), where the daemon keeps what it needs
to serve its pages again (:mod:`duvm.store.daemon_state`). When the daemon dies (SIGKILL, OOM, a
crash), the kernel marks the connection dead and holds the swap device's requests for that
timeout. This command, run by hand or by a supervisor (systemd ``Restart=``/``ExecStart``):

1. checks that an attachment exists, its daemon is dead and the device is still connected;
2. starts ``duvm daemon ... --resume`` with the recorded arguments: same client id and
   namespace token, so the memservers (which keep a dead client's namespace for their lease)
   hand back the namespaces with every page; same slab map, checksums and key;
3. waits for the daemon's socket, performs the NBD handshake on a new connection and gives it
   to the device with ``NBD_CMD_RECONFIGURE``; the kernel resends what the old daemon left
   unanswered, and the swapping programs continue.

If anything fails the new daemon is stopped again, without releasing anything: the pages stay
on the memservers for the rest of their lease and a second try may still succeed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Protocol

from duvm.base import control_socket
from duvm.node.attach import attach_kernel, attach_state, processes, systools
from duvm.node.lifecycle import control
from duvm.node.lifecycle.supervisor_process import keeps_state

RESUME_LOCK = ".resume.lock"


def with_state_dir(daemon_args: list[str], state_dir: Path) -> list[str]:
    """`daemon_args` plus `--state-dir`, unless the user already chose one."""
    if keeps_state(daemon_args):
        return list(daemon_args)
    return [*daemon_args, "--state-dir", str(control.daemon_state_dir(state_dir))]


def resume_command(info: control.DaemonInfo) -> list[str]:
    if info.client_id is None:
        raise control.ControlError("the daemon record has no client id; cannot resume")
    if not keeps_state(info.daemon_args):
        raise control.ControlError(
            "the daemon was started without --state-dir, so its pages "
            "cannot be served again: `duvm disable --force`, then "
            "enable again"
        )
    # --resume first: a daemon forked from the supervisor shows only the words that fit in
    # the supervisor's command line (warm_start), and `ps` should tell a resumed one
    return [
        sys.executable,
        "-m",
        "duvm.cli",
        "daemon",
        "--resume",
        "--socket",
        info.socket,
        "--peers",
        ",".join(info.peers),
        "--size",
        str(info.size),
        "--client-id",
        info.client_id,
        "--replicas",
        str(info.replicas),
        *info.daemon_args,
    ]


Records = tuple[attach_state.Attachment, control.DaemonInfo]


class Started(Protocol):
    """A daemon process just started: a Popen, or a `warm_start.ForkedDaemon`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int | None: ...


Starter = Callable[[list[str], Path], Started]


def resume(
    state_dir: Path,
    timeout: float = 120.0,
    known: Records | None = None,
    start: Starter = processes.spawn_detached,
    reattach: Callable[[attach_state.Attachment], None] = attach_kernel.reattach,
) -> tuple[control.DaemonInfo, attach_state.Attachment]:
    """Restart the dead daemon of `state_dir` and reattach its live device (see above).
    One at a time: the supervisor and a manual `--resume` wait for each other here, and the
    second then finds the daemon running. `start` starts the daemon's command line with its
    log (the supervisor forks its own loaded code: `warm_start`); `reattach` gives the device
    a connection to it.

    `known`: the attachment and daemon records as the caller read them while the daemon lived
    (the supervisor). The files on /run may have been swapped out since, to the very device
    whose server is now dead, and reading them back would wait for it: so they are not read
    again. The daemon log is not appended to either; the new daemon writes a new one."""
    systools.require_root()
    if not state_dir.is_dir():
        raise control.ControlError(
            f"duvm is not enabled with state in {state_dir}; nothing to resume (use `duvm enable`)"
        )
    with resume_lock(state_dir) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _resume(state_dir, timeout, known, start, reattach)


def _resume(
    state_dir: Path,
    timeout: float,
    known: Records | None,
    start: Starter,
    reattach: Callable[[attach_state.Attachment], None],
) -> tuple[control.DaemonInfo, attach_state.Attachment]:
    att, old = known if known is not None else (None, None)
    if att is None:
        att = attach_state.load_state(control.state_path(state_dir))
    if att is None:
        raise control.ControlError(
            f"duvm is not enabled with state in {state_dir}; nothing to resume (use `duvm enable`)"
        )
    if att.method != attach_state.METHOD_KERNEL or not att.nbd_netlink:
        raise control.ControlError(
            f"{att.device or att.method} is attached via "
            f"{att.method if att.method != attach_state.METHOD_KERNEL else 'nbd ioctls'}, which "
            "cannot take a restarted daemon (that needs kernel nbd over netlink): "
            "`duvm disable --force`, then enable again"
        )
    if old is None:
        old = control.load_daemon(state_dir)
    if old is None:
        raise control.ControlError(f"no daemon record in {state_dir}; cannot resume")
    if control.daemon_alive(old):
        raise control.ControlError(f"the daemon (pid {old.pid}) still runs; nothing to resume")
    cmd = resume_command(old)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(old.socket)  # the dead daemon's socket would look ready
    log = Path(old.log)
    # The dead daemon's log is kept as LOG.1; appending to it could need a swapped-out page.
    with contextlib.suppress(FileNotFoundError):
        os.replace(log, log.with_name(log.name + ".1"))
    with open(log, "w") as f:
        f.write(f"--- duvm enable --resume at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
    proc = start(cmd, log)
    info = control.DaemonInfo(
        proc.pid,
        old.socket,
        old.peers,
        old.size,
        old.replicas,
        old.log,
        time.time(),
        old.client_id,
        list(old.daemon_args),
        processes.start_time(proc.pid),
    )
    control.daemon_path(state_dir).write_text(json.dumps(asdict(info)) + "\n")
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(info.socket):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = (
                    "exited" if proc.returncode is not None else f"not ready after {timeout:.0f} s"
                )
                # (not read by the supervisor: the log is on /run, whose pages may be out on
                # the very device that waits for this daemon)
                tail = f"see {log}" if known else log.read_text(errors="replace")[-1500:].strip()
                raise control.ControlError(f"the resumed daemon {why}: {tail}")
            time.sleep(0.02)
        reattach(att)
    except BaseException:
        # never SIGTERM: a clean stop would RELEASE the pages the live device still needs
        proc.kill()  # its own child: it reaps no one else's pid
        proc.wait(10)
        raise
    att.extra["daemon_pid"] = proc.pid
    att.extra["resumed"] = int(att.extra.get("resumed", 0) or 0) + 1  # type: ignore[call-overload]
    attach_state.save_state(control.state_path(state_dir), att)
    # served again: its status names the device (a failure is only logged)
    control_socket.try_tell_swap_device(control_socket.default_path(info.socket), att.device)
    return info, att


class Successor(Protocol):
    """A daemon already running that can take a dead one's device over (a standby,
    `duvm.node.lifecycle.standby_process.Standby`)."""

    pid: int
    log: Path

    def take_over(self) -> str:
        """Serve the dead daemon's store; returns the socket it listens on."""
        ...

    def kept(self) -> bool:
        """Whether the connection just handed to the device is still held by the device."""
        ...

    def handed(self) -> None:
        """The device has a connection to it: it may take the daemon's socket name."""
        ...

    def kill(self) -> None:
        """SIGKILL (never SIGTERM: a clean stop would RELEASE the pages)."""
        ...


# The kernel's driver takes a new connection only in place of one it has marked dead, which
# its receive worker does once it reads the dead daemon's end of file; given one before that,
# it drops it and still answers success. The supervisor and the standby run realtime, so they
# can get there first: each retry sleeps, which lets that worker run.
HAND_RETRY_S = 0.02
HAND_WITHIN_S = 5.0


def _hand_until_kept(
    att: attach_state.Attachment,
    path: str,
    successor: Successor,
    reattach: Callable[[attach_state.Attachment, str], None],
    within_s: float = HAND_WITHIN_S,
) -> int:
    """Give the device connections to `successor` at `path` until one is kept (it says so);
    returns how many were given. ControlError when none was kept within `within_s`."""
    deadline = time.monotonic() + within_s
    tries = 0
    while True:
        reattach(att, path)
        tries += 1
        if successor.kept():
            return tries
        if time.monotonic() >= deadline:
            raise control.ControlError(
                f"{att.device} did not keep a connection to the standby in {within_s:g} s "
                f"({tries} given)"
            )
        time.sleep(HAND_RETRY_S)


def adopt(
    state_dir: Path,
    known: Records,
    successor: Successor,
    lock: IO[Any],
    reattach: Callable[[attach_state.Attachment, str], None] = attach_kernel.reattach,
) -> tuple[control.DaemonInfo, attach_state.Attachment]:
    """Hand the live device to `successor` once it serves (`reattach` gives the device a
    connection to it): the fast resume, with no process started and no file opened before
    the device is served again (`lock` is the resume lock, opened beforehand; other users of
    /run may be waiting for the device). Same lock and same records as `resume`."""
    systools.require_root()
    att, old = known
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        if control.daemon_alive(old):
            raise control.ControlError(f"the daemon (pid {old.pid}) still runs; nothing to resume")
        path = successor.take_over()
        try:
            _hand_until_kept(att, path, successor, reattach)
        except BaseException:
            successor.kill()
            raise
        successor.handed()
        for final in (old.socket, control_socket.default_path(old.socket)):
            with contextlib.suppress(FileNotFoundError):  # the daemon's names, stale ones replaced
                os.replace(final + control_socket.STANDBY_SUFFIX, final)
        pid = successor.pid
        # Its log stays where it is (renaming it would wait for the inode lock its writer
        # thread may hold while that waits for a page the device has not given back yet), and
        # the record is a new file renamed over the old (truncating the old could wait for a
        # page of it being read back).
        info = control.DaemonInfo(
            pid,
            old.socket,
            old.peers,
            old.size,
            old.replicas,
            str(successor.log),
            time.time(),
            old.client_id,
            list(old.daemon_args),
            processes.start_time(pid),
        )
        record = control.daemon_path(state_dir)
        fresh = record.with_name(f".{record.name}.{os.getpid()}")
        fresh.write_text(json.dumps(asdict(info)) + "\n")
        os.replace(fresh, record)
        att.extra["daemon_pid"] = pid
        att.extra["resumed"] = int(att.extra.get("resumed", 0) or 0) + 1  # type: ignore[call-overload]
        att.extra["taken_over"] = int(att.extra.get("taken_over", 0) or 0) + 1  # type: ignore[call-overload]
        attach_state.save_state(control.state_path(state_dir), att)
        # once the device is served again and the sockets have the daemon's names: its
        # status names the device (a failure is only logged; its socket is there already)
        control_socket.try_tell_swap_device(
            control_socket.default_path(info.socket), att.device, wait=False
        )
        return info, att
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)


def resume_lock(state_dir: Path) -> IO[Any]:
    """The lock `resume` and `adopt` take, opened (for a supervisor to keep open)."""
    return open(state_dir / RESUME_LOCK, "a")
