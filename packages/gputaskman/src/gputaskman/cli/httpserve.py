"""`gputaskman serve`'s HTTP server: read-only routes, keep-alive, a bearer token, optional TLS.

Theory of operation
-------------------
A `ThreadingHTTPServer` answers each connection on its own daemon thread with `_Handler`, an
HTTP/1.1 handler: a client that keeps its connection (Prometheus, `gputaskman fleet` polling
every second) pays for one TCP (and TLS) handshake, not one per request. Every answer carries
a Content-Length, so the connection can carry the next request.

Only GET and HEAD exist. The routes (`Route`: request headers -> `Response`) are read-only by
construction: nothing a request carries reaches a route but its headers, and any other
method is answered 405 (after the token check, so an unauthenticated client learns nothing).
With a token, every request must prove it first (`httpauth.bearer_ok`); a refused request,
a path that does not exist, a malformed request and a method that is not allowed all get a
bare status line and one word: no host name, no software version (``Server: gputaskman``),
no metrics.

Limits, so a client cannot hold the server: at most `MAX_CONNECTIONS` connections at once
(more are closed on accept), `IDLE_TIMEOUT_S` for any read (an idle keep-alive connection or a
slow client is dropped), request lines and headers capped by `http.server`'s own limits. With
TLS the handshake happens on the connection's thread, under the same timeout, so a client
that never finishes one does not stall the accept loop.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from gputaskman.cli.httpauth import bearer_ok

MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 15.0
GZIP_MIN_BYTES = 4096  # below this, compressing costs more than it saves
LINGER_S = 2.0  # a refused TLS client gets this long to read the alert and close


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Route = Callable[[Mapping[str, str]], Response]


def _word(status: int) -> bytes:
    return HTTPStatus(status).phrase.lower().encode() + b"\n"


def _close_after_alert(conn: ssl.SSLSocket) -> None:
    """End a connection whose TLS handshake failed so that the client reads why. With TLS 1.3
    the client has finished its side and sent its request before the server refuses its
    certificate; closing with that request unread makes the kernel send a reset, which can
    destroy the alert before the client reads it (the client then sees a bare reset, not the
    refusal: 1 poll in 100 under load). So: FIN after the alert, then read until the client
    closes (at most LINGER_S), then close. The TLS layer is gone: the plain socket's calls."""
    deadline = time.monotonic() + LINGER_S
    with contextlib.suppress(OSError):
        socket.socket.shutdown(conn, socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if not socket.socket.recv(conn, 65536):
                break


class _Handler(BaseHTTPRequestHandler):
    server_version = "gputaskman"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    server: _Server

    def version_string(self) -> str:
        return self.server_version  # the Server header: never a Python or library version

    def handle(self) -> None:
        # a client that went away or failed its TLS handshake: nothing to answer
        with contextlib.suppress(OSError):
            if isinstance(self.connection, ssl.SSLSocket):
                try:
                    self.connection.do_handshake()  # under the timeout `setup` set
                except ssl.SSLError:
                    _close_after_alert(self.connection)
                    return
            super().handle()

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _refuse_method(self) -> None:
        if self._authorized():
            self._send(
                Response(
                    HTTPStatus.METHOD_NOT_ALLOWED, _word(405), headers=(("Allow", "GET, HEAD"),)
                )
            )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse_method

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None or bearer_ok(self.headers.get("Authorization"), token):
            return True
        self._send(
            Response(
                HTTPStatus.UNAUTHORIZED,
                b"unauthorized\n",
                headers=(("WWW-Authenticate", "Bearer"),),
            )
        )
        return False

    def _answer(self, *, send_body: bool) -> None:
        if not self._authorized():
            return
        route = self.server.routes.get(urlsplit(self.path).path)
        if route is None:
            self._send(Response(HTTPStatus.NOT_FOUND, _word(404)))
            return
        resp = route(self.headers)
        body = resp.body
        headers = list(resp.headers)
        wants_gzip = "gzip" in (self.headers.get("Accept-Encoding") or "")
        if wants_gzip and len(body) >= GZIP_MIN_BYTES and resp.status == 200:
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        self._send(Response(resp.status, body, resp.content_type, tuple(headers)), send_body)

    def _send(self, resp: Response, send_body: bool = True) -> None:
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in resp.headers:
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(resp.body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """`http.server`'s own refusals (a malformed request line, an unknown method, headers
        too long): bare, like every other refusal, and the connection closes."""
        self.close_connection = True
        try:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(_word(code))))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(_word(code))
        except (OSError, ValueError):
            pass

    def log_message(self, format: str, *args: Any) -> None:  # a scrape a second: no log
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # socketserver's 5 makes a burst of connects wait seconds

    def __init__(
        self,
        address: tuple[Any, ...],
        routes: Mapping[str, Route],
        token: str | None,
        tls: ssl.SSLContext | None,
        family: socket.AddressFamily,
    ) -> None:
        self.address_family = family
        self.routes = dict(routes)
        self.token = token
        self.tls = tls
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own would look this host's name up in DNS, for nothing we use
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        if self.tls is not None:  # handshake later, on the connection's own thread
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many connections: this one is closed
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a broken connection is that client's problem; nothing to print


def serve(
    routes: Mapping[str, Route],
    host: str,
    port: int,
    *,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve `routes` on host:port (IPv4 or IPv6, as the address is) from a daemon thread.
    Raises OSError when the address cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    httpd = _Server(addr, routes, token, tls, family)
    thread = threading.Thread(target=httpd.serve_forever, name="gtm-http", daemon=True)
    thread.start()
    return httpd, thread
