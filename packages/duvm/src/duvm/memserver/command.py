"""`duvm memserver`: serve this node's spare RAM to the pool as a page store.

Its flags, the security they configure (refusing a network address with no authentication),
the capacity checked against this node's available memory, and the process around a
`MemServer`: metrics, the local control socket, signals (SIGHUP re-reads the secrets) and the
event loop (uvloop when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from duvm.base import accel
from duvm.base.units import is_loopback, parse_listen, parse_size
from duvm.memserver.pagestore import DEFAULT_LEASE_S
from duvm.memserver.server import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HANDSHAKES,
    MemServer,
)
from duvm.wire import auth
from duvm.wire.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)
T = TypeVar("T")


class MetricsError(Exception):
    """--metrics cannot be served (port taken, bad address); the message says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="address to listen on (port 0 picks a free port)",
    )
    parser.add_argument(
        "--capacity",
        required=True,
        metavar="SIZE",
        help="RAM to serve, e.g. 512M or 4G (preallocated at start)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="SECONDS",
        help=f"how long a disconnected client's pages are kept (default {DEFAULT_LEASE_S:g})",
    )
    parser.add_argument("--no-mlock", action="store_true", help="do not lock the arena in RAM")
    parser.add_argument(
        "--rdma",
        choices=("auto", "on", "off"),
        default="auto",
        help="also serve one-sided RDMA on the same address and port (rdma-cm): auto when a "
        "verbs device and the compiled transport are here (default), on to fail without "
        "them, off for TCP only",
    )
    sec = parser.add_argument_group("security (see README: Security)")
    sec.add_argument(
        "--secret-file",
        metavar="PATH",
        help="cluster secret(s), one per line, mode 0600 (`duvm secret generate`); "
        "every client must prove one. SIGHUP re-reads it (rotation)",
    )
    sec.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate")
    sec.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    sec.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="cluster CA: clients must present a certificate it signed (mutual "
        "TLS; authenticates clients without --secret-file)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving a non-loopback address without any authentication",
    )
    sec.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"authenticated connections (default {DEFAULT_MAX_CONNECTIONS})",
    )
    sec.add_argument(
        "--max-handshakes",
        type=int,
        default=DEFAULT_MAX_HANDSHAKES,
        metavar="N",
        help="unauthenticated connections; the oldest is dropped beyond this "
        f"(default {DEFAULT_MAX_HANDSHAKES})",
    )
    sec.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time to authenticate (default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
    )
    sec.add_argument(
        "--idle-timeout",
        type=float,
        metavar="SECONDS",
        help="close authenticated connections idle this long (default: never; a "
        "swap device may rightly be idle for hours)",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 picks "
        "one; see duvm.memserver.metrics)",
    )
    parser.add_argument(
        "--control-socket",
        metavar="PATH",
        help='local status socket, owner-only (JSON lines, `{"cmd": '
        '"status"}`): what this node lends and to whom, e.g. for gputaskman '
        "(e.g. /run/duvm/memserver.ctl)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every connection")


def security_from_args(
    args: argparse.Namespace, host: str
) -> tuple[auth.Keyring | None, ssl.SSLContext | None]:
    """Keyring and TLS context from the flags; ValueError/SecretError/OSError with a reason.
    Refuses to serve a network address with no authentication unless --insecure."""
    keyring = auth.Keyring.from_file(args.secret_file) if args.secret_file else None
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = auth.server_tls_context(args.tls_cert, args.tls_key, args.tls_ca)
    elif args.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    if keyring is None and not args.tls_ca and not is_loopback(host) and not args.insecure:
        raise ValueError(
            f"refusing to serve {host} without authentication: pass --secret-file "
            "(or --tls-cert/--tls-key/--tls-ca), or --insecure to accept any peer"
        )
    return keyring, tls


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


async def _serve(
    server: MemServer,
    host: str,
    port: int,
    secret_file: str | None = None,
    metrics: str | None = None,
    control: str | None = None,
    rdma: str = "off",
) -> None:
    if metrics:  # Prometheus exposition; request latencies observed from here on
        from duvm.memserver import metrics as m

        try:
            mb = m.start(server, metrics)
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {metrics}: {e.strerror or e}") from None
        print(f"duvm memserver metrics on http://{mb[0]}:{mb[1]}/metrics", flush=True)
    ctl = None
    if control:  # what this node lends, to whom: for local readers such as gputaskman
        from duvm.base import control_socket

        ctl = await control_socket.start(control, server.local_status)
    bound = await server.start(host, port)
    if rdma != "off":
        server.start_rdma(bound[0], bound[1], required=rdma == "on")
    rdma_note = (
        f"rdma {server.rdma.device or 'yes'}"
        if server.rdma is not None
        else "rdma off"
        if rdma == "off"
        else "rdma no"
    )
    if server.rdma is None and rdma == "auto":
        log.info("serving TCP only: %s", server.rdma_error)
    use = server.usage()
    print(
        f"duvm memserver listening on {bound[0]}:{bound[1]} "
        f"capacity {use.capacity_pages} pages ({use.capacity_pages * PAGE_SIZE >> 20} MiB) "
        f"locked {'yes' if use.arena_locked else 'no'} lease {server.store.lease_s:g}s "
        f"auth {server.security_status()['auth']} tls {'yes' if server.tls else 'no'} "
        f"{rdma_note}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if secret_file:
        loop.add_signal_handler(signal.SIGHUP, _reload_secrets, server, secret_file)
    try:
        await stop.wait()
    finally:
        if ctl is not None:
            ctl.close()
            with contextlib.suppress(OSError):
                os.unlink(control)  # type: ignore[arg-type]
        await server.close()


def _reload_secrets(server: MemServer, path: str) -> None:
    try:
        keyring = auth.Keyring.from_file(path)
    except auth.SecretError as e:
        log.error("SIGHUP: keeping the old secrets: %s", e)
        return
    server.set_keyring(keyring)
    log.warning("SIGHUP: re-read %s: %d secret(s) accepted", path, len(keyring.secrets))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="duvm memserver: %(levelname)s %(message)s",
    )
    try:
        host, port = parse_listen(args.listen)
        capacity = parse_size(args.capacity)
        if capacity < PAGE_SIZE:
            raise ValueError(f"capacity {args.capacity!r} is less than one page ({PAGE_SIZE} B)")
        if args.lease <= 0:
            raise ValueError("--lease must be positive")
        keyring, tls = security_from_args(args, host)
    except (ValueError, auth.SecretError) as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 2
    except (OSError, ssl.SSLError) as e:
        print(f"duvm memserver: cannot load TLS files: {e}", file=sys.stderr)
        return 2
    available = mem_available()
    if available is not None and capacity > available:
        # Populating more than the free RAM would push this node into swap or the OOM killer.
        print(
            f"duvm memserver: --capacity {args.capacity} ({capacity >> 20} MiB) exceeds this "
            f"node's available memory ({available >> 20} MiB)",
            file=sys.stderr,
        )
        return 1
    try:
        server = MemServer(
            capacity,
            lease_s=args.lease,
            lock=not args.no_mlock,
            keyring=keyring,
            tls=tls,
            max_connections=args.max_connections,
            max_handshakes=args.max_handshakes,
            handshake_timeout=args.handshake_timeout,
            idle_timeout=args.idle_timeout,
        )
    except (MemoryError, ValueError) as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 1
    if not args.no_mlock and server.usage().arena_locked:
        # Every node of a symmetric cluster swaps too: a memserver whose own pages went out to
        # this node's duvm device would wait on other nodes' memservers to serve its peers,
        # which may be waiting on it. Locked (and an I/O flusher), it never waits on swap.
        # Last in the OOM killer's list, like the daemon: it holds pages that are on no other
        # copy but its replica's, and it is the biggest process on a node that serves itself,
        # where the kernel would otherwise pick it first (that score also keeps it out of the
        # supervisor's choice when it makes room for a restart: duvm.node.lifecycle.room).
        # Not realtime: it is not on this node's swap path, and a busy memserver would then
        # take CPU from the node's own programs (duvm.base.pressure).
        from duvm.base import pressure

        if why := pressure.lock_in_memory():
            log.warning("cannot lock the memserver in RAM (%s): it may be swapped out", why)
        pressure.become_io_flusher()
        if why := pressure.lower_oom_score():
            log.warning(
                "the OOM killer may pick the memserver (%s; lowering it needs CAP_SYS_RESOURCE)",
                why,
            )
    accel.announce(log)  # a warning when the pure-Python loop runs for want of a build
    try:
        run_loop(
            _serve(
                server,
                host,
                port,
                args.secret_file,
                metrics=args.metrics,
                control=args.control_socket,
                rdma=args.rdma,
            )
        )
    except MetricsError as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"duvm memserver: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
