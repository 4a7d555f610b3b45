"""duvm --metrics: real memservers and a real daemon on loopback, pages written by a real NBD
client (qemu-io), both endpoints scraped over HTTP and parsed with prometheus_client's own
text parser."""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.base import metrics
from duvm.memserver.metrics import MEMSERVER_KINDS
from duvm.node.daemon.metrics import NBD_KINDS
from duvm.wire import nbdconst, pageproto
from duvm_processes import start as _start
from duvm_processes import stop as _stop
from prometheus_client.parser import text_string_to_metric_families

PAGE = 4096
ROOT = Path(__file__).parents[3]


def _dashboard_checker():
    pytest.importorskip("jsonschema")
    spec = importlib.util.spec_from_file_location(
        "check_dashboard", ROOT / "dashboards" / "check_dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _url(log: Path) -> str:
    return log.read_text().split("metrics on ")[1].split()[0]


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(got: dict[str, list], name: str, **labels: str) -> float:
    hits = [s.value for s in got[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, got.get(name))
    return hits[0]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for p in reversed(started):  # the daemon first: it releases its reservations
            _stop(p)


def test_memserver_and_daemon_endpoints_scrape_cleanly(tmp_path: Path, procs):
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io (qemu-utils) is not installed")
    logs = [tmp_path / "ms0.log", tmp_path / "ms1.log"]
    ports = []
    for log in logs:
        procs.append(
            _start(
                [
                    "memserver",
                    "--listen",
                    "127.0.0.1:0",
                    "--capacity",
                    "16M",
                    "--no-mlock",
                    "--metrics",
                    "127.0.0.1:0",
                ],
                "listening on",
                log,
            )
        )
        ports.append(int(log.read_text().split("listening on 127.0.0.1:")[1].split()[0]))
    nbd = str(tmp_path / "nbd.sock")
    dlog = tmp_path / "daemon.log"
    procs.append(
        _start(
            [
                "daemon",
                "--peers",
                ",".join(f"127.0.0.1:{p}" for p in ports),
                "--size",
                "4M",
                "--replicas",
                "2",
                "--socket",
                nbd,
                "--no-mlock",
                "--client-id",
                "node-a",
                "--metrics",
                "127.0.0.1:0",
            ],
            "serving export",
            dlog,
        )
    )
    r = subprocess.run(
        [
            "qemu-io",
            "-f",
            "raw",
            "-c",
            "write -P 5 0 512k",
            "-c",
            "read -P 5 0 512k",
            "-c",
            "discard 0 64k",
            f"nbd+unix:///?socket={nbd}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr

    ms = scrape(_url(logs[0]))
    assert one(ms, "duvm_scrape_snapshot_ok") == 1
    assert one(ms, "duvm_memserver_capacity_bytes") == 16 << 20
    assert one(ms, "duvm_memserver_reserved_bytes") == 4 << 20
    assert one(ms, "duvm_memserver_namespace_reserved_pages", client_id="node-a") == 1024
    assert one(ms, "duvm_memserver_namespace_stored_pages", client_id="node-a") == 128 - 16
    assert one(ms, "duvm_memserver_used_bytes") == (128 - 16) * PAGE
    assert one(ms, "duvm_memserver_pages_total", op="store") == 128
    assert one(ms, "duvm_memserver_pages_total", op="free") == 16
    # latency histograms: one per request kind, cumulative buckets ending in +Inf
    for op in ("store", "free"):
        count = one(ms, "duvm_memserver_request_seconds_count", op=op)
        assert count >= 1
        assert one(ms, "duvm_memserver_request_seconds_bucket", op=op, le="+Inf") == count
        assert one(ms, "duvm_memserver_request_seconds_sum", op=op) > 0
        buckets = [
            s.value for s in ms["duvm_memserver_request_seconds_bucket"] if s.labels["op"] == op
        ]
        assert buckets == sorted(buckets)
    # reads went to the first replica only, so LOAD counts are per memserver: they add up
    loads = one(ms, "duvm_memserver_request_seconds_count", op="load") + one(
        scrape(_url(logs[1])), "duvm_memserver_request_seconds_count", op="load"
    )
    assert loads >= 1

    d = scrape(_url(dlog))
    assert one(d, "duvm_scrape_snapshot_ok") == 1
    assert one(d, "duvm_daemon_export_bytes") == 4 << 20
    assert one(d, "duvm_daemon_replicas") == 2
    assert one(d, "duvm_daemon_degraded_slabs") == 0
    assert one(d, "duvm_daemon_pages_written") == 128 - 16
    for p in ports:
        peer = f"127.0.0.1:{p}"
        assert one(d, "duvm_daemon_peer_up", peer=peer) == 1
        assert one(d, "duvm_daemon_peer_pages", peer=peer) == 128 - 16
        assert one(d, "duvm_daemon_peer_reserved_pages", peer=peer) == 1024
        assert one(d, "duvm_daemon_peer_transport", peer=peer, transport="tcp") == 1
    assert one(d, "duvm_daemon_failovers_total") == 0
    assert one(d, "duvm_daemon_repairs_total") == 0
    for op in ("read", "write", "trim"):
        assert one(d, "duvm_daemon_nbd_request_seconds_count", op=op) >= 1
    assert one(d, "duvm_daemon_nbd_errors_total") == 0

    # dashboards/duvm.json: Grafana's dashboard model, and only metrics these scrapes exported
    check = _dashboard_checker()
    dash = json.loads((ROOT / "dashboards" / "duvm.json").read_text())
    assert check.problems(dash, set(ms) | set(d) | set(scrape(_url(logs[1])))) == []
    assert {
        "duvm_daemon_degraded_slabs",
        "duvm_daemon_failovers_total",
        "duvm_memserver_request_seconds_bucket",
    } <= check.metric_names(dash)


def test_memory_daemon_exports_no_pool_metrics(tmp_path: Path, procs):
    """--memory has no pool: replication figures are unknown, so absent (never 0)."""
    dlog = tmp_path / "daemon.log"
    procs.append(
        _start(
            [
                "daemon",
                "--memory",
                "--size",
                "1M",
                "--socket",
                str(tmp_path / "nbd.sock"),
                "--metrics",
                "127.0.0.1:0",
            ],
            "serving export",
            dlog,
        )
    )
    d = scrape(_url(dlog))
    assert one(d, "duvm_daemon_export_bytes") == 1 << 20
    assert not [
        n
        for n in d
        if n.startswith(
            (
                "duvm_daemon_peer_",
                "duvm_daemon_degraded",
                "duvm_daemon_failovers",
                "duvm_daemon_repairs",
            )
        )
    ]
    assert not [n for n in d if n.startswith(("python_", "process_"))]  # own registry only


def test_memserver_control_socket_reports_what_it_lends(tmp_path: Path, procs):
    ctl = tmp_path / "ms.ctl"
    procs.append(
        _start(
            [
                "memserver",
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                "8M",
                "--no-mlock",
                "--control-socket",
                str(ctl),
            ],
            "listening on",
            tmp_path / "ms.log",
        )
    )
    assert ctl.stat().st_mode & 0o777 == 0o600  # owner-only, like the daemon's
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(ctl))
        s.sendall(b'{"cmd": "status"}\n')
        buf = b""
        while not buf.endswith(b"\n"):
            buf += s.recv(65536)
    st = json.loads(buf)
    assert st["role"] == "memserver" and st["capacity_pages"] == 2048
    assert st["namespaces"] == [] and st["used_pages"] == 0
    assert _stop(procs.pop()) == 0
    assert not ctl.exists()  # removed on exit


def test_bad_or_taken_metrics_address_is_a_clear_error(tmp_path: Path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "duvm.cli",
            "daemon",
            "--memory",
            "--size",
            "1M",
            "--socket",
            str(tmp_path / "s"),
            "--metrics",
            "nope",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "duvm.cli",
                "memserver",
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                "1M",
                "--no-mlock",
                "--metrics",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "duvm.cli",
                "daemon",
                "--memory",
                "--size",
                "1M",
                "--socket",
                str(tmp_path / "s"),
                "--metrics",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr
    assert not (tmp_path / "s").exists()


def test_latency_histogram_buckets_are_cumulative_with_le_semantics():
    h = metrics.LatencyHistogram((0.001, 0.01))
    for ns in (500_000, 1_000_000, 1_000_001, 20_000_000):  # 0.5 ms, exactly 1 ms, just over
        h.observe_ns(ns)
    buckets, total = h.buckets()
    assert buckets == [("0.001", 2.0), ("0.01", 3.0), ("+Inf", 4.0)]
    assert total == pytest.approx(0.022500001)


def test_request_kinds_match_the_protocols():
    assert MEMSERVER_KINDS == {
        pageproto.MsgType.STORE: "store",
        pageproto.MsgType.LOAD: "load",
        pageproto.MsgType.FREE: "free",
    }
    assert NBD_KINDS[nbdconst.CMD_READ] == "read"
    assert NBD_KINDS[nbdconst.CMD_WRITE] == "write"
    lat = metrics.LatencyByKind(NBD_KINDS)
    lat.observe_ns(nbdconst.CMD_DISC, 5)  # not a timed kind: ignored, no crash
    assert all(lat.count(code) == 0 for code in NBD_KINDS)
    lat.observe_ns(nbdconst.CMD_READ, 1_000_000)
    assert lat.count(nbdconst.CMD_READ) == 1 and lat.count(nbdconst.CMD_WRITE) == 0
