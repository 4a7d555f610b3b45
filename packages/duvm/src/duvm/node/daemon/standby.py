"""`duvm daemon --standby-fd FD`: a daemon started ahead of time that takes a dead daemon's
device over without starting, reading or allocating what the node may not have then.

Theory of operation
-------------------
When the daemon dies, the kernel holds every request for its swap device until a new server
gets the device (`NBD_CMD_RECONFIGURE`). A restart then has to start Python, import, read its
state and connect to the memservers, in a node that may have no free memory (nothing can be
swapped out while no daemon serves) and no kernel thread to spare: seconds under emulation, and
a hung node when the memory is not there (docs/ARCHITECTURE.md, "A daemon that dies"). So
`duvm supervise` keeps this second daemon running beside the first, and:

1. Before the daemon dies (`duvm.store.daemon_state.open_standby`): the protections of every
   process on the swap path (`duvm.base.pressure`: locked, I/O flusher; realtime, every
   thread, only once ready: preparing is seconds of CPU under emulation, which at realtime
   priority would starve the kernel's workers resending a takeover's held requests), a heap of
   `HEAP_RESERVE_MIB` faulted in and kept (glibc keeps freed memory, so what the takeover
   allocates comes from resident, locked pages), the modules of the serving path imported,
   the page tables mapped shared (it sees every write of the living daemon), the store and its
   encryption built, and a connection open to every memserver, joined to the daemon's
   namespaces (which keeps them out of their lease once the daemon is gone), the NBD server
   built and its socket bound and listening at ``SOCKET.standby``. Then it says
   ``ready RSS_KIB ANON_KIB`` on FD and waits.
2. ``takeover`` on FD: it checks that the daemon it stands in for (``--standby-for PID:START``,
   watched through a pidfd) is gone, reads the nonce counter again and the slab map if it was
   saved since (the daemon went on changing both), restores the reservations, serves on its
   socket and says ``serving RSS_KIB_THEN RSS_KIB_NOW MS PATH``; `duvm supervise` hands the
   device a connection to PATH and says ``check``, answered ``kept`` when a client still holds
   a connection to it or ``dropped`` when none does (the kernel's driver drops a connection it
   is given before it has marked the dead daemon's dead, and answers success: the supervisor
   then hands it another), then says ``handed`` and gives its sockets (NBD and control, both
   bound before, with the suffix ``.standby``) the daemon's names. The event loop touches no
   file on /run in all this: another task may hold a lock there while it waits for the very
   device this loop serves (seen in a QEMU guest: a log writer waiting for a swap-in held the
   log's inode lock, a rename waited on it holding the directory's, and the event loop's own
   rename waited on that). From then on it is the daemon, and SIGTERM stops it as one (its
   reservations released).
3. ``guard JSON`` on FD, any time before the takeover: the request-timer guard
   (`duvm.wire.nbdguard`). The standby watches the supervisor it names, and when that ends
   (SIGKILLed with the daemon, say) puts the device's request timeout back, so the requests of
   the dead daemon end by the kernel's timers instead of waiting for ever. It keeps the guard
   when it becomes the daemon.
4. ``stop`` or EOF on FD (the supervisor is gone) or SIGTERM before a takeover: it exits and
   releases nothing: the pages belong to the device the daemon serves (on EOF it first waits up to
   `SUPERVISOR_END_WAIT_S` for the supervisor's end, to keep its guard).

A takeover that cannot be done (the daemon still runs, the state now belongs to another
device, some slab has no copy on a memserver it can reach) answers ``refused REASON`` and exits
1; the supervisor then starts a daemon the slow way. Its log lines go through the writer thread
(`duvm.base.quietlog`): a log file on /run may be swapped out while it waits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from duvm.base import control_socket, pressure
from duvm.base.control_socket import STANDBY_SUFFIX
from duvm.node.daemon.pidwatch import GuardKeeper, Watched
from duvm.store import daemon_state
from duvm.store.storage import StorageError
from duvm.wire.nbdguard import TimerGuard

log = logging.getLogger("duvm.node.daemon.standby")
log.setLevel(logging.INFO)  # its few lines say when it stood by and took over: always logged

# Heap kept for the takeover (`pressure.reserve_heap`). Measured: a takeover of a 512 MiB
# device with two memservers grows the process by far less (docs/BENCHMARKS.md, "Daemon crash").
HEAP_RESERVE_MIB = 8

READY, TAKEOVER, SERVING, REFUSED = b"ready", b"takeover", b"serving", b"refused"
STOP = b"stop"  # the supervisor ends it on purpose (EOF alone: the supervisor ended)
# after each connection the supervisor hands the device: does its client (the kernel) hold it?
CHECK, KEPT, DROPPED = b"check", b"kept", b"dropped"
GUARD = b"guard "  # then the request-timer guard as JSON (`duvm.wire.nbdguard`)
# A SIGKILLed supervisor closes its end before its pidfd turns readable: so long is waited for
# that on EOF before the standby exits (`GuardKeeper.settle`).
SUPERVISOR_END_WAIT_S = 1.0
HANDED_TIMEOUT_S = 60.0  # for the supervisor's "handed" once it serves


class Link:
    """The standby's end of the socket pair `duvm supervise` holds: one word per line."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self._buf = b""

    def say(self, word: bytes, *rest: object) -> None:
        line = b" ".join([word, *(str(r).encode() for r in rest)]) + b"\n"
        with contextlib.suppress(OSError):  # a supervisor gone: nobody to tell
            self.sock.send(line)

    async def command(self) -> bytes | None:
        """The next line (without its newline), None at EOF."""
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            try:
                data = await loop.sock_recv(self.sock, 256)
            except OSError:
                return None
            if not data:
                return None
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return line.strip()

    def close(self) -> None:
        self.sock.close()


def _warm(standby: daemon_state.Standby, heap: bool) -> None:
    """Fault in now what the takeover would: the modules serving imports on first use (the
    compiled ones too, which `accel.report` loads, and every page of their code), every page
    of the mapped tables (present in the ramfs, but each first touch maps it), and, with
    `heap`, `HEAP_RESERVE_MIB` of free heap on top of what preparing used."""
    from duvm.base import accel
    from duvm.node.daemon import nbd_transmission, status  # noqa: F401

    accel.report()
    # the compiled modules' code: the request path runs parts the standby never ran
    pressure.touch_mappings(lambda path: "/duvm/" in path and path.endswith(".so"))
    standby.state.tables.touch()
    if heap:
        pressure.reserve_heap(HEAP_RESERVE_MIB << 20)


Serve = Callable[..., Awaitable[int]]


async def open_prepared(args: argparse.Namespace, cfg: Any, **options: Any) -> daemon_state.Standby:
    """The store of the device that `args` and `cfg` (the daemon's `Settings`) describe, built
    from its state directory with its connections open: a standby's, or a worker's (`options`:
    `daemon_state.open_standby`'s `repair` and `worker`)."""
    return await daemon_state.open_standby(
        Path(args.state_dir),
        cfg.peers,
        cfg.size,
        cfg.client_id,
        cfg.replicas,
        export_name=args.export_name,
        security=cfg.security,
        transports=cfg.transports,
        **options,
    )


async def stand_by(args: argparse.Namespace, cfg: Any, serve: Serve) -> int:
    """The standby's life (see the module docstring); `serve` is `duvm.node.daemon.daemon.serve`,
    which runs the daemon once the device is taken over."""
    link = Link(args.standby_fd)
    watched = Watched(args.standby_for)
    loop = asyncio.get_running_loop()
    quit_ = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, quit_.set)
    try:
        standby = await open_prepared(args, cfg)
    except (StorageError, ValueError, daemon_state.StateError, OSError) as e:
        why = getattr(e, "reason", None) or str(e)
        log.error("standby: cannot stand by: %s", why)
        link.say(REFUSED, why)
        return 1
    try:
        return await _wait_and_take_over(args, cfg, serve, standby, link, watched, quit_)
    finally:
        watched.close()
        link.close()


async def _wait_and_take_over(
    args: argparse.Namespace,
    cfg: Any,
    serve: Serve,
    standby: daemon_state.Standby,
    link: Link,
    watched: Watched,
    quit_: asyncio.Event,
) -> int:
    from duvm.node.daemon.nbdserver import NBDServer

    server = NBDServer(standby.store, args.export_name)
    listening = control_socket.bind(args.socket + STANDBY_SUFFIX)
    ctl = control_socket.bind(
        (args.control_socket or control_socket.default_path(args.socket)) + STANDBY_SUFFIX
    )
    _warm(standby, heap=not args.no_mlock)
    if args.realtime and (why := pressure.become_realtime(every_thread=True)) is not None:
        log.warning("standby: %s: under memory pressure it may wait like every other task", why)
    ready, ready_anon = pressure.rss_kib(), pressure.rss_kib(field="RssAnon")
    link.say(READY, ready, ready_anon)
    log.info(
        "standby for daemon pid %d: ready (%s KiB resident), connected to %d memserver(s)",
        watched.pid,
        ready,
        len(standby.remote.clients),
    )
    guards = GuardKeeper()
    while isinstance(word := await _first(link.command(), quit_.wait()), bytes):
        if not word.startswith(GUARD):
            break
        _take_guard(guards, word)
    if word != TAKEOVER:
        if word is None:
            guards.settle(SUPERVISOR_END_WAIT_S)
        guards.close()
        said = {True: "stopped", None: "the supervisor is gone", STOP: "told to stop"}
        why = said.get(word) or word.decode(errors="replace")
        log.info("standby: %s; exits without releasing anything", why)
        for sock in (listening, ctl):
            with contextlib.suppress(OSError):
                os.unlink(sock.getsockname())
            sock.close()
        await standby.abandon()
        return 0
    t0 = time.perf_counter()
    told = pressure.rss_kib()  # (what it holds may have moved since it said ready)
    why = None
    if not watched.gone():
        why = f"the daemon pid {watched.pid} still runs"
    else:
        try:
            await standby.take_over()
        except Exception as e:  # whatever it is, the supervisor must hear it and go on
            why = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
    if why is not None:
        guards.close()
        log.error("standby: cannot take over: %s", why)
        link.say(REFUSED, why)
        listening.close()
        ctl.close()
        await standby.abandon()
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().remove_signal_handler(sig)

    async def listen() -> None:
        await server.start_unix_bound(listening, args.socket + STANDBY_SUFFIX)

    def serving(line: str) -> None:
        ms = round((time.perf_counter() - t0) * 1000, 1)
        now, anon = pressure.rss_kib(), pressure.rss_kib(field="RssAnon")
        link.say(SERVING, told, now, ms, args.socket + STANDBY_SUFFIX)
        log.info(
            "standby took over in %.1f ms (resident %s KiB when ready, %s when told, %s now; "
            "anonymous %s when ready, %s now): %s",
            ms,
            ready,
            told,
            now,
            ready_anon,
            anon,
            line,
        )

    async def settle() -> None:
        """Once the supervisor has handed the device a connection (it then gives the sockets
        the daemon's names, from its own process: a rename waits for locks on /run that
        another task may hold while it waits for the device this event loop serves)."""
        while True:
            try:
                word = await asyncio.wait_for(link.command(), HANDED_TIMEOUT_S)
            except TimeoutError:
                break
            if word != CHECK:
                break
            link.say(KEPT if server.clients_holding() else DROPPED)
        link.close()
        server.renamed_unix(args.socket + STANDBY_SUFFIX, args.socket)

    return await serve(
        args,
        cfg,
        standby.store,
        standby.state,
        server,
        serving,
        listen=listen,
        settle=settle,
        control_sock=ctl,
        guards=guards,
    )


def _take_guard(guards: GuardKeeper, line: bytes) -> None:
    """``guard JSON``: the request-timer guard the supervisor hands its standby."""
    try:
        guards.take(TimerGuard.from_json(json.loads(line[len(GUARD) :])))
    except ValueError as e:  # (json's errors are ValueErrors too)
        log.error("standby: a malformed guard from the supervisor ignored: %s", e)


async def _first(*aws: Awaitable[Any]) -> Any:
    """The result of whichever of `aws` finishes first (the others are cancelled)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*pending, return_exceptions=True)
    return next(iter(done)).result()
