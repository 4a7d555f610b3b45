"""Several processes serving one device: `duvm daemon --workers N` (DECISIONS.md D49).

One Python process is one core. Kernel nbd spreads a device's requests over several
connections (one blk-mq hardware queue each) and fio's NBD engine opens one per job, so a
daemon with N workers serves its connections in N processes:

- **Worker 0** is the daemon as it is with one: it opens (or resumes) the store and owns the
  slab map and its saved copy, the reservations, repair, the control socket and the metrics. It
  accepts every connection and hands each, in turn, to the next worker (itself included) over a
  socket pair (SCM_RIGHTS): N connections opened together land one per worker.
- **Workers 1..N-1** are forked before anything is opened (each locks its own memory: locks
  are not inherited), wait for worker 0's go with the generation it serves, then open the store
  from the state directory as a standby does and join that generation
  (`daemon_state.Standby.join`): connections of their own to every memserver, in worker 0's
  namespaces.
- **Shared, with one writer per entry**: the per-page tables are the state directory's shared
  mapping; swap serialises a page's I/O under its page lock, so two workers never write one
  page's entry at once (clients that write one page from two connections at once get either
  write, or the page read as an error: never other bytes, since its tag or checksum is the last
  writer's). Each worker seals with nonces from a counter slot of its own
  (`daemon_state.PersistentCryptStore`), so no nonce repeats under the shared key. No
  readahead: a window held by one worker could not see another worker's write.
- **Not shared yet**: a replica one worker finds failed is dropped by that worker alone (its
  reads then judge every copy by the shared tables, so a copy another worker still wrote is
  checked, never trusted); only worker 0 saves the map, and nobody repairs (a copy made by
  worker 0 would miss the other workers' writes during it), so a slab that lost a copy stays
  degraded until the daemon restarts with one worker. A slab whose every copy is lost is
  placed again by each worker that meets it, perhaps on different memservers: its later
  pages read as errors from the other workers (never as other bytes).
- **Per worker**: the metrics, the trace and the counters `duvm status` shows are worker 0's;
  SIGHUP (a new cluster secret) reaches worker 0, which passes it on.
- **Lifetimes**: a worker dies with worker 0 (PR_SET_PDEATHSIG, and end of file on its socket
  pair), so a restart resumes with N new workers. Worker 0 stops every worker before it
  releases anything. A worker that dies alone leaves the rotation and its connections drop;
  the kernel reports a kernel nbd one dead and the supervisor hands the device a new one
  (D51), which a live worker then serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from duvm.base.libc import libc
from duvm.node.daemon.nbdconnection import NBDConnection
from duvm.node.daemon.nbdserver import NBDServer
from duvm.store.storage import BlockStore

log = logging.getLogger("duvm.workers")

GO = b"go "  # then the generation worker 0 serves, in decimal
READY = b"ready"
FAILED = b"failed "  # then why
CONN = b"conn"  # with one descriptor: a connection to serve
STOP = b"stop"
_PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 120.0  # a worker opening its connections to every memserver
STOP_TIMEOUT_S = 30.0  # a worker finishing its requests in flight


class WorkerError(Exception):
    """A worker could not start; the message says which and why."""


class Leaver(Protocol):
    """What a worker holds on the memservers, let go of without freeing anything."""

    async def leave(self) -> None: ...


@dataclass
class Seat:
    """In a worker: its index and its end of the socket pair to worker 0."""

    index: int
    sock: socket.socket


class _Child:
    """A worker as worker 0 knows it: `alive` while in the rotation; `reaped` once its exit
    status is collected (its pid may then name another process: never signalled again)."""

    __slots__ = ("alive", "index", "pid", "reaped", "sock")

    def __init__(self, index: int, pid: int, sock: socket.socket) -> None:
        self.index, self.pid, self.sock = index, pid, sock
        self.alive = True
        self.reaped = False

    def reap(self) -> bool:
        """Collect the exit status if the worker has ended; True once collected."""
        if not self.reaped:
            try:
                self.reaped = os.waitpid(self.pid, os.WNOHANG)[0] == self.pid
            except ChildProcessError:
                self.reaped = True
        return self.reaped


def fork_workers(n: int) -> Workers | Seat:
    """Fork workers 1..n-1 of this daemon. In worker 0 (this process) the `Workers`, in each
    child its `Seat`. Call before anything is opened: a child inherits every descriptor."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(n - 1)]
    parent = os.getpid()
    children: list[_Child] = []
    for index, (mine, theirs) in enumerate(pairs, start=1):
        pid = os.fork()
        if pid == 0:
            try:
                libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != parent:  # worker 0 died before the line above
                    os._exit(0)
                for a, b in pairs:  # worker 0's ends, and the other workers' pairs
                    a.close()
                    if b is not theirs:
                        b.close()
                return Seat(index, theirs)
            except BaseException:
                os._exit(70)
        theirs.close()
        children.append(_Child(index, pid, mine))
    return Workers(children)


class Workers:
    """Worker 0's view of its workers: starting them, handing them connections (an
    `nbdserver.ConnectionSpreader`), stopping them."""

    def __init__(self, children: list[_Child]) -> None:
        self._children = children
        self._turn = 0
        self._stopping = False  # asked to stop: a worker ending is no longer news

    @property
    def pids(self) -> list[int]:
        """The workers running now (worker 0 not included)."""
        return [c.pid for c in self._children if c.alive]

    async def start(self, generation: int, timeout: float = READY_TIMEOUT_S) -> None:
        """Tell every worker to join `generation` and wait until each serves. WorkerError
        (every worker ended) when one cannot."""
        loop = asyncio.get_running_loop()
        for c in self._children:
            c.sock.setblocking(False)
            await loop.sock_sendall(c.sock, GO + str(generation).encode())
        for c in self._children:
            try:
                reply = await asyncio.wait_for(loop.sock_recv(c.sock, 4096), timeout)
            except (TimeoutError, OSError) as e:
                reply = FAILED + (str(e) or "no answer in time").encode()
            if reply != READY:
                self.kill()
                why = reply[len(FAILED) :] if reply.startswith(FAILED) else b"ended"
                raise WorkerError(f"worker {c.index} cannot serve: {why.decode(errors='replace')}")
            loop.add_reader(c.sock.fileno(), self._heard, c)

    def _heard(self, c: _Child) -> None:
        """A worker's socket pair is readable: it only ever ends (a worker says nothing once
        it serves), so the worker died."""
        with contextlib.suppress(BlockingIOError):
            if c.sock.recv(64):
                return
        self._gone(c)

    def _gone(self, c: _Child) -> None:
        if not c.alive:
            return
        c.alive = False
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(c.sock.fileno())
        c.sock.close()
        self._collect(c)
        if not self._stopping:
            log.error("worker %d (pid %d) ended; its connections are gone", c.index, c.pid)

    def _collect(self, c: _Child, tries: int = 100) -> None:
        """Reap a worker that closed its end: it may still be exiting, so look again later."""
        if not c.reap() and tries:
            asyncio.get_running_loop().call_later(0.05, self._collect, c, tries - 1)

    def take(self) -> Callable[[socket.socket], bool] | None:
        """Who serves the next accepted connection: None for worker 0 itself, else a function
        that hands the socket to the worker whose turn it is (False when it cannot)."""
        live = [c for c in self._children if c.alive]
        turn = self._turn % (len(live) + 1)
        self._turn += 1
        if turn == 0:
            return None
        c = live[turn - 1]
        return lambda sock: self._give(c, sock)

    def _give(self, c: _Child, sock: socket.socket) -> bool:
        if not c.alive:
            return False
        try:
            socket.send_fds(c.sock, [CONN], [sock.fileno()])
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ECONNREFUSED):
                log.error("cannot hand a connection to worker %d: %s", c.index, e)
            self._gone(c)
            return False
        return True

    def signal(self, sig: int) -> None:
        """Send `sig` to every worker running."""
        for c in self._children:
            if c.alive and not c.reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, sig)

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every worker: each finishes its requests in flight and closes its connections,
        freeing nothing; one still running after `timeout` is killed."""
        self._stopping = True
        for c in self._children:
            if c.alive:
                with contextlib.suppress(OSError):
                    c.sock.send(STOP)
        deadline = time.monotonic() + timeout
        for c in self._children:
            while not c.reap() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        self.kill()

    def kill(self) -> None:
        """End every worker not yet collected (SIGKILL) and collect it."""
        for c in self._children:
            if not c.reaped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(c.pid, 0)
                c.reaped = True
            if c.alive:
                c.alive = False
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    asyncio.get_running_loop().remove_reader(c.sock.fileno())
                c.sock.close()


async def serve_as_worker(
    seat: Seat,
    join: Callable[[int], Awaitable[tuple[BlockStore, Leaver]]],
    export_name: str,
) -> int:
    """Worker `seat.index`: wait for worker 0's go, `join` the generation it names (the store,
    and what to leave when done), then serve every connection worker 0 hands over until it
    says stop, ends, or this process gets SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = seat.sock
    sock.setblocking(False)
    msg = await loop.sock_recv(sock, 4096)
    if not msg.startswith(GO):
        return 0  # worker 0 ended before it served
    try:
        store, held = await join(int(msg[len(GO) :]))
    except Exception as e:
        log.error("worker %d cannot join: %s", seat.index, e)
        with contextlib.suppress(OSError):
            await loop.sock_sendall(sock, FAILED + str(e).encode()[:4000])
        return 1
    server = NBDServer(store, export_name)
    receiving = asyncio.ensure_future(_receive(sock, server, stop))
    try:
        await loop.sock_sendall(sock, READY)
        await stop.wait()
    finally:
        receiving.cancel()
        await server.close()
        await held.leave()
    return 0


async def _receive(sock: socket.socket, server: NBDServer, stop: asyncio.Event) -> None:
    """Serve each connection worker 0 hands over; set `stop` when it says so or ends."""
    loop = asyncio.get_running_loop()
    while True:
        ready = loop.create_future()
        loop.add_reader(sock.fileno(), lambda f=ready: f.done() or f.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
        except BlockingIOError:
            continue
        except OSError:
            msg, fds = b"", []
        if msg == CONN and len(fds) == 1:
            conn = socket.socket(fileno=fds[0])
            conn.setblocking(False)
            await loop.connect_accepted_socket(lambda: NBDConnection(server), sock=conn)
            continue
        for fd in fds:
            os.close(fd)
        if msg in (STOP, b""):
            stop.set()
            return
        log.error("unexpected message from worker 0: %r", msg[:32])
