"""`gputaskman serve`'s HTTP side: a small threaded WSGI server for the metrics app, and the
bearer token that guards it.

The token lives in a file of its own, readable by its owner only (mode 0600: a file that
group or others may read is refused, like ssh refuses such a key). Every request must carry
``Authorization: Bearer <token>``; the token is compared in constant time
(`hmac.compare_digest`). A refused request gets a bare 401 that says nothing about this
host: no metrics, no software versions (the server header is just "gputaskman").
"""

from __future__ import annotations

import hmac
import os
import socket
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

MIN_TOKEN_CHARS = 16
MAKE_TOKEN = "umask 077; head -c 32 /dev/urandom | base64 > FILE"

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class TokenError(Exception):
    """The token file cannot be used; the message says why and what to do."""


def read_token(path: Path) -> str:
    try:
        st = os.stat(path)
    except OSError as e:
        raise TokenError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokenError(f"{path} is not a regular file")
    if st.st_mode & 0o077:
        raise TokenError(
            f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}"
        )
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"cannot read the token file {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(
            f"{path} must hold one token of at least {MIN_TOKEN_CHARS} characters without "
            f"spaces; make one with: {MAKE_TOKEN}"
        )
    return token


def bearer_required(app: App, token: str) -> App:
    """`app`, answered only to requests that carry the token."""
    want = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(got, want):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")],
            )
            return [b"unauthorized\n"]
        return app(environ, start_response)

    return guarded


def _branded(app: App) -> App:
    """`app` with "Server: gputaskman" (wsgiref otherwise names itself and this Python)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, [*headers, ("Server", "gputaskman")], *exc)

        return app(environ, start)

    return wrapped


class _Handler(WSGIRequestHandler):
    server_version = "gputaskman"
    sys_version = ""  # no Python version where the handler itself answers (bad requests)

    def log_message(self, format: str, *args: Any) -> None:  # a scrape a second: no log
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def serve(app: App, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """Serve `app` on host:port (IPv4 or IPv6, as the address is) from a daemon thread."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    server_class = type("Server", (_Server,), {"address_family": family})
    httpd = make_server(addr[0], port, _branded(app), server_class, handler_class=_Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="gtm-http", daemon=True)
    thread.start()
    return httpd, thread
