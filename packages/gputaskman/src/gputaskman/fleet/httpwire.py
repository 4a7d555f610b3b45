"""The fleet's HTTP, sans-io: the request it sends and `ResponseReader`, which reads one answer
from bytes as they arrive without trusting the host that sends them.

Theory of operation
-------------------
The poller feeds each chunk a connection receives to `ResponseReader.feed`, which returns the
`HttpResponse` once it is whole, else None; `eof` ends a body delimited by the connection
closing. Whatever a host sends, the reader either returns a response or raises `HttpError`
(its message is what the host's row shows), and it never holds more than `max_head` bytes
of status line and headers plus `max_body` bytes of body: a Content-Length above the cap is
refused before any of the body is read (`TooLarge`), and so is a body that outgrows it.

Read: HTTP/1.0 and HTTP/1.1 status lines, headers (names case-insensitive), a body delimited
by Content-Length or, without one, by the connection closing; 204 and 304 have none. Not
read (refused with a reason, since `gputaskman serve` never sends them): chunked or any
other transfer encoding, a content encoding (the request asks for none), interim 1xx
answers, two Content-Lengths that disagree. ``keep_alive`` says whether the connection may
carry the next request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_HEAD_BYTES = 16 * 1024


class HttpError(Exception):
    """An answer that is not HTTP this reader takes; the message says why."""


class TooLarge(HttpError):
    """A body over the size cap."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes
    keep_alive: bool


def request_bytes(host_header: str, path: str, token: str | None, etag: str | None = None) -> bytes:
    """A GET for `path` that keeps the connection open for the next poll; with `etag`, the
    answer is a bodiless 304 when the document is still that one."""
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host_header}",
        "Accept: application/json",
        "Accept-Encoding: identity",
        "User-Agent: gputaskman-fleet",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if etag is not None and _plain(etag):
        lines.append(f"If-None-Match: {etag}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _plain(value: str) -> bool:
    """A header value a host sent that is safe to send back (no line break, printable)."""
    return len(value) <= 200 and all(32 <= ord(c) < 127 for c in value)


def _head(raw: bytes) -> tuple[int, bool, dict[str, str]]:
    """(status, HTTP/1.1?, headers) of a head without its blank line."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes any byte; kept for clarity of intent
        raise HttpError("the answer's head is not text") from None
    status_line, *header_lines = text.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or parts[0] not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpError(f"not an HTTP/1.x answer: {status_line[:60]!r}")
    if len(parts[1]) != 3 or not parts[1].isdigit():
        raise HttpError(f"not an HTTP status: {parts[1][:20]!r}")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise HttpError(f"not an HTTP header line: {line[:60]!r}")
        key = name.lower()
        value = value.strip()
        if key == "content-length" and key in headers and headers[key] != value:
            raise HttpError("two different Content-Length headers")
        headers[key] = value
    return int(parts[1]), parts[0] == "HTTP/1.1", headers


class ResponseReader:
    """One answer, read from chunks as they arrive (see the module docstring)."""

    def __init__(self, max_body: int, max_head: int = MAX_HEAD_BYTES) -> None:
        self.max_body = max_body
        self.max_head = max_head
        self._buf = bytearray()
        self._status: int | None = None
        self._headers: dict[str, str] = {}
        self._keep_alive = False
        self._length: int | None = None  # None: the body ends when the connection closes
        self.received = 0  # bytes fed so far

    def feed(self, data: bytes) -> HttpResponse | None:
        self.received += len(data)
        self._buf += data
        if self._status is None:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buf) > self.max_head:
                    raise HttpError(f"the answer's head is over {self.max_head} bytes")
                return None
            if end > self.max_head:
                raise HttpError(f"the answer's head is over {self.max_head} bytes")
            self._start(bytes(self._buf[:end]))
            del self._buf[: end + 4]
        if len(self._buf) > self.max_body:
            raise TooLarge(f"the document is over {self.max_body} bytes")
        if self._length is not None and len(self._buf) >= self._length:
            return self._done(bytes(self._buf[: self._length]), len(self._buf) == self._length)
        return None

    def eof(self) -> HttpResponse:
        """The connection closed: the answer if it is whole, else `HttpError`."""
        if self._status is None:
            raise HttpError(
                "the connection closed before an answer"
                if not self.received
                else "the connection closed inside the answer's head"
            )
        if self._length is not None:
            raise HttpError(
                f"the connection closed after {len(self._buf)} of {self._length} body bytes"
            )
        return self._done(bytes(self._buf), False)

    def _start(self, head: bytes) -> None:
        status, http11, headers = _head(head)
        if 100 <= status < 200:
            raise HttpError(f"an interim answer (HTTP {status})")
        if "transfer-encoding" in headers:
            raise HttpError(f"transfer encoding {headers['transfer-encoding'][:30]!r} is not read")
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise HttpError(f"content encoding {encoding[:30]!r} was not asked for")
        length = headers.get("content-length")
        if status in (204, 304):  # never a body, whatever the headers say
            length = "0"
        if length is not None:
            if not length.isdigit():
                raise HttpError(f"Content-Length {length[:30]!r} is not a number")
            if int(length) > self.max_body:
                raise TooLarge(f"the document is {int(length)} bytes, over {self.max_body}")
            self._length = int(length)
        connection = headers.get("connection", "").lower()
        self._keep_alive = length is not None and (
            "keep-alive" in connection if not http11 else "close" not in connection
        )
        self._status, self._headers = status, headers

    def _done(self, body: bytes, clean_end: bool) -> HttpResponse:
        assert self._status is not None
        # bytes after the answer (nothing was asked for them): the connection is not reused
        return HttpResponse(self._status, self._headers, body, self._keep_alive and clean_end)
