"""`gputaskman serve`'s server: the sampling thread, the two routes (Prometheus metrics of
this machine's GPUs, and its snapshot document for `gputaskman fleet`) and their HTTP server;
the command line that starts it is `cli.serve`.

Theory of operation
-------------------
One background thread samples exactly as the TUI does: a `Collector` with the TUI's scan
budget (`collector.SCAN_BUDGET` seconds of process scanning per refresh, so a full scan is
spread over several refreshes), every ``--interval`` seconds (the TUI's default, 1 s). Each
finished sample replaces one cached reference (`exporter.Cached`). The HTTP server
(`httpserve`) answers ``/metrics`` from its own threads by reading that reference, so a scrape
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

import json
import logging
import signal
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputaskman.base.netaddr import is_loopback
from gputaskman.render import report
from gputaskman.render.exporter import Cached, SnapshotCollector
from gputaskman.serve.httpauth import MAKE_TOKEN, TokenError, read_token, server_tls_context
from gputaskman.serve.httpserve import Response, Route
from gputaskman.serve.httpserve import serve as http_serve

log = logging.getLogger(__name__)


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


def security(
    token_file: Path | None, tls_cert: Path | None, tls_key: Path | None, tls_client_ca: Path | None
) -> tuple[str | None, ssl.SSLContext | None]:
    """The token and TLS context the files ask for; TokenError says why they cannot be used."""
    token = None if token_file is None else read_token(token_file)
    tls = None
    if tls_cert is not None or tls_key is not None or tls_client_ca is not None:
        if tls_cert is None or tls_key is None:
            raise TokenError("TLS needs both --tls-cert and --tls-key")
        tls = server_tls_context(tls_cert, tls_key, tls_client_ca)
    return token, tls


@dataclass
class Running:
    """A started server: the sampling thread and the HTTP server answering from it."""

    sampler: Sampler
    httpd: Any
    stopping: threading.Event = field(default_factory=threading.Event)

    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def stop_on_signals(self) -> None:
        """Make SIGINT and SIGTERM end `wait` (call from the main thread, before saying the
        server is up, so a signal sent right after that is not a default kill)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())

    def wait(self) -> None:
        """Serve until `stopping` is set (see `stop_on_signals`), then stop the sampler and
        the HTTP server."""
        try:
            # Woken once a second, not only by the signal: a signal the kernel delivers to
            # another of this process's threads (the HTTP or sampler thread) sets Python's flag
            # but does not interrupt an untimed wait here, so `serve` slept on through SIGTERM.
            while not self.stopping.wait(1.0):
                pass
        finally:
            self.close()

    def close(self) -> None:
        self.sampler.stop()
        self.httpd.shutdown()
        self.httpd.server_close()


def start(
    factory: Callable[[], Any],
    interval: float,
    host: str,
    port: int,
    *,
    selected_gpu: int | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> Running:
    """Bind ``/metrics`` and ``/snapshot.json`` on `host`:`port` and start sampling with
    `factory`'s collector every `interval` seconds. Raises OSError when it cannot listen."""
    from prometheus_client.registry import CollectorRegistry

    sampler = Sampler(factory, interval)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(sampler.latest))
    routes = {
        "/metrics": metrics_route(registry),
        "/snapshot.json": SnapshotDocument(sampler.latest, selected_gpu),
    }
    httpd, _thread = http_serve(routes, host, port, token=token, tls=tls)
    sampler.start()
    return Running(sampler, httpd)


def url_host(host: str) -> str:
    """`host` as it goes into a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
