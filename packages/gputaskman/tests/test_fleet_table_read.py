"""The fleet table's part of a document (`reader.read_table_document`): what a poller
that shows only the table reads of every host, and the whole document of the host that is
open. The table's rows and totals must be those of the whole document, for every recording
and fixture and for documents drawn from the schema with every field set; and a poller
reading only the table's part reads the open host whole, at once, from a real serve."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import SnapshotError, read_document, read_table_document
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.fleet.poller import HostState, Poller
from gputaskman.fleet.targets import parse_target
from gputaskman.fleet.view import fleet_rows, fleet_totals, render_text
from gputaskman.render import report
from hypothesis import HealthCheck, given, settings
from test_document import DOCUMENTS

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fleet_helpers import Serve, wait_for  # noqa: E402


def _without_models() -> bytes:
    """The demo with no process's model known: the MODELS cell falls back to an app's
    selected model, else the mapped model files' names."""
    doc = json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))
    for i, p in enumerate(doc["processes"]):
        p["model"] = None
        p["model_files"] = [f"/models/file-{i}.gguf"]
        if i % 2:
            p["app_model"] = {"app": "lmstudio", "selected": f"selected-{i}"}
    return json.dumps(doc).encode()


def _bodies() -> list[bytes]:
    out = [json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())).encode()]
    out.append(_without_models())
    for path in sorted((HERE / "recordings").glob("*.jsonl")):
        out += [ln for ln in path.read_bytes().splitlines() if ln.strip()]
    return out


def _table(body: bytes) -> tuple:
    """What the fleet shows of one host: its rows (every cell), text and totals."""
    states = [
        HostState(parse_target("gpu1"), HostStatus.UP, None, doc)
        for doc in (read_document(body), read_table_document(body))
    ]
    return tuple(
        (
            [
                (
                    r.key,
                    r.gpu,
                    r.memory_used,
                    r.memory_total,
                    r.util,
                    r.processes,
                    r.models,
                    r.commands,  # what the filter reads (a command line: not shown)
                )
                for r in fleet_rows([s])
            ],
            fleet_totals([s]),
            render_text([s]),
        )
        for s in states
    )


@pytest.mark.parametrize("i", range(len(_bodies())))
def test_every_recording_s_table_is_the_whole_document_s(i):
    """Catches a field the table shows that the table's read leaves out (a model, a
    breakdown's estimated total in the fleet's "apart" sum); a process without a model
    included (its mapped files and an app's selected model are not the table's)."""
    whole, table = _table(_bodies()[i])
    assert table == whole


@given(DOCUMENTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_document_with_every_field_set_gives_the_same_table(doc):
    whole, table = _table(json.dumps(doc).encode())
    assert table == whole


def test_the_table_s_part_leaves_out_what_no_table_shows():
    """The command lines are in it (the table's filter reads them); the system section, the
    runtimes and the model evidence are not."""
    body = _bodies()[0]
    whole, part = read_document(body), read_table_document(body)
    assert whole.system is not None and part.system is None
    assert any(p.proc.detail.cmdline for p in whole.processes)
    assert [p.proc.detail.cmdline for p in part.processes] == [
        p.proc.detail.cmdline for p in whole.processes
    ]
    assert not any(p.proc.detail.runtimes or p.proc.detail.model_evidence for p in part.processes)


@pytest.mark.slow
def test_an_open_host_is_read_whole_at_once_and_the_others_stay_the_table_s():
    """Catches a poller that keeps showing the table's part of the host that is open (its
    view would have no command lines, no system panel), or one that reads every host whole
    (the cost the table's read saves)."""
    serves = [Serve(["--demo"]).start(), Serve(["--demo"]).start()]
    poller = None
    try:
        for s in serves:
            s.ready()
        targets = [parse_target(f"127.0.0.1:{s.port}") for s in serves]
        poller = Poller(targets, interval=0.3, table_only=True)
        poller.start()
        assert poller.wait_polled(10)
        wait_for(lambda: all(s.up for s in poller.states()), 10, "both hosts up")
        assert all(not s.whole and s.document.system is None for s in poller.states())
        name = targets[0].name
        poller.focus(name)
        wait_for(lambda: poller.states()[0].whole, 5, "the open host read whole")
        seq = poller.states()[0].seq
        wait_for(lambda: poller.states()[0].seq >= seq + 2, 10, "two new samples of it")
        opened, other = poller.states()
        assert opened.whole and opened.document.system is not None and opened.up
        assert any(p.proc.detail.cmdline for p in opened.document.processes)
        assert not other.whole and other.document.system is None
    finally:
        if poller is not None:
            poller.stop()
        for s in serves:
            s.stop()


class OneDocument:
    """A loopback host that serves `body` to every request, closing after each answer; with
    `etag`, under an ETag, answering 304 to a request that names it (as serve does)."""

    def __init__(self, body: bytes, etag: bool) -> None:
        self.body, self.etag = body, etag
        self.not_modified = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    request = conn.recv(65536)
                    if self.etag and b'if-none-match: "one"' in request.lower():
                        self.not_modified += 1
                        conn.sendall(b"HTTP/1.1 304 Not Modified\r\nConnection: close\r\n\r\n")
                        continue
                    tag = b'ETag: "one"\r\n' if self.etag else b""
                    head = b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + tag
                    conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _refused_whole() -> bytes:
    """The demo with a field the table does not read broken: its table's part reads, the
    whole document is refused."""
    doc = json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))
    doc["notes"] = 5
    body = json.dumps(doc).encode()
    assert read_table_document(body).adapters
    with pytest.raises(SnapshotError):
        read_document(body)
    return body


def _polls_later(poller: Poller, n: int) -> None:
    start = poller.states()[0].polls
    wait_for(lambda: poller.states()[0].polls >= start + n, 10, f"{n} more polls")


@pytest.mark.parametrize("etag", [False, True], ids=["same-bytes", "etag-304"])
def test_a_host_whose_whole_document_is_refused_stays_refused_open_or_not(etag):
    """Catches a host that is "up" again (and in the fleet's totals) at the poll after its
    whole document was refused when it was opened in the TUI, its table's part having read
    fine: the same bytes again (or the ETag's 304 for them) were taken for the unchanged good
    document, then marked whole."""
    host = OneDocument(_refused_whole(), etag)
    target = parse_target(f"127.0.0.1:{host.port}")
    poller = Poller([target], interval=0.2, timeout=5.0, backoff_max=0.2, table_only=True)
    poller.start()
    try:
        wait_for(lambda: poller.states()[0].up, 10, "the table's part read")
        assert not poller.states()[0].whole and fleet_totals(poller.states()).up == 1
        poller.focus(target.name)  # opened: read whole, refused
        wait_for(lambda: not poller.states()[0].up, 10, "the whole document refused")
        for opened in (True, False):
            _polls_later(poller, 4)
            s = poller.states()[0]
            assert s.status is HostStatus.INCOMPATIBLE, (opened, s)
            assert "notes" in (s.reason or "") and not s.whole
            t = fleet_totals(poller.states())
            assert (t.up, t.gpus, t.used_bytes) == (0, 0, None)
            assert "hosts 0/1 up (1 incompatible)" in render_text(poller.states())
            poller.focus(None)  # closed again: still refused
    finally:
        poller.stop()
        host.close()
    if etag:
        assert host.not_modified > 0


def test_once_counts_no_host_that_json_calls_incompatible():
    """Catches ``fleet --once`` counting a host as up (its table's part read) whose whole
    document ``--json`` refuses: the two outputs disagreed on the fleet's totals."""
    host = OneDocument(_refused_whole(), etag=False)
    try:
        out = {}
        for mode in ("--once", "--json"):
            r = subprocess.run(
                [sys.executable, "-m", "gputaskman.cli", "fleet", mode, f"127.0.0.1:{host.port}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            out[mode] = r.stdout
    finally:
        host.close()
    assert json.loads(out["--json"])["summary"]["hosts_up"] == 0
    assert out["--once"].startswith("hosts 0/1 up (1 incompatible) · GPU memory: n/a")
    assert "incompatible: unreadable snapshot: notes" in out["--once"]
