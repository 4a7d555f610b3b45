"""`gputaskman serve`'s HTTP server: read-only routes, keep-alive, a bearer token, optional TLS.

Theory of operation
-------------------
HTTP/1.1 is h11's (python-hyper/h11, sans-io): `HttpConnection` holds one client connection's
`h11.Connection` and turns the bytes the client sends into the bytes to send back, one answer
at a time, without touching a socket; h11 reads the requests (framing, pipelining, keep-alive,
HTTP/1.0 clients) and writes the answers. `_Handler` is the thin socket driver around it: a
`socketserver` threading server answers each connection on its own daemon thread, so a client
that keeps its connection (Prometheus, `gputaskman fleet` polling every second) pays for one
TCP (and TLS) handshake, not one per request. Every answer carries a Content-Length, so the
connection can carry the next request. A request costs about twice what `http.server` took
(some 75 µs against 37: DECISIONS.md D45), a few a second per client: not a hot path.

Only GET and HEAD exist. The routes (`Route`: request headers -> `Response`) are read-only by
construction: nothing a request carries reaches a route but its headers (`RequestHeaders`,
looked up in any case), and the other methods HTTP names are answered 405 (after the token
check, so an unauthenticated client learns nothing); a method HTTP does not name is 501. With
a token, every request must prove it first (`httpauth.bearer_ok`); a refused request, a path
that does not exist, a malformed request and a method that is not allowed all get a bare
status line and one word: no host name, no software version (``Server: gputaskman``), no
metrics. A malformed request, a method HTTP does not name and a request that carries a body
(never read: nothing here takes one) are answered and the connection closes.

Limits, so a client cannot hold the server: at most `MAX_CONNECTIONS` connections at once
(more are closed on accept), `IDLE_TIMEOUT_S` for any read (an idle keep-alive connection or a
slow client is dropped), a request line and headers that are not whole within
`MAX_REQUEST_HEAD` buffered bytes refused with 431 (h11's own cap on incomplete input; one
read adds at most `RECV_BYTES`), and one answer in memory at a time however many requests a
client pipelines. With TLS the handshake happens on the connection's thread, under the same
timeout, so a client that never finishes one does not stall the accept loop.
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import h11

from gputaskman.serve.httpauth import bearer_ok

MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 15.0
MAX_REQUEST_HEAD = 16 * 1024  # request line and headers
GZIP_MIN_BYTES = 4096  # below this, compressing costs more than it saves
LINGER_S = 2.0  # a refused TLS client gets this long to read the alert and close
RECV_BYTES = 65536
SERVER = "gputaskman"  # the Server header: never a Python or library version
# the methods HTTP names: 405 once authorized; any other is 501
_OTHER_METHODS = frozenset({b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE", b"CONNECT"})


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


class RequestHeaders(Mapping[str, str]):
    """A request's headers by name in any case; a repeated header's values joined by ", "."""

    __slots__ = ("_by_name",)

    def __init__(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        by_name: dict[str, str] = {}
        for raw_name, raw_value in pairs:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            by_name[name] = f"{by_name[name]}, {value}" if name in by_name else value
        self._by_name = by_name

    def __getitem__(self, name: str) -> str:
        return self._by_name[name.lower()]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


Route = Callable[[Mapping[str, str]], Response]


def _word(status: int) -> bytes:
    return HTTPStatus(status).phrase.lower().encode() + b"\n"


def _status(hint: int) -> int:
    """h11's suggested status for a request it refused, if it is an error HTTP names."""
    try:
        HTTPStatus(hint)
    except ValueError:
        return 400
    return hint if 400 <= hint < 600 else 400


class HttpConnection:
    """One client connection's HTTP, sans-io: `receive_data` takes what the client sent (b""
    when it closed), `next_answer` returns the bytes of the next answer (b"" when it needs more
    data), and `closing` says that the connection ends once those are sent."""

    def __init__(self, routes: Mapping[str, Route], token: str | None) -> None:
        self.routes = routes
        self.token = token
        self.closing = False
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)

    def receive_data(self, data: bytes) -> None:
        self._h11.receive_data(data)

    def next_answer(self) -> bytes:
        conn = self._h11
        while not self.closing:
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()  # keep-alive: the next request
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:  # malformed, too long, or cut short
                return self._refusal(_status(exc.error_status_hint))
            if event is h11.NEED_DATA:
                return b""
            if isinstance(event, h11.Request):
                return self._answer(event)
            if isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                self.closing = True  # PAUSED: a request after one this connection closes on
            # Data of a body nobody reads (the answer closes the connection), EndOfMessage
        return b""

    def _answer(self, req: h11.Request) -> bytes:
        headers = RequestHeaders(req.headers)
        method = req.method
        if method not in (b"GET", b"HEAD") and method not in _OTHER_METHODS:
            return self._refusal(HTTPStatus.NOT_IMPLEMENTED)
        # a body is never read: answer it, then close rather than read it as the next request
        close = "content-length" in headers and headers["content-length"] != "0"
        close = close or "transfer-encoding" in headers
        resp = self._refused(headers)
        if resp is None and method not in (b"GET", b"HEAD"):
            resp = Response(
                HTTPStatus.METHOD_NOT_ALLOWED, _word(405), headers=(("Allow", "GET, HEAD"),)
            )
        if resp is None:
            try:
                resp = self._route(req.target.decode("latin-1"), headers)
            except Exception:  # a route's bug: a bare 500, never a traceback to the client
                resp, close = Response(500, _word(500)), True
        return self._send(resp, close, with_body=method != b"HEAD")

    def _refused(self, headers: Mapping[str, str]) -> Response | None:
        if self.token is None or bearer_ok(headers.get("Authorization"), self.token):
            return None
        return Response(
            HTTPStatus.UNAUTHORIZED, b"unauthorized\n", headers=(("WWW-Authenticate", "Bearer"),)
        )

    def _route(self, target: str, headers: Mapping[str, str]) -> Response:
        route = self.routes.get(urlsplit(target).path)
        if route is None:
            return Response(HTTPStatus.NOT_FOUND, _word(404))
        resp = route(headers)
        wants_gzip = "gzip" in headers.get("Accept-Encoding", "")
        if wants_gzip and len(resp.body) >= GZIP_MIN_BYTES and resp.status == 200:
            body = gzip.compress(resp.body, compresslevel=1)
            extra = (*resp.headers, ("Content-Encoding", "gzip"))
            resp = Response(resp.status, body, resp.content_type, extra)
        return resp

    def _refusal(self, status: int) -> bytes:
        """A request that cannot be answered otherwise: bare, and the connection closes."""
        self.closing = True
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return b""
        return self._send(Response(status, _word(status)), close=True)

    def _send(self, resp: Response, close: bool, with_body: bool = True) -> bytes:
        conn = self._h11
        headers = [
            ("Server", SERVER),
            ("Date", formatdate(usegmt=True)),
            ("Content-Type", resp.content_type),
            ("Content-Length", str(len(resp.body))),
            ("Cache-Control", "no-store"),
            *resp.headers,
        ]
        if close:
            headers.append(("Connection", "close"))
        phrase = HTTPStatus(resp.status).phrase.encode()
        out = conn.send(h11.Response(status_code=resp.status, headers=headers, reason=phrase))
        if resp.body and with_body:  # a HEAD's answer: the length, not the body
            out += conn.send(h11.Data(data=resp.body))
        out += conn.send(h11.EndOfMessage())
        if conn.our_state is h11.MUST_CLOSE:  # asked for, or an HTTP/1.0 client
            self.closing = True
        return out


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


class _Handler(socketserver.BaseRequestHandler):
    """One connection: bytes from the socket into `HttpConnection`, its answers back."""

    request: socket.socket
    server: _Server

    def handle(self) -> None:
        sock = self.request
        # a client that went away, timed out or failed its TLS handshake: nothing to answer
        with contextlib.suppress(OSError):
            sock.settimeout(self.server.idle_timeout)
            if isinstance(sock, ssl.SSLSocket):
                try:
                    sock.do_handshake()  # under the timeout
                except ssl.SSLError:
                    _close_after_alert(sock)
                    return
            http = HttpConnection(self.server.routes, self.server.token)
            while not http.closing:
                out = http.next_answer()
                if out:
                    sock.sendall(out)
                elif not http.closing:
                    http.receive_data(sock.recv(RECV_BYTES))


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's 5 makes a burst of connects wait seconds

    def __init__(
        self,
        address: tuple[Any, ...],
        routes: Mapping[str, Route],
        token: str | None,
        tls: ssl.SSLContext | None,
        family: socket.AddressFamily,
        idle_timeout: float,
    ) -> None:
        self.address_family = family
        self.idle_timeout = idle_timeout
        self.routes = dict(routes)
        self.token = token
        self.tls = tls
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

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
    idle_timeout: float = IDLE_TIMEOUT_S,
) -> tuple[socketserver.TCPServer, threading.Thread]:
    """Serve `routes` on host:port (IPv4 or IPv6, as the address is) from a daemon thread;
    a connection is dropped after `idle_timeout` seconds without a byte. Raises OSError when
    the address cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    httpd = _Server(addr, routes, token, tls, family, idle_timeout)
    thread = threading.Thread(target=httpd.serve_forever, name="gtm-http", daemon=True)
    thread.start()
    return httpd, thread
