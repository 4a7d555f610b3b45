"""`gputaskman serve --listen ADDR:PORT`: Prometheus metrics of this machine's GPUs, and its
snapshot document for `gputaskman fleet`.

Theory of operation
-------------------
One background thread samples exactly as the TUI does: a `Collector` with the TUI's scan
budget (`collector.SCAN_BUDGET` seconds of process scanning per refresh, so a full scan is
spread over several refreshes), every ``--interval`` seconds (the TUI's default, 1 s). Each
finished sample replaces one cached reference (`exporter.Cached`). `prometheus_client`'s
HTTP server answers ``/metrics`` from its own thread by reading that reference, so a scrape
costs the formatting of one snapshot and never triggers a scan, however often Prometheus
comes. The collector is only ever touched by the sampling thread (it is not thread-safe).

Two read-only endpoints answer from that reference (`httpserve`, HTTP/1.1 with keep-alive):

* ``/metrics``: gputaskman's own families (a private registry, no Python process metrics);
  what the names and labels mean is in `exporter`.
* ``/snapshot.json``: the snapshot document, exactly what ``gputaskman --json`` prints
  (`report.to_json_dict`, compact), built once per sample however many clients ask; 503
  until the first sample exists. `gputaskman fleet` polls it, with ``If-None-Match``: a
  sample it already has costs a bodiless 304.

There is no write endpoint of any kind. SIGINT/SIGTERM stop the sampler, close the collector
and the HTTP server, and exit 0.

The default address is loopback. Both endpoints name processes, command-line text and
models, so off loopback `serve` refuses to start unless every request must prove itself:
a bearer token (``--token-file``, `httpauth`) or TLS with client certificates
(``--tls-cert``, ``--tls-key`` and ``--tls-client-ca``). A refused request gets a bare 401
(or, without a client certificate, no TLS session at all) and learns nothing about the host.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gputaskman.base.netaddr import is_loopback
from gputaskman.cli import serve_sources
from gputaskman.cli.httpauth import MAKE_TOKEN, TokenError, read_token, server_tls_context
from gputaskman.cli.httpserve import Response, Route
from gputaskman.cli.httpserve import serve as http_serve
from gputaskman.core import report
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


def exposure_refusal(host: str, token: bool = False, client_certs: bool = False) -> str | None:
    """Why `serve` must not start on `host` (None on loopback, or when every request must
    prove itself): the endpoints carry text taken from command lines."""
    if is_loopback(host) or token or client_certs:
        return None
    return (
        f"refusing to serve on {host}, off loopback, without authentication: anyone who can "
        "reach this port would read process names, command-line text, model names and the "
        f"whole snapshot document. Require a token with --token-file FILE (make one with: "
        f"{MAKE_TOKEN}), or TLS with client certificates (--tls-cert, --tls-key and "
        "--tls-client-ca), or listen on loopback"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=parse_listen,
        default=parse_listen(DEFAULT_LISTEN),
        metavar="ADDR:PORT",
        help=f"where to serve /metrics and /snapshot.json (default {DEFAULT_LISTEN}; port 0 "
        "picks a free one; off loopback a token or TLS client certificates are required)",
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
    parser.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="serve HTTPS with this certificate"
    )
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="the certificate's key")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="require a client certificate signed by this CA (with --tls-cert)",
    )
    serve_sources.add_arguments(parser)


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


class SnapshotDocument:
    """``/snapshot.json``: the latest sample's document, encoded once per sample. Its ETag
    names the sample (when it finished), so a poller that already has it gets a bodiless
    304 for ``If-None-Match``."""

    def __init__(self, latest: Callable[[], Cached | None], selected_gpu: int | None) -> None:
        self.latest = latest
        self.selected_gpu = selected_gpu
        self._lock = threading.Lock()
        self._for: Cached | None = None
        self._body = b""
        self._etag = ""

    def __call__(self, headers: Mapping[str, str]) -> Response:
        c = self.latest()
        if c is None:
            return Response(503, b"no sample yet\n", headers=(("Retry-After", "1"),))
        with self._lock:
            if c is not self._for:
                doc = report.to_json_dict(c.snapshot, c.system, self.selected_gpu)
                self._body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
                self._etag = f'"{c.sampled_at:.6f}"'
                self._for = c
            body, etag = self._body, self._etag
        if headers.get("If-None-Match") == etag:
            return Response(304, b"", "application/json", (("ETag", etag),))
        return Response(200, body, "application/json", (("ETag", etag),))


def metrics_route(registry: Any) -> Route:
    """``/metrics``: the exposition format the scraper asks for (`choose_encoder`)."""
    from prometheus_client.exposition import choose_encoder

    def metrics(headers: Mapping[str, str]) -> Response:
        encoder, content_type = choose_encoder(headers.get("Accept") or "")
        return Response(200, encoder(registry), content_type)

    return metrics


def _security(args: argparse.Namespace) -> tuple[str | None, ssl.SSLContext | None]:
    """The token and TLS context `args` ask for; TokenError says why they cannot be used."""
    token = None if args.token_file is None else read_token(args.token_file)
    tls = None
    if args.tls_cert is not None or args.tls_key is not None or args.tls_client_ca is not None:
        if args.tls_cert is None or args.tls_key is None:
            raise TokenError("TLS needs both --tls-cert and --tls-key")
        tls = server_tls_context(args.tls_cert, args.tls_key, args.tls_client_ca)
    return token, tls


def run(args: argparse.Namespace) -> int:
    from prometheus_client.registry import CollectorRegistry

    from gputaskman.core.collector import SCAN_BUDGET
    from gputaskman.core.document import SnapshotError

    logging.basicConfig(level=logging.WARNING, format="gputaskman serve: %(message)s")
    interval = args.serve_interval if args.serve_interval is not None else args.interval or 1.0
    if not interval > 0:
        print("gputaskman serve: --sample-interval must be positive", file=sys.stderr)
        return 2
    host, port = args.listen
    try:
        token, tls = _security(args)
    except TokenError as e:
        print(f"gputaskman serve: {e}", file=sys.stderr)
        return 2
    refusal = exposure_refusal(host, token is not None, args.tls_client_ca is not None)
    if refusal:
        print(f"gputaskman serve: {refusal}", file=sys.stderr)
        return 2
    if args.demo and args.replay:
        print("gputaskman serve: --demo and --replay name two sources: give one", file=sys.stderr)
        return 2
    try:
        factory = serve_sources.source_factory(args)
    except (OSError, SnapshotError) as e:
        print(f"gputaskman serve: --replay: {e}", file=sys.stderr)
        return 2
    sampler = Sampler(factory, interval)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(sampler.latest))
    routes = {
        "/metrics": metrics_route(registry),
        "/snapshot.json": SnapshotDocument(sampler.latest, args.gpu),
    }
    try:
        httpd, _thread = http_serve(routes, host, port, token=token, tls=tls)
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
    scheme = "https" if tls is not None else "http"
    guard = ", bearer token required" if token else ""
    if args.tls_client_ca is not None:
        guard += ", client certificate required"
    print(
        f"gputaskman serving {scheme}://{_url_host(str(bound_host))}:{bound_port}/metrics and "
        f"/snapshot.json (sampling every {interval:g} s, scan budget "
        f"{SCAN_BUDGET * 1000:.0f} ms{guard})",
        flush=True,
    )
    try:
        # Woken once a second, not only by the signal: a signal the kernel delivers to another
        # of this process's threads (the HTTP or sampler thread) sets Python's flag but does
        # not interrupt an untimed wait here, so `serve` slept on through SIGTERM.
        while not stop.wait(1.0):
            pass
    finally:
        sampler.stop()
        httpd.shutdown()
        httpd.server_close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
