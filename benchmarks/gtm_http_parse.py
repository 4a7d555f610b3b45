"""Cost of one HTTP exchange at each end of the fleet: the hand-written code against h11, side
by side in one run (DECISIONS.md D45).

Client (the fleet poller, per poll: build the request, read the answer):

* ``hand``: `httpwire.request_bytes` and a fresh `httpwire.ResponseReader`, as the poller does;
* ``h11``: `H11Reader` below, what the poller would do with h11: one `h11.Connection` per
  keep-alive connection (``start_next_cycle``), the request sent through it, the answer read
  from its events with the same caps and refusals (head cap as h11's
  ``max_incomplete_event_size``, Content-Length and body checked against the body cap,
  interim answers and content encodings refused).

Answers as ``gputaskman serve`` writes them (Server, Date, Content-Type, Content-Length,
Cache-Control, ETag): a 200 with a JSON body of about 20 KiB and of about 60 KiB (recorded
snapshots from tests/recordings joined in a list; the bytes of the body do not matter to
either parser), fed in one piece (what a loopback or LAN read gives) and in 16 KiB pieces (TLS
records), and a bodiless 304. Chunked answers are not compared: the hand-written reader
refuses them (``serve`` never sends one).

Server (``gputaskman serve``, per request on a keep-alive connection: read the poller's GET,
write the answer):

* ``stdlib``: `http.server.BaseHTTPRequestHandler`, the server before D45 (its request path,
  `_OldHandler` below: ``handle_one_request``, the token check, the route, ``send_response``
  and ``send_header``), reading from and writing to memory;
* ``h11``: `httpserve.HttpConnection`, the server now, bytes in and bytes out.

Both answer the same route (a 304, or a 200 with the 20 KiB body) after a bearer token check.

Each case is timed per exchange, the median of `--passes` passes of `--seconds` each, the
passes of all cases interleaved so a change in the machine's load hits every case alike.
Run: ``uv run python benchmarks/gtm_http_parse.py [--passes 5] [--seconds 0.3]``.
Numbers depend on the machine and on what else runs; report them with that caveat, and
prefer the ratios.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h11
from gputaskman.fleet.httpwire import (
    MAX_HEAD_BYTES,
    HttpError,
    HttpResponse,
    ResponseReader,
    TooLarge,
    request_bytes,
)
from gputaskman.fleet.reader import MAX_DOCUMENT_BYTES
from gputaskman.serve.httpauth import bearer_ok
from gputaskman.serve.httpserve import HttpConnection, Response, Route

RECORDINGS = Path(__file__).resolve().parents[1] / "packages/gputaskman/tests/recordings"
TOKEN = "s3cr3t-token-0123456789abcdef"
ETAG_HELD = '"1796000000.400000"'
ETAG_NEW = '"1796000000.500000"'


def _body(size: int) -> bytes:
    """A JSON list of recorded snapshot lines, at least `size` bytes."""
    lines = []
    for path in sorted(RECORDINGS.glob("*.jsonl")):
        lines += [line for line in path.read_bytes().splitlines() if line.strip()]
    out: list[bytes] = []
    while sum(map(len, out)) < size:
        out.append(lines[len(out) % len(lines)])
    return b"[" + b",".join(out) + b"]"


def _answer(status: bytes, body: bytes, etag: str) -> bytes:
    return (
        b"HTTP/1.1 %s\r\nServer: gputaskman\r\nDate: Fri, 04 Dec 2026 22:00:00 GMT\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nCache-Control: no-store\r\n"
        b"ETag: %s\r\n\r\n" % (status, len(body), etag.encode())
    ) + body


# ---------------------------------------------------------------------------- client, h11


class H11Reader:
    """The poller's answers read with h11: one per keep-alive connection (see the docstring)."""

    def __init__(self, max_body: int, max_head: int = MAX_HEAD_BYTES) -> None:
        self.max_body = max_body
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head)
        self._head: h11.Response | None = None
        self._body: list[bytes] = []
        self._size = 0

    def request(self, host: str, path: str, token: str | None, etag: str | None) -> bytes:
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        headers = [
            ("Host", host),
            ("Accept", "application/json"),
            ("Accept-Encoding", "identity"),
            ("User-Agent", "gputaskman-fleet"),
        ]
        if token is not None:
            headers.append(("Authorization", f"Bearer {token}"))
        if etag is not None:
            headers.append(("If-None-Match", etag))
        self._head, self._body, self._size = None, [], 0
        out = conn.send(h11.Request(method="GET", target=path, headers=headers))
        return out + conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> HttpResponse | None:
        conn = self._conn
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                raise HttpError(str(exc)) from None
            if isinstance(event, h11.Data):
                self._size += len(event.data)
                if self._size > self.max_body:
                    raise TooLarge(f"the document is over {self.max_body} bytes")
                self._body.append(event.data)
            elif isinstance(event, h11.Response):
                self._start(event)
            elif isinstance(event, h11.EndOfMessage):
                head = self._head
                assert head is not None
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
                keep = conn.our_state is h11.DONE and conn.their_state is h11.DONE
                return HttpResponse(head.status_code, headers, b"".join(self._body), keep)
            elif isinstance(event, h11.InformationalResponse):
                raise HttpError(f"an interim answer (HTTP {event.status_code})")
            else:  # NEED_DATA, or PAUSED/ConnectionClosed, which a whole answer never leaves
                return None

    def _start(self, head: h11.Response) -> None:
        for name, value in head.headers:
            if name == b"content-length" and int(value) > self.max_body:
                raise TooLarge(f"the document is {int(value)} bytes, over {self.max_body}")
            if name == b"content-encoding" and value.lower() != b"identity":
                raise HttpError(f"content encoding {value[:30]!r} was not asked for")
        self._head = head


# ---------------------------------------------------------------------------- server, stdlib


class _OldHandler(BaseHTTPRequestHandler):
    """The request path of `httpserve._Handler` before D45 (http.server), over memory."""

    server_version = "gputaskman"
    protocol_version = "HTTP/1.1"
    routes: Mapping[str, Route]
    token: str | None

    def version_string(self) -> str:
        return self.server_version

    def do_GET(self) -> None:
        token = self.token
        if token is not None and not bearer_ok(self.headers.get("Authorization"), token):
            self._send(Response(401, b"unauthorized\n", headers=(("WWW-Authenticate", "Bearer"),)))
            return
        route = self.routes.get(urlsplit(self.path).path)
        if route is None:
            self._send(Response(404, HTTPStatus(404).phrase.lower().encode() + b"\n"))
            return
        self._send(route(self.headers))  # type: ignore[arg-type]

    def _send(self, resp: Response) -> None:
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in resp.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(resp.body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _stdlib_exchange(request: bytes, route: Route) -> Callable[[], object]:
    handler = _OldHandler.__new__(_OldHandler)
    handler.routes, handler.token = {"/snapshot.json": route}, TOKEN
    handler.client_address = ("127.0.0.1", 40000)
    handler.close_connection = False

    def once() -> object:
        handler.rfile = io.BytesIO(request)
        handler.wfile = out = io.BytesIO()
        handler.handle_one_request()
        assert not handler.close_connection
        return out.getvalue()

    return once


def _h11_exchange(request: bytes, route: Route) -> Callable[[], object]:
    conn = HttpConnection({"/snapshot.json": route}, TOKEN)

    def once() -> object:
        conn.receive_data(request)
        out = conn.next_answer()
        conn.next_answer()  # the request's end, then: needs the next request
        assert out and not conn.closing
        return out

    return once


# ---------------------------------------------------------------------------- the cases


def _client_cases() -> dict[str, Callable[[], object]]:
    cases: dict[str, Callable[[], object]] = {}
    answers = {
        "200, 20 KiB body, one piece": (_answer(b"200 OK", _body(20 * 1024), ETAG_NEW), 1 << 30),
        "200, 20 KiB body, 16 KiB pieces": (_answer(b"200 OK", _body(20 * 1024), ETAG_NEW), 16384),
        "200, 60 KiB body, one piece": (_answer(b"200 OK", _body(60 * 1024), ETAG_NEW), 1 << 30),
        "200, 60 KiB body, 16 KiB pieces": (_answer(b"200 OK", _body(60 * 1024), ETAG_NEW), 16384),
        "304, no body": (_answer(b"304 Not Modified", b"", ETAG_HELD), 1 << 30),
    }
    for name, (raw, piece) in answers.items():
        pieces = [raw[i : i + piece] for i in range(0, len(raw), piece)]

        def hand(pieces: list[bytes] = pieces) -> object:
            request_bytes("gpu-host-7:9835", "/snapshot.json", TOKEN, ETAG_HELD)
            reader = ResponseReader(MAX_DOCUMENT_BYTES)
            for p in pieces:
                if (got := reader.feed(p)) is not None:
                    assert got.keep_alive
                    return got
            raise AssertionError("no answer")

        h11_reader = H11Reader(MAX_DOCUMENT_BYTES)

        def with_h11(pieces: list[bytes] = pieces, reader: H11Reader = h11_reader) -> object:
            reader.request("gpu-host-7:9835", "/snapshot.json", TOKEN, ETAG_HELD)
            for p in pieces:
                if (got := reader.feed(p)) is not None:
                    assert got.keep_alive
                    return got
            raise AssertionError("no answer")

        cases[f"client  {name}: hand"] = hand
        cases[f"client  {name}: h11"] = with_h11
    return cases


def _server_cases() -> dict[str, Callable[[], object]]:
    body = _body(20 * 1024)
    json = "application/json"
    routes: dict[str, Route] = {
        "304": lambda h: Response(304, b"", json, (("ETag", ETAG_HELD),)),
        "200, 20 KiB body": lambda h: Response(200, body, json, (("ETag", ETAG_NEW),)),
    }
    request = request_bytes("gpu-host-7:9835", "/snapshot.json", TOKEN, ETAG_HELD)
    cases: dict[str, Callable[[], object]] = {}
    for name, route in routes.items():
        cases[f"server  GET answered {name}: stdlib"] = _stdlib_exchange(request, route)
        cases[f"server  GET answered {name}: h11"] = _h11_exchange(request, route)
    return cases


def _per_call(fn: Callable[[], object], seconds: float) -> float:
    """Microseconds per call over about `seconds`."""
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(50):
            fn()
        n += 50
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.3, help="per case and pass")
    args = p.parse_args(argv)
    cases = {**_client_cases(), **_server_cases()}
    for fn in cases.values():  # each works, and is warm, before it is timed
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.passes):
        for name, fn in cases.items():
            times[name].append(_per_call(fn, args.seconds))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"h11 {h11.__version__}, Python {sys.version.split()[0]}; load average {load}")
    print(f"{'case':58} {'median us':>9}  {'passes':>13}  {'h11 / other':>11}")
    medians = {name: statistics.median(got) for name, got in times.items()}
    for name, got in times.items():
        other = name.rsplit(": ", 1)[0] + (": hand" if name.startswith("client") else ": stdlib")
        ratio = f"{medians[name] / medians[other]:.2f}x" if name.endswith("h11") else ""
        spread = f"{min(got):.1f}-{max(got):.1f}"
        print(f"{name:58} {medians[name]:9.1f}  {spread:>13}  {ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
