"""`gputaskman serve`'s snapshot endpoint and HTTP server: the document is `--json`'s, built
once per sample; only GET and HEAD exist; a refusal is bare; keep-alive, the connection cap,
TLS with client certificates, and the demo and replay sources fleet tests use.

GPU numbers are synthetic (the demo, a recording from tests/recordings): no GPU here.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from http import HTTPStatus
from pathlib import Path

import pytest
from gputaskman.base import schema
from gputaskman.document.reader import read_document
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.render import report
from gputaskman.render.exporter import Cached
from gputaskman.serve import httpauth, httpserve
from gputaskman.serve.httpserve import Response
from gputaskman.serve.server import SnapshotDocument
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from tls_files import make_pki  # noqa: E402

TOKEN = "s3cr3t-token-0123456789abcdef"
RECORDING = HERE / "recordings" / "drm.jsonl"


def _cached() -> Cached:
    return Cached(demo_snapshot(), DemoSystem(), time.time(), 0.01)  # type: ignore[arg-type]


def test_the_document_is_the_json_output_built_once_per_sample():
    """Catches a document that differs from --json, or one re-encoded for every client."""
    holder = [None, _cached()]
    route = SnapshotDocument(lambda: holder[-1], None)
    first = route({})
    assert first.status == 200 and first.content_type == "application/json"
    doc = json.loads(first.body)
    c = holder[-1]
    assert doc == json.loads(json.dumps(report.to_json_dict(c.snapshot, c.system)))
    assert first.body == json.dumps(doc, separators=(",", ":")).encode()  # compact
    assert route({}).body is first.body  # the same sample: the same bytes, not encoded again
    holder.append(_cached())
    assert route({}).body is not first.body
    assert read_document(doc).backend == "nvml"


def test_before_the_first_sample_the_answer_is_503_not_an_empty_document():
    route = SnapshotDocument(lambda: None, None)
    r = route({})
    assert r.status == 503 and dict(r.headers)["Retry-After"] == "1"


def _routes() -> dict:
    return {
        "/snapshot.json": SnapshotDocument(_cached, None),
        "/x": lambda h: Response(200, b"x" * 10000),
    }


def _request(port: int, method: str, path: str, token: str | None = None, tls=None, **headers):
    conn = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=tls)
        if tls is not None
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    conn.request(method, path, headers=headers)
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


@pytest.fixture
def server():
    httpd, _ = httpserve.serve(_routes(), "127.0.0.1", 0, token=TOKEN)
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_refused_request_learns_nothing(server):
    """Catches a refusal that carries the document, a Python version or a server banner."""
    for token in (None, "wrong-" + TOKEN, TOKEN + "x", ""):
        for method in ("GET", "HEAD", "POST", "DELETE", "PUT"):
            code, headers, body = _request(server, method, "/snapshot.json", token)
            assert code == 401, (method, token)
            assert body in (b"unauthorized\n", b"")
            assert headers["server"] == "gputaskman"
            assert headers["www-authenticate"] == "Bearer"
    code, headers, body = _request(server, "GET", "/nowhere", None)
    assert code == 401  # no token, no word on which paths exist


def test_there_is_no_write_endpoint(server):
    """Catches any method but GET and HEAD doing anything, with the right token too."""
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        code, headers, body = _request(server, method, "/snapshot.json", TOKEN)
        assert code == 405 and headers["allow"] == "GET, HEAD", method
        assert b"gputaskman" not in body
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        s.sendall(b"BREW /snapshot.json HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 501") and b"Python" not in answer
    assert b"<html" not in answer.lower() and b"schema" not in answer
    code, _, body = _request(server, "GET", "/nowhere", TOKEN)
    assert code == 404 and body == b"not found\n"
    code, headers, body = _request(server, "HEAD", "/snapshot.json", TOKEN)
    assert code == 200 and body == b"" and int(headers["content-length"]) > 1000


def test_one_connection_carries_many_requests(server):
    """Catches a server that closes after every answer (a poller would pay a handshake per
    poll)."""
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    socks = set()
    for _ in range(3):
        conn.request("GET", "/snapshot.json", headers={"Authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["schema"] == schema.NAME
        socks.add(id(conn.sock))
    assert len(socks) == 1 and conn.sock is not None
    conn.close()


def test_gzip_when_asked_and_large(server):
    import gzip

    code, headers, body = _request(server, "GET", "/x", TOKEN, **{"Accept-Encoding": "gzip"})
    assert code == 200 and headers["content-encoding"] == "gzip"
    assert gzip.decompress(body) == b"x" * 10000


def test_connections_beyond_the_cap_are_closed_and_do_not_stop_the_server(server):
    """Catches a server whose threads a client can exhaust by opening connections."""
    held = [
        socket.create_connection(("127.0.0.1", server), timeout=10)
        for _ in range(httpserve.MAX_CONNECTIONS)
    ]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", server), timeout=10)
        extra.sendall(b"GET /snapshot.json HTTP/1.1\r\nHost: x\r\n\r\n")
        assert extra.recv(100) == b""  # closed unanswered
        extra.close()
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the slots come back as the held connections close
        try:
            assert _request(server, "GET", "/snapshot.json", TOKEN)[0] == 200
            break
        except (ConnectionError, http.client.RemoteDisconnected):
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _exchange(raw: bytes, routes: dict | None = None, token: str | None = TOKEN):
    """What `HttpConnection` answers to `raw` arriving in 4 KiB reads (sans-io): the answers,
    and whether it closes."""
    conn = httpserve.HttpConnection(routes if routes is not None else _routes(), token)
    out = []
    for i in range(0, len(raw), 4096):
        conn.receive_data(raw[i : i + 4096])
        while not conn.closing and (answer := conn.next_answer()):
            out.append(answer)
    return out, conn.closing


AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


def test_pipelined_requests_are_answered_in_order_one_at_a_time():
    """Catches a server that drops or reorders pipelined requests, or answers them all at
    once (a client could pipeline thousands of requests for the document into one read)."""
    one = b"GET /x HTTP/1.1\r\nHost: h\r\n" + AUTH + b"\r\n"
    two = b"GET /nowhere HTTP/1.1\r\nhost: h\r\nauthorization" + AUTH[13:] + b"\r\n"
    out, closing = _exchange(one + two + one)
    assert [a.split(b" ", 2)[1] for a in out] == [b"200", b"404", b"200"] and not closing
    assert all(a.count(b"HTTP/1.1 ") == 1 for a in out)


def test_header_names_reach_the_routes_in_any_case():
    """Catches the ETag's 304 lost to a client that writes ``if-none-match`` in lower case."""
    c = _cached()
    route = SnapshotDocument(lambda: c, None)
    etag = dict(route({}).headers)["ETag"]
    raw = f"GET /snapshot.json HTTP/1.1\r\nHost: h\r\nif-none-match: {etag}\r\n\r\n"
    out, _ = _exchange(raw.encode(), {"/snapshot.json": route}, None)
    assert out[0].startswith(b"HTTP/1.1 304 ") and out[0].endswith(b"\r\n\r\n")


@pytest.mark.parametrize(
    "raw,status",
    [
        (b"garbage\r\n\r\n", b"400"),
        (b"GET /x HTTP/1.1\r\n\r\n", b"400"),  # no Host
        (b"GET /x HTTP/1.1\r\nHost: h\r\n" + b"X-Pad: " + b"y" * 40000 + b"\r\n\r\n", b"431"),
        (b"BREW /x HTTP/1.1\r\nHost: h\r\n\r\n", b"501"),
        (b"GET /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", b"501"),
        (b"POST /x HTTP/1.1\r\nHost: h\r\n" + AUTH + b"Content-Length: 9\r\n\r\nab", b"405"),
        (b"GET /x HTTP/1.0\r\n" + AUTH + b"\r\n", b"200"),  # HTTP/1.0: no keep-alive
        (b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n" + AUTH + b"\r\n", b"200"),
    ],
)
def test_requests_the_connection_cannot_carry_on_from_are_answered_and_closed(raw, status):
    """Catches a malformed, oversized or body-carrying request answered with anything but a
    bare status (or not at all), or a connection kept after one."""
    out, closing = _exchange(raw)
    assert len(out) == 1 and out[0].split(b" ", 2)[1] == status and closing
    head, _, body = out[0].partition(b"\r\n\r\n")
    if status != b"200":
        assert body == HTTPStatus(int(status)).phrase.lower().encode() + b"\n"
        assert b"\r\nServer: gputaskman\r\n" in head and b"Python" not in out[0]


def test_a_route_that_fails_gets_a_bare_500_and_the_server_goes_on(server):
    """Catches a route's exception reaching the client as a traceback, or stopping serve."""

    def broken(headers):
        raise RuntimeError("a bug with /secret/path in it")

    raw = b"GET /x HTTP/1.1\r\nHost: h\r\n" + AUTH + b"\r\n"
    out, closing = _exchange(raw, {"/x": broken})
    assert out[0].startswith(b"HTTP/1.1 500 ") and closing and b"secret" not in out[0]
    assert out[0].endswith(b"\r\n\r\ninternal server error\n")
    assert _request(server, "GET", "/x", TOKEN)[0] == 200


REQUEST_PARTS = st.sampled_from(
    [b"GET /x HTTP/1.1\r\nHost: h\r\n", b"HEAD /snapshot.json HTTP/1.1\r\nHost: h\r\n",
     b"POST /x HTTP/1.1\r\n", b"GET /x HTTP/1.0\r\n", AUTH, b"Content-Length: 3\r\n",
     b"Transfer-Encoding: chunked\r\n", b"Connection: close\r\n", b"\r\n", b"\n", b"3\r\nabc",
     b"0\r\n\r\n", b" ", b":", b"\x00", b"\xff"]
)  # fmt: skip


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(REQUEST_PARTS, st.binary(max_size=20)), max_size=12),
    st.integers(1, 64),
    st.booleans(),
)
def test_any_bytes_get_whole_bare_answers_and_nothing_raises(parts, chunk, eof):
    """Catches the server raising on what a client sends, or answering it with anything but
    whole HTTP/1.1 answers; after one that closes, nothing more is answered."""
    data = b"".join(parts)
    conn = httpserve.HttpConnection(_routes(), TOKEN)
    answers = []
    for piece in [data[i : i + chunk] for i in range(0, len(data), chunk)] + [b""] * eof:
        conn.receive_data(piece)
        while not conn.closing and (answer := conn.next_answer()):
            answers.append(answer)
        if conn.closing:
            break
    for answer in answers:
        head, sep, _ = answer.partition(b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 ") and sep and b"\r\nServer: gputaskman\r\n" in head
    assert conn.next_answer() == b"" or not conn.closing


def test_an_idle_connection_is_dropped():
    """Catches a keep-alive connection that holds one of the server's slots for ever."""
    httpd, _ = httpserve.serve(_routes(), "127.0.0.1", 0, idle_timeout=0.3)
    try:
        with socket.create_connection(httpd.server_address[:2], timeout=10) as s:
            s.sendall(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
            got = b""
            started = time.monotonic()
            while chunk := s.recv(65536):
                got += chunk
            assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"x" * 10000)
            assert 0.2 < time.monotonic() - started < 5
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_tls_requires_a_certificate_the_ca_signed(tmp_path):
    """Catches TLS that accepts a client without a certificate, or with a rogue CA's."""
    pki = make_pki(tmp_path)
    ctx = httpauth.server_tls_context(pki["server"], pki["server_key"], pki["ca"])
    httpd, _ = httpserve.serve(_routes(), "127.0.0.1", 0, tls=ctx)
    port = httpd.server_address[1]
    try:
        stalled = socket.create_connection(("127.0.0.1", port), timeout=10)  # never shakes hands

        def client(cert: str | None) -> ssl.SSLContext:
            c = ssl.create_default_context(cafile=str(pki["ca"]))
            if cert:
                c.load_cert_chain(pki[cert], pki[cert + "_key"])
            return c

        code, _, body = _request(port, "GET", "/snapshot.json", tls=client("client"))
        assert code == 200 and json.loads(body)["schema"] == schema.NAME
        for cert in (None, "rogue"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                _request(port, "GET", "/snapshot.json", tls=client(cert))
        stalled.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_refused_tls_client_reads_the_alert_not_a_reset(tmp_path):
    """Catches the fleet TLS test's race (1 poll in 100 under load was "closed without
    answering" instead of refused): with TLS 1.3 a client without a certificate finishes its
    handshake and sends its request before the server refuses it; a server that then closes
    with the request unread makes the kernel reset the connection, and the reset can destroy
    the alert. Reading only after the server has closed makes the reset certain, not a race."""
    pki = make_pki(tmp_path)
    ctx = httpauth.server_tls_context(pki["server"], pki["server_key"], pki["ca"])
    httpd, _ = httpserve.serve(_routes(), "127.0.0.1", 0, tls=ctx)
    try:
        for _ in range(3):
            client = ssl.create_default_context(cafile=str(pki["ca"]))
            client.minimum_version = ssl.TLSVersion.TLSv1_3
            raw = socket.create_connection(httpd.server_address[:2], timeout=10)
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                time.sleep(0.3)  # the server refuses the certificate meanwhile
                tls.sendall(b"GET /snapshot.json HTTP/1.1\r\nHost: x\r\n\r\n")
                time.sleep(0.3)  # a server that closed has answered the request with a reset
                with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
                    tls.recv(1024)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _serve(args: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputaskman.cli", "serve", "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GTM_DUVM_SOCKETS": ""},
    )
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise AssertionError(f"no serving line: {line!r} {proc.stderr.read()}")
    return proc, int(line.split()[2].rsplit(":", 1)[1].split("/")[0])


def _document(port: int, token: str | None = None) -> dict:
    deadline = time.monotonic() + 30
    while True:
        code, _, body = _request(port, "GET", "/snapshot.json", token)
        if code == 200:
            return json.loads(body)
        assert code == 503 and time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("source", ["demo", "replay"])
def test_serve_demo_and_replay_answer_as_hosts_and_say_what_they_are(tmp_path, source):
    """Catches a demo or replayed host whose document does not read back, or that passes for
    a measurement of this machine."""
    token = tmp_path / "t"
    token.write_text(TOKEN)
    token.chmod(0o600)
    args = ["--demo"] if source == "demo" else ["--replay", str(RECORDING)]
    proc, port = _serve([*args, "--sample-interval", "0.1", "--token-file", str(token)])
    try:
        doc = _document(port, TOKEN)
        assert schema.errors(doc) == []
        d = read_document(doc)
        assert abs(d.taken - time.time()) < 30  # a sample of now
        note = "synthetic, not measured" if source == "demo" else "replayed recording"
        assert any(note in n for n in d.notes)
        assert d.adapters and d.processes
        assert _request(port, "GET", "/snapshot.json")[0] == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


def test_the_demo_says_once_that_it_is_synthetic():
    """Catches the demo served with two notes that say the same (the demo snapshot's own and
    one the serve source added): a host view showed both."""
    from gputaskman.fixtures.demo import NOTE
    from gputaskman.serve.sources import DemoSource

    snap, _system = DemoSource().sample_with_system()
    assert [n for n in snap.notes if "synthetic" in n] == [NOTE]


def test_serve_replay_of_a_file_that_holds_no_snapshot_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "serve", "--replay", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no snapshot to replay" in r.stderr and "Traceback" not in r.stderr
