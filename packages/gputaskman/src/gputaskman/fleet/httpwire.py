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

Hand-written, not h11 (the server's HTTP library, `serve/httpserve`): it is the poller's
per-answer work, and h11 took 7-9 times as long per answer (DECISIONS.md D45,
benchmarks/gtm_http_parse.py). h11 is its reference instead: the head is matched against
HTTP/1.1's grammar as h11 reads it (status line, header names as tokens, field values without
control characters, ASCII digits), never more leniently, and tests hold the two to the same
reading of generated answers, whole and damaged: status, headers, body and keep-alive.

Read: HTTP/1.0 and HTTP/1.1 status lines, headers (names case-insensitive), a body delimited
by Content-Length or, without one, by the connection closing; 204 and 304 have none. Not
read (refused with a reason, since `gputaskman serve` never sends them): chunked or any
other transfer encoding, a content encoding (the request asks for none), interim 1xx
answers, two Content-Lengths that disagree. ``keep_alive`` says whether the connection may
carry the next request: as h11 decides, an HTTP/1.1 answer whose Connection header has no
``close`` token, whose length was known and after which nothing more arrived; an HTTP/1.0
answer never.
"""

from __future__ import annotations

import re
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


# HTTP/1.1's grammar (RFC 9112, as h11 reads it), never more lenient than h11: whatever this
# reader takes, h11 reads the same (tests/test_fleet_reader.py checks it on generated answers)
_STATUS_LINE = rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?"
_FIELD = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*"
_HEAD = re.compile(_STATUS_LINE + rb"((?:\r\n" + _FIELD + rb")*)")


def _head(raw: bytes) -> tuple[int, bool, dict[str, str]]:
    """(status, HTTP/1.1?, headers) of a head without its blank line."""
    m = _HEAD.fullmatch(raw)
    if m is None or m[2] < b"100":
        raise _head_refusal(raw)
    headers: dict[str, str] = {}
    for line in m[3].decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        key, value = name.lower(), value.strip(" \t")
        if key == "content-length" and key in headers and headers[key] != value:
            raise HttpError("two different Content-Length headers")
        headers[key] = value
    return int(m[2]), m[1] == b"1", headers


def _head_refusal(raw: bytes) -> HttpError:
    """Why `raw` is not an answer's head: its first line that HTTP/1.1 does not allow."""
    status_line, *header_lines = raw.split(b"\r\n")
    m = re.fullmatch(_STATUS_LINE, status_line)
    if m is None or m[2] < b"100":
        shown = status_line[:60].decode("latin-1")
        if status_line[:9] not in (b"HTTP/1.0 ", b"HTTP/1.1 "):
            return HttpError(f"not an HTTP/1.x answer: {shown!r}")
        return HttpError(f"not an HTTP status line: {shown!r}")
    for line in header_lines:
        if re.fullmatch(_FIELD, line) is None:
            return HttpError(f"not an HTTP header line: {line[:60].decode('latin-1')!r}")
    return HttpError("not an HTTP head")  # not reached: each line is allowed, so the head is


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
        if length is not None and not (length.isascii() and length.isdigit()):
            # refused whatever the status, as h11 does ("²".isdigit() is True)
            raise HttpError(f"Content-Length {length[:30]!r} is not a number")
        if status in (204, 304):  # never a body, whatever the headers say
            length = "0"
        if length is not None:
            if int(length) > self.max_body:
                raise TooLarge(f"the document is {int(length)} bytes, over {self.max_body}")
            self._length = int(length)
        # as h11 decides: HTTP/1.1 without a "close" token; an HTTP/1.0 answer never
        connection = {t.strip(" \t") for t in headers.get("connection", "").lower().split(",")}
        self._keep_alive = length is not None and http11 and "close" not in connection
        self._status, self._headers = status, headers

    def _done(self, body: bytes, clean_end: bool) -> HttpResponse:
        assert self._status is not None
        # bytes after the answer (nothing was asked for them): the connection is not reused
        return HttpResponse(self._status, self._headers, body, self._keep_alive and clean_end)
