"""`duvm daemon`: the NBD server for the local kernel; its blocks live on memservers.

Theory of operation: the daemon reserves the whole export's capacity on the memservers first
(`RemoteStore`), and only then listens, so the kernel can never be offered a block that has
nowhere to go. It serves the store with `NBDServer` on a Unix socket (and optionally TCP on
loopback). It locks itself in RAM and lowers its OOM score where permitted, since it sits on
the swap path: if it were swapped out or killed, the pages it holds for the kernel would be
out of reach. It also runs realtime and as an I/O flusher, and logs from a writer thread, so
memory pressure cannot stall it (`duvm.base.pressure`, `duvm.base.quietlog`). SIGTERM/SIGINT stop it
cleanly: stop accepting, let in-flight requests finish and reply, then release the
reservations on every memserver.

`--memory` serves a local in-RAM store instead of memservers: the single-hop baseline of the
benchmarks and a way to try NBD clients without a pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duvm.base import accel, pressure, quietlog
from duvm.base.units import is_loopback, parse_listen, parse_peer, parse_size
from duvm.node.daemon import workers
from duvm.node.daemon.pidwatch import GuardKeeper
from duvm.store import client_flags, daemon_state, memclient_group
from duvm.store.placement import default_replicas
from duvm.store.state_files import MAX_WORKERS
from duvm.store.storage import BlockStore, StorageError
from duvm.wire import auth
from duvm.wire.nbdguard import TimerGuard
from duvm.wire.nbdtrace import RequestTrace
from duvm.wire.pageproto import PAGE_SIZE  # the one definition: the wire's page

if TYPE_CHECKING:
    from duvm.node.daemon.nbdserver import NBDServer

log = logging.getLogger("duvm.node.daemon.daemon")


class DaemonError(Exception):
    """A reason to exit non-zero with a one-line message (peer unreachable, pool full, ...)."""


class ControlStatus:
    """What the daemon's control socket answers (`duvm.base.control_socket`): its status
    (`status()`, the `DaemonStatus` as JSON) plus "swap_device", the block device serving its
    export as swap, null until told (`tell_swap_device`, called on the event loop for a
    `swap_device` request: `duvm enable`, a resume or a standby's takeover send it). This
    object is that device's one owner; it is kept in memory only, never read from a file (a
    read could wait on the swap device this process serves). And "timer_guard": the request-
    timer guard `guards` holds (`GuardKeeper.describe`), null when none was handed over."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status
        self.swap_device: str | None = None
        self.guards: GuardKeeper | None = None

    def tell_swap_device(self, device: str) -> None:
        if device != self.swap_device:
            log.info("serving swap device %s", device)
        self.swap_device = device

    def __call__(self) -> dict[str, Any]:
        guard = self.guards.describe() if self.guards is not None else None
        return {**self._status(), "swap_device": self.swap_device, "timer_guard": guard}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peers",
        metavar="[rdma://|auto://]HOST:PORT,...",
        help="memservers holding the pages (comma-separated); rdma:// moves a peer's pages by "
        "RDMA, auto:// by RDMA when both ends can (else TCP, saying why), none by TCP",
    )
    parser.add_argument(
        "--size",
        required=True,
        metavar="SIZE",
        help="export size, reserved on the memservers before serving (e.g. 4G)",
    )
    parser.add_argument(
        "--socket", required=True, metavar="PATH", help="Unix socket to serve NBD on"
    )
    parser.add_argument(
        "--tcp", metavar="HOST:PORT", help="also serve NBD on TCP (loopback only; port 0 picks one)"
    )
    parser.add_argument(
        "--export-name",
        default="",
        metavar="NAME",
        help="NBD export name (default: the default export, '')",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="memservers holding each page (default 2 when at least 2 peers, else 1)",
    )
    parser.add_argument(
        "--control-socket",
        metavar="PATH",
        help="local status socket, owner-only (default: SOCKET.ctl)",
    )
    parser.add_argument(
        "--client-id",
        metavar="ID",
        help="namespace on the memservers (default: hostname:socket path)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="serve a local in-RAM store instead of memservers (testing, benchmark baseline)",
    )
    parser.add_argument("--no-mlock", action="store_true", help="do not lock the daemon in RAM")
    parser.add_argument(
        "--heap-reserve",
        type=int,
        default=0,
        metavar="MIB",
        help="with the daemon locked in RAM: MiB of heap faulted in and kept at "
        "start, so request buffers need no page fault under memory pressure "
        "(default 0; see docs/KERNEL_NBD_QEMU.md for what it does and does not "
        "fix)",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 picks "
        "one; see duvm.node.daemon.metrics)",
    )
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep the state a restarted daemon needs (namespace token, slab "
        "map, page checksums, key) in DIR (0700; a tmpfs such as /run/duvm)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="take over from a daemon that died, from --state-dir: same "
        "namespaces on the memservers, same pages (kernel nbd then "
        "reconnects its live device; see `duvm enable --resume`)",
    )
    parser.add_argument(
        "--standby-fd",
        type=int,
        metavar="FD",
        help="stand by (with --resume): build the store now, take the device over when told "
        "on FD, one end of a socket pair (`duvm supervise` starts it; duvm.node.daemon.standby)",
    )
    parser.add_argument(
        "--standby-for",
        metavar="PID:START",
        help="the daemon a standby stands in for (its pid and start time): never taken over "
        "from while it runs",
    )
    parser.add_argument(
        "--no-realtime",
        dest="realtime",
        action="store_false",
        help="run at the normal scheduling class instead of SCHED_RR priority "
        "1 (the default, which lets the daemon's allocations dip below the min "
        "watermark so memory pressure cannot stall the swap path; see "
        "docs/ARCHITECTURE.md)",
    )
    parser.add_argument(
        "--realtime", dest="realtime", action="store_true", help=argparse.SUPPRESS
    )  # the default now; kept for old configs
    parser.add_argument(
        "--no-io-flusher",
        dest="io_flusher",
        action="store_false",
        help="do not mark the daemon as an I/O flusher (PR_SET_IO_FLUSHER, "
        "the default: its reclaim never waits on swap writes it must serve)",
    )
    parser.add_argument(
        "--oom-score-adj",
        type=int,
        default=pressure.OOM_SCORE_ADJ,
        metavar="N",
        help="the daemon's OOM score adjustment (default "
        f"{pressure.OOM_SCORE_ADJ}: killed after almost everything else; "
        "-1000 never)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="write one line per NBD request (arrival and reply times, "
        "command, offset, length, errno) to FILE, for finding where time goes "
        "(benchmarks/nbd_trace.py summarises it; about 1.5 µs per request)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="serve the export's connections in N processes (default 1; needs --state-dir, "
        "where they share the page tables): one core each, a connection each in turn "
        "(duvm.node.daemon.workers)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log connections and errors")
    client_flags.add_client_arguments(parser)  # --secret-file, --tls-*, --encrypt/--no-encrypt


def main(argv: list[str]) -> int:
    """`duvm daemon ARGV` in this process: what a daemon forked from the supervisor runs
    (`duvm.node.lifecycle.warm_start`), with the arguments a started one would get."""
    parser = argparse.ArgumentParser(prog="duvm daemon")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _fail(msg: str, code: int = 1) -> int:
    print(f"duvm daemon: {msg}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    team: workers.Workers | workers.Seat | None = None
    if args.workers != 1:  # forked before anything opens; each process protects itself below
        why = _workers_refused(args)
        if why:
            return _fail(why, 2)
        team = workers.fork_workers(args.workers)
    # Protections first, so the threads started below (the log writer) inherit the scheduling
    # class and every page touched from here on is locked. A standby prepares at normal
    # priority and turns realtime once ready (`standby._wait_and_take_over`): seconds of
    # realtime preparing would starve the kernel's workers that resend a takeover's held
    # requests, and every other task, right after the takeover that started it.
    if not args.memory:
        pressure.protect(
            "duvm daemon",
            realtime=args.realtime and args.standby_fd is None,
            mlock=not args.no_mlock,
            io_flusher=args.io_flusher,
            oom_adj=args.oom_score_adj,
        )
        # (a standby keeps its own heap once prepared; glibc is told to keep freed memory now,
        # before the log writer's thread could take an arena of its own)
        if (args.heap_reserve > 0 or args.standby_fd is not None) and not args.no_mlock:
            pressure.reserve_heap(args.heap_reserve << 20)
    else:
        pressure.lower_oom_score(args.oom_score_adj)
    logger = quietlog.start_background(
        logging.INFO if args.verbose else logging.WARNING, "duvm daemon: %(levelname)s %(message)s"
    )
    if isinstance(team, workers.Seat):
        code = 1
        try:
            code = _run_worker(args, team)
        finally:
            logger.stop()
            os._exit(code)  # a fork: never its parent's exit handlers
    try:
        return _run(args, team)
    finally:
        logger.stop()


def _workers_refused(args: argparse.Namespace) -> str | None:
    if not 1 <= args.workers <= MAX_WORKERS:
        return f"--workers must be 1..{MAX_WORKERS}, not {args.workers}"
    if args.memory:
        return "--workers serves pages held by memservers; --memory keeps them in one process"
    if not args.state_dir:
        return "--workers needs --state-dir: the workers share the page tables kept there"
    if args.standby_fd is not None:
        return "a standby for a daemon with several workers is not supported (--standby-fd)"
    return None


def _reload_on_hangup(
    store: BlockStore, secret_file: str, team: workers.Workers | None = None
) -> None:
    """Re-read the cluster secret into every memserver connection on SIGHUP (a rotation), and
    pass the signal on to the other workers, whose connections are their own."""
    clients = store.memserver_clients()

    def reload() -> None:
        log.warning("%s", memclient_group.reload_client_keyring(clients, secret_file))
        if team is not None:
            team.signal(signal.SIGHUP)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def _run_worker(args: argparse.Namespace, seat: workers.Seat) -> int:
    """Worker `seat.index` of a daemon with several (duvm.node.daemon.workers)."""
    try:
        cfg = settings_from_args(args)
    except (ValueError, auth.SecretError, OSError) as e:
        return _fail(str(e), 2)

    from duvm.node.daemon.standby import open_prepared

    async def join(generation: int) -> tuple[BlockStore, workers.Leaver]:
        standby = await open_prepared(args, cfg, repair=False, worker=seat.index)
        try:
            await standby.join(generation)
        except BaseException:
            await standby.abandon()
            raise
        if args.secret_file:
            _reload_on_hangup(standby.store, args.secret_file)
        return standby.store, standby

    return _run_loop(workers.serve_as_worker(seat, join, args.export_name))


@dataclass(frozen=True)
class Settings:
    """The daemon's flags, checked and resolved once (the argparse namespace stays as given)."""

    size: int
    peers: list[tuple[str, int]]
    transports: list[str]  # each peer's: tcp, rdma or auto (base.units.parse_peer)
    tcp: tuple[str, int] | None
    replicas: int
    client_id: str
    security: auth.PeerSecurity | None  # how every memserver connection authenticates


def settings_from_args(args: argparse.Namespace) -> Settings:
    """ValueError, auth.SecretError or OSError (TLS files) with a reason."""
    size = parse_size(args.size)
    if size <= 0 or size % PAGE_SIZE:
        raise ValueError(f"--size must be a positive multiple of {PAGE_SIZE} bytes")
    parsed = [parse_peer(p) for p in (args.peers or "").split(",") if p.strip()]
    peers = [(h, p) for h, p, _ in parsed]
    if not peers and not args.memory:
        raise ValueError("--peers is required (or --memory for a local in-RAM store)")
    tcp = parse_listen(args.tcp) if args.tcp else None
    if tcp is not None and not is_loopback(tcp[0]):
        raise ValueError(f"--tcp must be a loopback address, not {tcp[0]}")
    replicas = args.replicas if args.replicas is not None else default_replicas(len(peers))
    if replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if args.metrics:
        parse_listen(args.metrics)  # a bad address fails before anything starts
    if args.resume and not args.state_dir:
        raise ValueError("--resume needs --state-dir (where the dead daemon kept its state)")
    if args.state_dir and args.memory:
        raise ValueError("--state-dir keeps memserver state; --memory has none to keep")
    if args.standby_fd is not None and not (args.resume and args.standby_for):
        raise ValueError("--standby-fd stands in for a daemon: it needs --resume and --standby-for")
    if args.standby_for is not None and args.standby_fd is None:
        raise ValueError(
            "--standby-for names the daemon a standby stands in for: it needs --standby-fd"
        )
    if args.standby_for is not None and not re.fullmatch(r"\d+(:\d+)?", args.standby_for):
        raise ValueError(f"--standby-for takes PID:START (numbers), not {args.standby_for!r}")
    return Settings(
        size=size,
        peers=peers,
        transports=[t for _, _, t in parsed],
        tcp=tcp,
        replicas=replicas,
        client_id=args.client_id or f"{socket.gethostname()}:{os.path.abspath(args.socket)}",
        security=client_flags.client_security_from_args(args, peers),
    )


def _run(args: argparse.Namespace, team: workers.Workers | None = None) -> int:
    try:
        cfg = settings_from_args(args)
    except (ValueError, auth.SecretError) as e:
        return _fail(str(e), 2)
    except OSError as e:  # ssl.SSLError included: unreadable or bad certificate files
        return _fail(f"cannot load TLS files: {e}", 2)
    if cfg.replicas == 1 and not args.memory:
        log.warning(
            "--replicas 1: a memserver that dies or restarts takes its pages with it "
            "(the programs that own them get I/O errors); use 2 or more peers"
        )
    try:
        if args.standby_fd is not None:
            from duvm.node.daemon import standby

            return _run_loop(standby.stand_by(args, cfg, serve))
        return _run_loop(_serve(args, cfg, team))
    except DaemonError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot serve on {args.socket}: {e.strerror or e}")


def _run_loop(coro) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def open_store(
    args: argparse.Namespace, cfg: Settings
) -> tuple[BlockStore, daemon_state.Persisted | None]:
    """The store to serve (reserved on the memservers, or local RAM with --memory) and, with
    --state-dir, the files that let a restarted daemon serve it again."""
    if args.memory:
        from duvm.store.memory_store import MemoryStore

        return MemoryStore(cfg.size), None
    from duvm.store.remote_store import RemoteStore

    if args.state_dir:  # state on files: a restarted daemon (--resume) serves the same pages
        try:
            return await daemon_state.open_store(
                Path(args.state_dir),
                cfg.peers,
                cfg.size,
                cfg.client_id,
                cfg.replicas,
                encrypt=client_flags.encryption_wanted(args, cfg.peers),
                resume=args.resume,
                readahead=args.workers == 1,
                repair=args.workers == 1,  # D49: the workers' writes do not reach a copy
                export_name=args.export_name,
                security=cfg.security,
                transports=cfg.transports,
            )
        except (StorageError, ValueError, daemon_state.StateError) as e:
            raise DaemonError(getattr(e, "reason", None) or str(e)) from None
        except OSError as e:
            raise DaemonError(f"cannot keep state in {args.state_dir}: {e}") from None
    try:
        store = await RemoteStore.open(
            cfg.peers,
            cfg.size,
            cfg.client_id,
            replicas=cfg.replicas,
            security=cfg.security,
            transports=cfg.transports,
        )
    except (StorageError, ValueError) as e:  # unreachable peer, pool full: one clear line
        raise DaemonError(getattr(e, "reason", None) or str(e)) from None
    if client_flags.encryption_wanted(args, cfg.peers):
        from duvm.store.crypt_store import CryptStore

        return CryptStore(store), None  # pages leave this node sealed; the key never does
    return store, None


async def _serve(
    args: argparse.Namespace, cfg: Settings, team: workers.Workers | None = None
) -> int:
    trace = None
    if getattr(args, "trace", None):  # opened first: a bad path fails before reserving
        try:
            trace = RequestTrace(args.trace)
        except OSError as e:
            raise DaemonError(
                f"cannot write the trace to {args.trace}: {e.strerror or e}"
            ) from None
    try:
        return await _serve_store(args, cfg, trace, team)
    finally:
        if trace is not None:
            trace.close()


async def _serve_store(
    args: argparse.Namespace,
    cfg: Settings,
    trace: RequestTrace | None,
    team: workers.Workers | None = None,
) -> int:
    from duvm.node.daemon.nbdserver import NBDServer

    store, persisted = await open_store(args, cfg)
    server = NBDServer(store, args.export_name)
    server.trace = trace
    return await serve(args, cfg, store, persisted, server, team=team)


async def serve(
    args: argparse.Namespace,
    cfg: Settings,
    store: BlockStore,
    persisted: daemon_state.Persisted | None,
    server: NBDServer,
    say: Callable[[str], None] | None = None,
    listen: Callable[[], Awaitable[None]] | None = None,
    settle: Callable[[], Awaitable[None]] | None = None,
    control_sock: socket.socket | None = None,
    guards: GuardKeeper | None = None,
    team: workers.Workers | None = None,
) -> int:
    """Serve `store` (reserved, or taken over by a standby) through `server` until SIGTERM or
    SIGINT, then stop cleanly: in-flight requests answered, the reservations released, the
    state forgotten. `say` announces that it serves (default: a line on stdout, written by a
    thread of its own, `quietlog.Aside`, as the metrics line is: never by the loop). A standby
    passes `listen` (serve on its socket bound ahead, instead of binding `--socket` now),
    `control_sock` (its control socket, bound ahead too) and `settle` (awaited once it serves):
    then nothing here touches a file on /run, where another task may hold a lock while it
    waits for the device this process serves; and the request-timer guard it holds (`guards`,
    `duvm.node.daemon.pidwatch`), which a `timer_guard` request replaces. `team`: the other
    workers of a daemon with several, started here once the store is open and stopped before
    anything is released."""
    aside = quietlog.Aside()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if getattr(args, "secret_file", None):  # secret rotation: re-read on SIGHUP
        _reload_on_hangup(store, args.secret_file, team)
    try:
        if args.metrics:  # Prometheus exposition; NBD latencies observed from here on
            from duvm.node.daemon import metrics

            try:
                bound = metrics.start(server, args.metrics)
            except OSError as e:
                raise DaemonError(
                    f"cannot serve metrics on {args.metrics}: {e.strerror or e}"
                ) from None
            aside.write(f"duvm daemon metrics on http://{bound[0]}:{bound[1]}/metrics")
        if team is not None and persisted is not None:
            try:  # a worker that cannot join must not cost the device its daemon
                await team.start(persisted.tables.generation)
            except workers.WorkerError as e:
                log.error("%s; worker 0 serves every connection alone", e)
            server.spreader = team
        if listen is not None:
            await listen()
        else:
            await server.start_unix(args.socket)
        where = f"unix:{args.socket}"
        if cfg.tcp is not None:
            host, port = await server.start_tcp(*cfg.tcp)
            where += f" tcp:{host}:{port}"
        backend = store.describe()
        from duvm.base import control_socket
        from duvm.node.daemon.status import daemon_status

        line = (
            f"duvm daemon serving export {args.export_name!r} ({cfg.size} bytes, {backend}) "
            f"on {where}"
        )
        if team is not None:
            pids = " ".join(map(str, [os.getpid(), *team.pids]))
            line += f" with {args.workers} workers (pids {pids})"
        ctl_path = args.control_socket or control_socket.default_path(args.socket)
        path = accel.announce(log).path
        replicas = None if args.memory else cfg.replicas

        def pids() -> list[int] | None:
            return None if team is None else [os.getpid(), *team.pids]

        report = ControlStatus(
            lambda: daemon_status(store, server, replicas, path, pids()).to_json()
        )
        report.guards = guards = guards or GuardKeeper()
        ctl = await control_socket.start(
            ctl_path,
            report,
            control_sock,
            on_swap_device=report.tell_swap_device,
            on_timer_guard=lambda obj: guards.take(TimerGuard.from_json(obj)),
        )
        (say or aside.write)(line)
        if settle is not None:
            await settle()
        await stop.wait()
        guards.close()  # a clean stop: `duvm disable` ends the supervisor first
        ctl.close()
        # asyncio leaves the socket file: gone with the daemon, so nobody reads a stale one
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ctl_path)
        log.info("stopping: finishing in-flight requests")
    finally:
        await server.close()
        if team is not None:
            await team.stop()  # every worker's writes answered before anything is released
        await store.close()  # a RemoteStore RELEASEs its reservations on every memserver
        if persisted is not None:
            persisted.discard()  # released: nothing is left to resume
    return 0
