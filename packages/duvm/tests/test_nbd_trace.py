"""`duvm daemon --trace FILE` and `benchmarks/nbd_trace.py`: a real daemon driven by qemu-io
writes one line per request as the client sent it, and the summariser reads such files (and
refuses files that are not traces)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

PY = [sys.executable, "-m", "duvm.cli"]
SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "nbd_trace.py"


def _daemon(sock: str, *extra: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [*PY, "daemon", "--memory", "--size", "8M", "--socket", sock, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "serving" in line, line + (p.stderr.read() if p.stderr else "")
    return p


def test_trace_has_each_request_as_the_client_sent_it(tmp_path: Path, benchmark) -> None:
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io is not installed (CI installs qemu-utils: see .ci/run)")
    trace = tmp_path / "d.trace"
    with tempfile.TemporaryDirectory(prefix="duvm-t-") as d:  # short path for the socket
        sock = os.path.join(d, "d.sock")
        p = _daemon(sock, "--trace", str(trace))
        try:
            r = subprocess.run(
                [
                    "qemu-io",
                    "-f",
                    "raw",
                    f"nbd+unix:///?socket={sock}",
                    "-c",
                    "write -P 7 65536 65536",
                    "-c",
                    "read -P 7 65536 32768",
                    "-c",
                    "read -P 7 98304 32768",
                    "-c",
                    "read -P 0 1048576 4096",
                    "-c",
                    "discard 65536 65536",
                    "-c",
                    "flush",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0 and "Pattern verification failed" not in r.stdout, (
                r.stdout + r.stderr
            )
        finally:
            p.send_signal(signal.SIGTERM)
            assert p.wait(30) == 0
            for f in (p.stdout, p.stderr):
                if f:
                    f.close()
    nt = benchmark("nbd_trace")
    rows = nt.load(trace)
    got = [(cmd, off, n, err) for _, _, cmd, off, n, err in rows]
    want = [
        ("write", 65536, 65536, 0),
        ("read", 65536, 32768, 0),
        ("read", 98304, 32768, 0),
        ("read", 1048576, 4096, 0),
        ("trim", 65536, 65536, 0),
        ("flush", 0, 0, 0),
    ]
    it = iter(got)
    assert all(w in it for w in want), got  # in this order (qemu-io may add its own requests)
    assert all(0 < t0 <= t1 for t0, t1, *_ in rows)
    s = nt.summarise(rows)
    assert s["requests"] == len(rows) and s["errors"] == 0
    assert s["commands"]["read"]["n"] >= 3 and s["commands"]["write"]["n"] >= 1
    assert s["reads_sequential"]["n"] >= 1  # the second read continued the first
    assert s["reads_jump"]["n"] >= 2
    assert s["span_s"] >= s["wall_s_with_read_in_flight"] > 0
    text = nt.report("d", s)
    assert "reads, sequential" in text and "nothing in flight" in text


def test_an_unwritable_trace_path_stops_the_daemon_before_it_serves(tmp_path: Path) -> None:
    sock = str(tmp_path / "d.sock")
    p = subprocess.run(
        [
            *PY,
            "daemon",
            "--memory",
            "--size",
            "8M",
            "--socket",
            sock,
            "--trace",
            str(tmp_path / "missing" / "d.trace"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 1
    assert "cannot write the trace to" in p.stderr and "No such file" in p.stderr
    assert not os.path.exists(sock)


def test_summariser_refuses_what_is_not_a_trace_and_skips_a_cut_last_line(
    tmp_path: Path, benchmark
) -> None:
    nt = benchmark("nbd_trace")
    other = tmp_path / "other.txt"
    other.write_text("hello\n")
    with pytest.raises(nt.TraceError, match="not a duvm NBD trace"):
        nt.load(other)
    bad = tmp_path / "bad.trace"
    bad.write_text(f"# {nt.FORMAT}: x\n1 2 read 0 4096 0\nnot a line\n3 4 read 4096 4096 0\n")
    with pytest.raises(nt.TraceError, match=r"bad.trace:3: malformed"):
        nt.load(bad)
    cut = tmp_path / "cut.trace"  # a daemon killed in the middle of writing a line
    ms = 1_000_000
    cut.write_text(
        f"# {nt.FORMAT}: x\n{5 * ms} {9 * ms} read 4096 4096 0\n"
        f"{ms} {3 * ms} read 0 4096 0\n7 8 wri"
    )
    rows = nt.load(cut)
    assert rows == [(ms, 3 * ms, "read", 0, 4096, 0), (5 * ms, 9 * ms, "read", 4096, 4096, 0)]
    s = nt.summarise(rows)
    assert s["reads_sequential"]["n"] == 1 and s["reads_jump"]["n"] == 1
    assert s["wall_s_idle"] == 0.002  # between 3 and 5 ms nothing was in flight
    assert s["span_s"] == 0.008 and s["wall_s_with_read_in_flight"] == 0.006
    assert nt.summarise([]) == {"requests": 0}
    r = subprocess.run(
        [sys.executable, str(SCRIPT), str(other)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 1 and "not a duvm NBD trace" in r.stderr
