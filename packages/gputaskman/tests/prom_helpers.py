"""A real Prometheus server for the fleet tests (Debian's ``prometheus``, installed by
.ci/run), and a loopback HTTP server that answers as a Prometheus would, or as a broken one
does: recorded answers, garbage, an error status, a huge body, a stall."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

PROMETHEUS = shutil.which("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """One ``prometheus`` process on loopback with its own data directory, scraping
    `targets` every second as the job ``gputaskman`` (extra YAML: `web_config` for TLS), or
    as `config` says, or running the configuration file `config_file` where it lies (its
    relative paths read from its own directory, as Prometheus reads them)."""

    def __init__(
        self,
        d: Path,
        targets: list[str],
        token_file: Path | None = None,
        web_config: str | None = None,
        config: str | None = None,
        config_file: Path | None = None,
    ) -> None:
        if PROMETHEUS is None:
            pytest.skip("prometheus is not installed (apt install prometheus; .ci/run does)")
        self.dir = d
        self.port = free_port()
        auth = ""
        if token_file is not None:
            auth = f"    authorization:\n      credentials_file: {token_file}\n"
        self.config_file = config_file or d / "prometheus.yml"
        if config_file is None:
            self.config_file.write_text(
                config
                or "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                "scrape_configs:\n  - job_name: gputaskman\n"
                f"{auth}"
                f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
            )
        if web_config is not None:
            (d / "web.yml").write_text(web_config)
        self.web_config = web_config
        self.tls = web_config is not None and "tls_server_config" in web_config
        self.log = open(d / "prometheus.log", "wb")  # noqa: SIM115 (closed in stop)
        self._spawn()

    def _spawn(self) -> None:
        args = [
            PROMETHEUS,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        if self.web_config is not None:
            args.append(f"--web.config.file={self.dir / 'web.yml'}")
        self.log.flush()
        self._log_from = (self.dir / "prometheus.log").stat().st_size  # this run's lines
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> Prometheus:
        """Until `/-/ready` answers 200: Prometheus listens before its storage is open and
        answers queries 503 until then, which a loaded machine makes long enough to hit. A
        TLS server asks for a client certificate, so only its listening socket is awaited
        (its tests wait for their answer through gputaskman, which retries)."""
        deadline = time.monotonic() + timeout
        retries = 5
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "prometheus.log").read_bytes()[self._log_from :].decode()
                # the port was free when picked, but another socket may have taken it since
                if "address already in use" in log and retries > 0:
                    retries -= 1
                    self.port = free_port()
                    self._spawn()
                    continue
                raise AssertionError(f"prometheus exited: {log}")
            if self._ready():
                return self
            time.sleep(0.1)
        raise AssertionError("prometheus did not become ready")

    def _ready(self) -> bool:
        if self.tls:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                return r.status == 200
        except OSError:  # refused while starting, or HTTPError 503 until the storage is open
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query straight from the HTTP API (plain HTTP only)."""
        q = urllib.parse.urlencode({"query": expr})
        return self.api(f"/api/v1/query?{q}")["result"]

    def api(self, path: str) -> Any:
        """The ``data`` of one HTTP API answer (plain HTTP only)."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as r:
            return json.loads(r.read())["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


Handler = Callable[[BaseHTTPRequestHandler, str, Mapping[str, list[str]]], None]


class FakePrometheus:
    """A loopback HTTP server whose every request goes to `handler(request, path, params)`
    (the query string's or the POSTed form's parameters). `requests` records
    (path, params, Authorization header), `methods` each one's method."""

    def __init__(self, handler: Handler) -> None:
        self.requests: list[tuple[str, dict[str, list[str]], str | None]] = []
        self.methods: list[str] = []  # each request's, in order
        fake = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                path, _, query = self.path.partition("?")
                if self.command == "POST":
                    n = int(self.headers.get("Content-Length") or 0)
                    query = self.rfile.read(n).decode()
                params = urllib.parse.parse_qs(query)
                fake.requests.append((path, params, self.headers.get("Authorization")))
                fake.methods.append(self.command)
                handler(self, path, params)

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _H)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def answer(
    h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "application/json"
) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    with contextlib.suppress(OSError):
        h.wfile.write(body)


_MATCHER = re.compile(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"')


def select(series: list[dict[str, Any]], selector: str) -> list[dict[str, Any]]:
    """The series a ``{label="v",label=~"re",...}`` selector picks (the forms the fleet
    sends; Python's regular expressions standing in for RE2's, anchored as Prometheus's)."""
    out = series
    for label, op, raw in _MATCHER.findall(selector):
        value = raw.encode().decode("unicode_escape")
        if op == "=":
            out = [s for s in out if s["metric"].get(label, "") == value]
        else:
            rx = re.compile(value)
            out = [s for s in out if rx.fullmatch(s["metric"].get(label, ""))]
    return out


def recorded(answers: Mapping[str, Any]) -> Handler:
    """A handler answering the recorded queries and targets (`answers` as
    tests/recordings/prometheus_answers.json holds them). A series selector that was not
    recorded is answered from the recorded answer to the widest one (every ``gputaskman_*``
    series of the job), as Prometheus would select; any other query gets the empty vector."""
    widest = next(v for k, v in answers["queries"].items() if k.startswith("{"))

    def handle(h: BaseHTTPRequestHandler, path: str, params: Mapping[str, list[str]]) -> None:
        if path == "/api/v1/targets":
            return answer(h, 200, json.dumps(answers["targets"]).encode())
        q = params.get("query", [""])[0]
        empty = {"status": "success", "data": {"resultType": "vector", "result": []}}
        got = answers["queries"].get(q)
        if got is None and q.startswith("{"):
            picked = select(widest["data"]["result"], q)
            got = {**widest, "data": {**widest["data"], "result": picked}}
        answer(h, 200, json.dumps(got or empty).encode())

    return handle


@contextlib.contextmanager
def fake_prometheus(handler: Handler) -> Iterator[FakePrometheus]:
    f = FakePrometheus(handler)
    try:
        yield f
    finally:
        f.close()
