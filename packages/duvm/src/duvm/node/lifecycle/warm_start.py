"""A new daemon forked from the supervisor, whose interpreter has the daemon's code loaded.

Theory of operation
-------------------
Without a standby, a crash is answered by a new daemon, and most of a new daemon's start is
not its work but its interpreter's: under the QEMU guests' emulated CPU, starting Python and
reading the daemon's modules from disk took seconds while the kernel held the swap device's
requests (natively two thirds of the 0.3 s a new daemon needs to listen). So the supervisor
loads the daemon's modules when it starts (`preload`: about 3 MiB of its own memory, locked
like the rest of it), and a restart forks it (`fork_daemon`): the child shares every loaded
page with the supervisor, copies only those it writes (they are its own and locked from its
first instruction, as the daemon locks its memory with MCL_ONFAULT), and runs the daemon's
entry point with the same arguments a started daemon would get. Natively the fork skips the
0.2 s of interpreter and imports; it needs no memory a restart the usual way would not need
more of.

The child is made into a process that owes its parent nothing, in this order, before it runs
any code that could take a lock:

- its own session, stdin on /dev/null, stdout and stderr on the daemon's log;
- every other descriptor it inherited is replaced by /dev/null: it holds no socket, pidfd or
  lock of the supervisor's (a standby's socket pair kept open in it would hide the
  supervisor's end from the standby), and since the numbers stay taken, a Python object of
  the supervisor's that closes its number later never closes one of the daemon's;
- the supervisor's signal handlers and wakeup descriptor, its logging handlers (whose writer
  thread did not survive the fork) and its stdio objects are dropped for new ones;
- its command line is rewritten to read ``... -m duvm.cli daemon ...``
  (`duvm.base.proctitle`): `ps` and every check that names the daemon by its command line see
  a daemon. Where that cannot be done, the child exits before serving and the supervisor's
  next try starts the daemon the usual way.

A module the daemon imports after the fork is read from disk then, during the restart: each
one is written to the daemon's log ("imported ... after the warm start"), so a missing
preload shows.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from duvm.base import accel, proctitle
from duvm.base.units import parse_peer
from duvm.node.attach import processes

# What a daemon imports on its way to serving, beyond what the supervisor has loaded already:
# its entry module imports the rest of its start at the top; these are the ones it imports
# inside functions, its event loop, and the codec asyncio's name lookups use. The compiled
# request path is loaded as `accel` chooses it.
PRELOAD = (
    "duvm.node.daemon.daemon",
    "duvm.node.daemon.nbdserver",
    "duvm.node.daemon.status",
    "duvm.store.remote_store",
    "duvm.store.crypt_store",
    "duvm.base.control_socket",
    "uvloop",
    "encodings.idna",
    "encodings.ascii",
)
RDMA_PRELOAD = ("duvm.rdma._verbs",)  # only where a memserver is reached over RDMA
DAEMON_ENTRY = "duvm.node.daemon.daemon"
# the words of the daemon's command line that must show: the interpreter, -m duvm.cli daemon
# --resume (what `ps`, the node's checks and the QEMU guests tell a resumed daemon by)
KEEP_WORDS = 5
FAILED_TO_BECOME = 75  # the child could not become a daemon (EX_TEMPFAIL): nothing was served


def preload(peers: list[str] | None = None) -> list[str]:
    """Import what a daemon of `peers` (its memserver addresses) needs, in the supervisor;
    returns the modules that could not be imported (the child would import them itself, or
    fail as a started daemon would)."""
    missing = []
    for name in PRELOAD + (RDMA_PRELOAD if _over_rdma(peers or []) else ()):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    accel.report()  # imports each compiled module once, as the daemon's first use would
    return missing


def _over_rdma(peers: list[str]) -> bool:
    """Whether a peer may be reached over RDMA ("rdma" or "auto"; one that does not parse
    counts, as the daemon will say what is wrong with it)."""
    for peer in peers:
        try:
            if parse_peer(peer)[2] != "tcp":
                return True
        except ValueError:
            return True
    return False


def loaded() -> bool:
    """Whether a fork here can run a daemon: its entry module is imported."""
    return DAEMON_ENTRY in sys.modules


class ForkedDaemon:
    """A daemon forked from this process, with what `resume` needs of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            processes.send_signal(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.returncode


Rename = Callable[[list[str], int], list[str]]


def fork_daemon(
    cmd: list[str], log: Path, rename: Rename = proctitle.set_command_line
) -> ForkedDaemon:
    """Start the daemon `cmd` (``python -m duvm.cli daemon ARGS``, as `resume` builds it) by
    forking this process, as the module doc says; its output is appended to `log`. `rename`
    rewrites the child's command line (words, how many must show) and returns what shows."""
    if cmd[1:4] != ["-m", "duvm.cli", "daemon"]:
        raise ValueError(f"not a daemon's command line: {cmd[:4]}")
    if not loaded():
        raise RuntimeError("the daemon's code is not loaded here (preload first)")
    out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            # whatever happens, the child never returns into the supervisor's code
            code = 70
            try:
                code = _become_daemon(cmd, out, null, rename)
            except BaseException:
                _say(traceback.format_exc())
            finally:
                os._exit(code)
    finally:
        os.close(out)
        os.close(null)
    return ForkedDaemon(pid)


def _become_daemon(cmd: list[str], out: int, null: int, rename: Rename) -> int:
    """The child: the steps of the module doc, then the daemon; returns its exit code."""
    try:
        os.setsid()
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        _blank_inherited(keep=(0, 1, 2, out, null))
        os.close(out)
        os.close(null)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        logging.getLogger().handlers.clear()  # (the writer thread behind them is gone)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - they live as long as the process
        sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)  # noqa: SIM115
        shown = rename(cmd, KEEP_WORDS)
        sys.meta_path.insert(0, _LateImports())
        _say(f"--- a daemon forked from the supervisor (pid {os.getppid()}), as {' '.join(shown)}")
    except (OSError, ValueError) as exc:
        _say(f"cannot become a daemon here ({exc}): the next try starts one the usual way")
        return FAILED_TO_BECOME
    try:
        entry: Any = sys.modules[DAEMON_ENTRY]
        return int(entry.main(cmd[4:]) or 0)
    except SystemExit as exc:  # argparse's refusals
        return exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        _say(traceback.format_exc())
        return 70
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()


def _blank_inherited(keep: tuple[int, ...]) -> None:
    """Every descriptor but `keep` pointed at /dev/null (the number stays taken)."""
    null = keep[-1]
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            fcntl.fcntl(fd, fcntl.F_GETFD)
            os.dup2(null, fd, inheritable=False)


def _say(text: str) -> None:
    """A line on the daemon's log, written at once (no lock, no buffer)."""
    with contextlib.suppress(OSError):
        os.write(2, (f"duvm daemon: {text}\n").encode())


class _LateImports:
    """A finder that finds nothing: it only says which module is read after the fork (the
    import system asks the finders only for a module not in `sys.modules`)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        _say(f"imported {name} after the warm start (read from disk during the restart)")
        return None
