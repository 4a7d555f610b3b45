"""`gputaskman serve --listen ADDR:PORT`: Prometheus metrics of this machine's GPUs.

Theory of operation
-------------------
One background thread samples exactly as the TUI does: a `Collector` with the TUI's scan
budget (`collector.SCAN_BUDGET` seconds of process scanning per refresh, so a full scan is
spread over several refreshes), every ``--interval`` seconds (the TUI's default, 1 s). Each
finished sample replaces one cached reference (`exporter.Cached`). `prometheus_client`'s
HTTP server answers ``/metrics`` from its own thread by reading that reference, so a scrape
costs the formatting of one snapshot and never triggers a scan, however often Prometheus
comes. The collector is only ever touched by the sampling thread (it is not thread-safe).

Only gputaskman's own families are exported (a private registry, no Python process metrics).
What the names and labels mean is in `exporter`. SIGINT/SIGTERM stop the sampler, close the
collector and the HTTP server, and exit 0. The default address is loopback: the metrics name
processes and models, so exposing them on a network is a choice the user makes with
``--listen 0.0.0.0:PORT``, and ``--token-file`` makes every request prove a bearer token
(`cli.httpauth`). Serving off loopback without one prints a warning.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputaskman.cli.httpauth import MAKE_TOKEN, TokenError, bearer_required, read_token
from gputaskman.cli.httpauth import serve as http_serve
from gputaskman.core.exporter import Cached, SnapshotCollector

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9835"


def parse_listen(text: str) -> tuple[str, int]:
    """ADDR:PORT (IPv6 as [ADDR]:PORT; port 0 picks a free one) -> (addr, port)."""
    host, sep, port_s = text.strip().rpartition(":")
    if not sep or not port_s.isdigit():
        raise argparse.ArgumentTypeError(f"not ADDR:PORT: {text!r}")
    port = int(port_s)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, port


def is_loopback(host: str) -> bool:
    """True for a loopback address or "localhost"; a name that is not an address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, token: bool = False) -> str | None:
    """What to tell a user who serves off loopback without a token (None on loopback or with
    one): the labels carry text taken from command lines."""
    if is_loopback(host) or token:
        return None
    return (
        f"serving on {host}, off loopback: anyone who can reach this port reads process "
        "names, command-line text and model names from its labels; require a token with "
        "--token-file FILE, or put it behind a firewall"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=parse_listen,
        default=parse_listen(DEFAULT_LISTEN),
        metavar="ADDR:PORT",
        help=f"where to serve /metrics (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    parser.add_argument(
        "--sample-interval",
        dest="serve_interval",
        type=float,
        default=None,
        metavar="S",
        help="seconds between samples (default: --interval, the TUI's refresh)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require 'Authorization: Bearer TOKEN' with the token in FILE (mode 0600; make "
        f"one with: {MAKE_TOKEN})",
    )


class Sampler:
    """Samples on a background thread; `latest()` is the last finished sample or None."""

    def __init__(self, factory: Callable[[], Any], interval: float) -> None:
        self._factory = factory
        self.interval = interval
        self._latest: Cached | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gtm-sampler", daemon=True)
        self.errors = 0

    def latest(self) -> Cached | None:
        return self._latest

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        collector = self._factory()
        try:
            collector.prime()  # CPU% needs a first point
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    snap, system = collector.sample_with_system()
                    self._latest = Cached(snap, system, time.time(), time.monotonic() - t0)
                except Exception:  # keep serving the last good sample; say why in the log
                    self.errors += 1
                    log.exception("sample failed; serving the previous one")
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))
        finally:
            collector.close()


def run(args: argparse.Namespace) -> int:
    from prometheus_client import make_wsgi_app
    from prometheus_client.registry import CollectorRegistry

    from gputaskman.cli import _collector
    from gputaskman.core.collector import SCAN_BUDGET

    logging.basicConfig(level=logging.WARNING, format="gputaskman serve: %(message)s")
    interval = args.serve_interval if args.serve_interval is not None else args.interval or 1.0
    if not interval > 0:
        print("gputaskman serve: --sample-interval must be positive", file=sys.stderr)
        return 2
    host, port = args.listen
    token = None
    if args.token_file is not None:
        try:
            token = read_token(args.token_file)
        except TokenError as e:
            print(f"gputaskman serve: {e}", file=sys.stderr)
            return 2
    if warning := exposure_warning(host, token is not None):
        print(f"gputaskman serve: warning: {warning}", file=sys.stderr)
    sampler = Sampler(lambda: _collector(args, SCAN_BUDGET), interval)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(sampler.latest))
    app = make_wsgi_app(registry)
    try:
        httpd, _thread = http_serve(
            app if token is None else bearer_required(app, token), host, port
        )
    except OSError as e:
        print(
            f"gputaskman serve: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr
        )
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sampler.start()
    bound_host, bound_port = httpd.server_address[:2]
    print(
        f"gputaskman serving http://{bound_host}:{bound_port}/metrics (sampling every "
        f"{interval:g} s, scan budget {SCAN_BUDGET * 1000:.0f} ms"
        f"{', bearer token required' if token else ''})",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        sampler.stop()
        httpd.shutdown()
        httpd.server_close()
    return 0
