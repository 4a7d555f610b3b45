"""Prometheus's HTTP API as the fleet reads it: instant queries (``/api/v1/query``), the
scrape targets (``/api/v1/targets``) and a label's values (``/api/v1/label/NAME/values``:
the jobs, when a job has no target), each answer read without trusting it.

Theory of operation
-------------------
`PromClient` keeps one HTTP/1.1 connection to the server (stdlib `http.client`, over TLS
for ``https://``) and sends each request with the bearer token when one is given; with TLS
it verifies the server against ``--tls-ca`` (or the system's CAs) and presents a client
certificate when one is given. A request that fails on a connection the server closed
while idle is sent again once on a new one. Every request has `timeout` seconds in all:
a timer shuts the socket at the deadline, so a server that trickles bytes cannot hold the
fleet longer than that.

An answer is read in bounded memory: a ``Content-Length`` over `max_bytes` is refused before
its body is read, and a body without one is read up to `max_bytes` and then refused. A body
is decoded straight into the shapes below (msgspec), which checks every type as it goes, so
an answer that is not Prometheus's JSON is one `PromError` with the place it went wrong.
An error status carries Prometheus's own ``error`` text when its body has one.

Off loopback, plain HTTP without a token is refused (`exposure_refusal`), as `serve` refuses
to listen there without one: the series name processes and models, and a server that asks
nothing of its clients would show them to anyone.

Every failure is a `PromError` whose message is one line, fit to print after the program's
name.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec

from gputaskman.base.netaddr import is_loopback

DEFAULT_PORT = 9090
MAX_RESPONSE_BYTES = 256 * 1024 * 1024  # 2,000 hosts' series are a few tens of MB
MAX_GET_QUERY = 2000  # longer queries go as a form in a POST (Prometheus takes both)
_CHUNK = 1 << 20


class PromError(Exception):
    """Prometheus could not answer this request; the message says why, in one line."""


class Sample(msgspec.Struct, gc=False):
    """One series of an instant vector as Prometheus writes it: its labels (``__name__``
    among them) and ``[evaluation time, value]``, the value a float (NaN and ±Inf as
    Python floats: the caller decides what they mean). Decoded straight from the answer."""

    metric: dict[str, str]
    value: tuple[float, float]

    @property
    def labels(self) -> dict[str, str]:
        return self.metric

    @property
    def number(self) -> float:
        return self.value[1]


class _TextSample(msgspec.Struct, gc=False):
    metric: dict[str, str]
    value: tuple[float, str]


S = TypeVar("S", Sample, _TextSample)


class _Vector(msgspec.Struct, Generic[S], gc=False):
    resultType: str
    result: list[S]


class _QueryAnswer(msgspec.Struct, Generic[S], gc=False):
    status: str
    data: _Vector[S] | None = None
    error: str | None = None


class _Target(msgspec.Struct, gc=False):
    labels: dict[str, str]
    lastError: str = ""
    scrapeUrl: str = ""
    scrapeInterval: str = ""


class _Targets(msgspec.Struct, gc=False):
    activeTargets: list[_Target] = []


class _TargetsAnswer(msgspec.Struct, gc=False):
    status: str
    data: _Targets | None = None
    error: str | None = None


class _LabelAnswer(msgspec.Struct, gc=False):
    status: str
    data: list[str] | None = None
    error: str | None = None


class _ErrorAnswer(msgspec.Struct, gc=False):
    error: str | None = None


# values are strings in the JSON: read as floats by msgspec's lax mode, which takes "NaN"
# but not "+Inf"; an answer holding one is read again with the strings kept
_QUERY = msgspec.json.Decoder(_QueryAnswer[Sample], strict=False)
_QUERY_TEXT = msgspec.json.Decoder(_QueryAnswer[_TextSample])
_TARGETS = msgspec.json.Decoder(_TargetsAnswer)
_LABEL = msgspec.json.Decoder(_LabelAnswer)
_ERROR = msgspec.json.Decoder(_ErrorAnswer)


@dataclass(frozen=True, slots=True)
class Vector:
    at: float  # the evaluation time Prometheus answered for (Unix seconds)
    samples: Sequence[Sample]


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One of Prometheus's active scrape targets, as ``/api/v1/targets`` lists it."""

    labels: Mapping[str, str]
    last_error: str
    scrape_url: str
    interval_s: float | None  # its scrape interval (None: not given, or unreadable)


@dataclass(frozen=True, slots=True)
class Endpoint:
    tls: bool
    host: str  # an IPv6 address without brackets
    port: int
    path: str  # the API's prefix ("" or e.g. "/prometheus"), never ending in "/"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{self.path}"


def parse_url(text: str) -> Endpoint:
    """``http(s)://HOST[:PORT][/PREFIX]`` (port 9090 unless given), or `PromError`."""
    try:
        u = urllib.parse.urlsplit(text.strip())
        port = u.port
    except ValueError as exc:
        raise PromError(f"{text!r} is not a URL: {exc}") from None
    if u.scheme not in ("http", "https"):
        raise PromError(f"{text!r}: give Prometheus's URL as http://HOST:PORT or https://...")
    if not u.hostname:
        raise PromError(f"{text!r}: no host in the URL")
    if u.query or u.fragment or u.username or u.password:
        raise PromError(f"{text!r}: give the server's URL only (no query, user or fragment)")
    return Endpoint(
        u.scheme == "https", u.hostname, DEFAULT_PORT if port is None else port, u.path.rstrip("/")
    )


def exposure_refusal(ep: Endpoint, token: bool, client_cert: bool) -> str | None:
    """Why the fleet must not read `ep` (None on loopback, or with a token or a client
    certificate): see the module docstring."""
    if is_loopback(ep.host) or token or client_cert:
        return None
    return (
        f"refusing to read {ep.url} off loopback without authentication: its series name "
        "processes and models. Protect the server and pass --token-file FILE, or "
        "https:// with --tls-cert and --tls-key"
    )


def parse_duration(text: str) -> float | None:
    """A Prometheus duration (``15s``, ``1m30s``, ``500ms``) in seconds; None if unreadable."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    total, num, i = 0.0, "", 0
    while i < len(text):
        c = text[i]
        if c.isdigit():
            num += c
            i += 1
            continue
        unit = "ms" if text.startswith("ms", i) else c
        if not num or unit not in units:
            return None
        total += int(num) * units[unit]
        num, i = "", i + len(unit)
    return None if num or not text else total


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class PromClient:
    """One Prometheus server's HTTP API (see the module docstring). Not thread-safe: one
    thread asks at a time."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
        timeout: float = 5.0,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.endpoint = parse_url(url)
        if tls is not None and not self.endpoint.tls:
            raise PromError(f"{self.endpoint.url}: TLS files given for a plain-HTTP URL")
        self.token = token
        self.tls = tls
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._conn: http.client.HTTPConnection | None = None

    @property
    def url(self) -> str:
        return self.endpoint.url

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- the API

    def query(self, expr: str) -> Vector:
        """An instant query's vector, or `PromError`."""
        return decode_vector(self._request("/api/v1/query", {"query": expr}), self.url)

    def targets(self) -> list[ScrapeTarget]:
        """The active scrape targets, or `PromError` (a query front end such as Thanos
        Query does not serve this endpoint: callers treat it as optional)."""
        body = self._request("/api/v1/targets", {"state": "active"})
        try:
            ans = _TARGETS.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PromError(
                f"{self.url} answered /api/v1/targets with {_what(body, exc)}"
            ) from None
        if ans.status != "success" or ans.data is None:
            raise PromError(f"{self.url}: targets: {_one_line(ans.error or ans.status)}")
        return [
            ScrapeTarget(
                t.labels,
                t.lastError,
                t.scrapeUrl,
                parse_duration(t.scrapeInterval),
            )
            for t in ans.data.activeTargets
        ]

    def label_values(self, label: str) -> list[str]:
        """Every value `label` has in the server's series (sorted), or `PromError`."""
        path = f"/api/v1/label/{urllib.parse.quote(label, safe='')}/values"
        body = self._request(path, {})
        try:
            ans = _LABEL.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PromError(f"{self.url} answered {path} with {_what(body, exc)}") from None
        if ans.status != "success" or ans.data is None:
            raise PromError(f"{self.url}: {label} values: {_one_line(ans.error or ans.status)}")
        return sorted(ans.data)

    # -- HTTP

    def _request(self, path: str, params: Mapping[str, str]) -> bytes:
        form = urllib.parse.urlencode(params)
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if len(form) <= MAX_GET_QUERY:
            query = f"?{form}" if form else ""
            method, target, data = "GET", f"{self.endpoint.path}{path}{query}", None
        else:
            method, target, data = "POST", f"{self.endpoint.path}{path}", form.encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        for attempt in (0, 1):
            reused = self._conn is not None
            try:
                status, body = self._exchange(method, target, data, headers)
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt or not reused:  # only an idle connection closed under us is retried
                    raise PromError(f"{self.url}: the server closed the connection") from None
            except _Deadline:
                self.close()
                raise PromError(f"{self.url}: no whole answer within {self.timeout:g} s") from None
            except ssl.SSLError as exc:
                self.close()
                raise PromError(f"{self.url}: TLS failed: {_one_line(str(exc))}") from None
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise PromError(f"{self.url}: {_one_line(_oserror(exc))}") from None
        if status != 200:
            raise PromError(f"{self.url}{path}: {_status_reason(status, body)}")
        return body

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            ep = self.endpoint
            if ep.tls:
                ctx = self.tls or ssl.create_default_context()
                self._conn = http.client.HTTPSConnection(
                    ep.host, ep.port, timeout=self.timeout, context=ctx
                )
            else:
                self._conn = http.client.HTTPConnection(ep.host, ep.port, timeout=self.timeout)
        return self._conn

    def _exchange(
        self, method: str, target: str, data: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, bytes]:
        conn = self._connection()
        expired = threading.Event()

        def cut() -> None:  # the whole request's deadline: wakes any blocked read or write
            expired.set()
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self.timeout, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.request(method, target, body=data, headers=dict(headers))
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                self.close()
                raise PromError(
                    f"{self.url}: an answer of {int(length)} bytes, over the "
                    f"{self.max_bytes}-byte limit"
                )
            parts: list[bytes] = []
            size = 0
            while chunk := resp.read(_CHUNK):
                size += len(chunk)
                if size > self.max_bytes:
                    self.close()
                    raise PromError(f"{self.url}: an answer over the {self.max_bytes}-byte limit")
                parts.append(chunk)
            if expired.is_set():  # cut short: what was read is not the whole answer
                raise _Deadline
            if resp.will_close:
                self.close()
            return resp.status, b"".join(parts)
        except (OSError, http.client.HTTPException):
            if expired.is_set():
                raise _Deadline from None
            raise
        finally:
            timer.cancel()


def decode_vector(body: bytes, url: str) -> Vector:
    """An instant query's answer, or `PromError` saying what is wrong with it (`url`
    names the server in the message)."""
    words = False  # the values kept as Prometheus's strings
    try:
        ans: _QueryAnswer[Sample] | _QueryAnswer[_TextSample] = _QUERY.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            ans, words = _QUERY_TEXT.decode(body), True
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PromError(f"{url} answered a query with {_what(body, exc)}") from None
    if ans.status != "success" or ans.data is None:
        raise PromError(f"{url}: query failed: {_one_line(ans.error or ans.status)}")
    if ans.data.resultType != "vector":
        raise PromError(f"{url}: expected an instant vector, got {_one_line(ans.data.resultType)}")
    result: list[Sample] = ans.data.result  # type: ignore[assignment]
    if words:
        result = [_number(s, url) for s in ans.data.result]  # type: ignore[arg-type]
    at = result[0].value[0] if result else math.nan
    return Vector(at, result)


def _number(s: _TextSample, url: str) -> Sample:
    try:
        return Sample(s.metric, (s.value[0], float(s.value[1])))
    except ValueError:
        raise PromError(f"{url}: {s.value[1][:40]!r} is not a number") from None


class _Deadline(Exception):
    pass


def _oserror(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host: {exc.strerror or exc}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _status_reason(status: int, body: bytes) -> str:
    why = ""
    with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
        why = _ERROR.decode(body).error or ""
    if status in (401, 403):
        return f"HTTP {status}: the server refused the credentials (--token-file, --tls-cert)"
    return f"HTTP {status}" + (f": {_one_line(why)}" if why else "")


def _what(body: bytes, exc: Exception) -> str:
    head = body[:40].decode("utf-8", "replace")
    return f"something that is not its JSON ({_one_line(str(exc), 120)}; begins {head!r})"
