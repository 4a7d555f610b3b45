"""`gputaskman serve` / exporter: scrapes parsed by prometheus_client's own text parser.

The GPU numbers in the `test_nvml_mocked_*` tests are mocked (this machine has no GPU): the
snapshots are built from the real model classes (tests/mocked_snapshots.py) and exported by
the real collector. `test_serve_real_*` runs the real command on this GPU-less machine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gputaskman.base.readings import Kind, ModelRef, Reading, Reason
from gputaskman.cli import serve
from gputaskman.intel.llm import LlmView, ViewPart
from gputaskman.render.exporter import Cached, SnapshotCollector
from gputaskman.render.exporter_families import metric_name
from gputaskman.sampling.host import HostSampler
from gputaskman.serve import server
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
ms = __import__("mocked_snapshots")


def scrape(cached: Cached | None) -> dict[str, list]:
    """Name -> samples, through generate_latest and the real text parser."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(lambda: cached))
    text = generate_latest(reg).decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _mock_snapshot():
    a0, a1 = ms.adapter(0, ms.BUS0), ms.adapter(1, ms.BUS1, uuid="GPU-second")
    m1 = ms.metrics(used=0, util=None, power=None)  # a measured zero, two unknowns
    llama = ms.proc(101, 3 * ms.GIB, name="llama-server")
    llama = llama.__class__(
        **{
            **{f: getattr(llama, f) for f in llama.__slots__},
            "model": ModelRef("qwen2.5-7b", "mapped", confirmed=True),
            "breakdown": LlmView(
                "qwen2.5-7b",
                None,
                "mapped",
                "confirmed",
                "",
                parts=(
                    ViewPart("weights", Reading.runtime(2 * ms.GIB, "log")),
                    ViewPart("kv_cache", Reading.estimated(ms.GIB, "gguf")),
                    ViewPart(
                        "compute", Reading.missing(Reason.UNAVAILABLE, "x", kind=Kind.ESTIMATED)
                    ),
                ),
                reported_total=2 * ms.GIB,
                estimated_total=ms.GIB,
            ),
        }
    )
    guess = ms.proc(102, 512 * ms.MIB, name="python3")
    guess = guess.__class__(
        **{
            **{f: getattr(guess, f) for f in guess.__slots__},
            "model": ModelRef("maybe-model", "cmdline"),
        }
    )
    hidden = ms.proc(
        103, None, name="hidden", bus=ms.BUS1, reason=Reason.HIDDEN, inferred=256 * ms.MIB
    )
    snap = ms.snapshot(
        adapters=(a0, a1),
        metrics_by_bus={ms.BUS0: ms.metrics(), ms.BUS1: m1},
        procs=(llama, guess, hidden),
    )
    return snap


def test_nvml_mocked_scrape_names_labels_and_provenance():
    got = scrape(Cached(_mock_snapshot(), None, time.time(), 0.01))
    assert got["gputaskman_backend_up"][0].value == 1
    # device: labels identify the GPU; measured values carry provenance="measured"
    total = got["gputaskman_gpu_memory_total_bytes"]
    assert {(s.labels["gpu"], s.labels["pci_bus_id"], s.labels["uuid"]) for s in total} == {
        ("0", ms.BUS0, f"GPU-mock-{ms.BUS0}"),
        ("1", ms.BUS1, "GPU-second"),
    }
    assert all(s.labels["provenance"] == "measured" and s.value == 16 * ms.GIB for s in total)
    # a measured zero is exported as 0; unknowns are absent (not 0)
    used = {s.labels["gpu"]: s.value for s in got["gputaskman_gpu_memory_used_bytes"]}
    assert used == {"0": 4 * ms.GIB, "1": 0}
    assert [s.labels["gpu"] for s in got["gputaskman_gpu_utilization_percent"]] == ["0"]
    assert [s.labels["gpu"] for s in got["gputaskman_gpu_power_watts"]] == ["0"]
    assert "gputaskman_gpu_encoder_utilization_percent" not in got  # not supported anywhere
    assert got["gputaskman_gpu_clock_sm_hertz"][0].value == 1800e6
    # processes: measured VRAM under the base name; the model only in its info series
    vram = {s.labels["pid"]: s for s in got["gputaskman_process_vram_bytes"]}
    assert set(vram) == {"101", "102"}  # 103's memory is hidden: absent, not 0
    assert "model" not in vram["101"].labels and vram["101"].value == 3 * ms.GIB
    assert vram["102"].labels["name"] == "python3"
    assert vram["101"].labels["pci_bus_id"] == ms.BUS0
    # inferred, estimated and runtime values live under their own names, never the base one
    inf = got["gputaskman_process_vram_inferred_bytes"]
    assert [(s.labels["pid"], s.labels["provenance"], s.value) for s in inf] == [
        ("103", "inferred", 256 * ms.MIB)
    ]
    est = got["gputaskman_process_vram_estimated_bytes"]
    assert [(s.labels["pid"], s.labels["provenance"], s.value) for s in est] == [
        ("101", "estimated", ms.GIB)
    ]
    rt = got["gputaskman_process_vram_runtime_bytes"]
    assert [(s.labels["pid"], s.value) for s in rt] == [("101", 2 * ms.GIB)]
    parts = {(s.name, s.labels["part"]) for n in got for s in got[n] if "llm_part" in n}
    assert parts == {
        ("gputaskman_process_llm_part_runtime_bytes", "weights"),
        ("gputaskman_process_llm_part_estimated_bytes", "kv_cache"),
    }  # compute n/a
    info = {
        (s.labels["pid"], s.labels["model_name"], s.labels["confirmed"])
        for s in got["gputaskman_process_model_info"]
    }
    assert info == {("101", "qwen2.5-7b", "true"), ("102", "maybe-model", "false")}
    # the measured sum counts measured bytes only (the inferred 256 MiB is not in it)
    att = {s.labels["gpu"]: s.value for s in got["gputaskman_gpu_attributed_bytes"]}
    assert att == {"0": 3 * ms.GIB + 512 * ms.MIB}
    complete = {s.labels["gpu"]: s.value for s in got["gputaskman_gpu_attributed_complete"]}
    assert complete == {"0": 1}


def test_a_process_s_series_keep_their_names_and_labels_when_its_model_is_confirmed():
    """Catches a label that changes while a process lives on the series of its numbers
    (the model, empty until confirmed: each VRAM series would end and a new one begin, and a
    rate() or a dashboard's history would break there), a unit doubled in a name
    (``..._gpu_percent_utilization_percent``), and a process row with no series at all (a
    CPU-only runtime: every number unknown)."""
    snap = _mock_snapshot()
    engines = {
        "gpu_percent": Reading.measured(87, "mock"),
        "encoder_percent": Reading.measured(3, "m"),
    }
    guess = dataclasses.replace(snap.processes[1], engines=engines)
    cpu_only = ms.proc(104, None, name="llama-cli", bus=None, reason=Reason.NOT_LISTED)
    before = dataclasses.replace(
        snap, processes=(snap.processes[0], guess, snap.processes[2], cpu_only)
    )
    model = dataclasses.replace(guess.model, confirmed=True, status="confirmed")
    after = dataclasses.replace(
        before,
        processes=tuple(
            dataclasses.replace(p, model=model) if p is guess else p for p in before.processes
        ),
    )

    def series(snapshot) -> dict[str, set[tuple]]:
        got = scrape(Cached(snapshot, None, time.time(), 0.01))
        return {
            n: {tuple(sorted(s.labels.items())) for s in got[n]}
            for n in got
            if n.startswith("gputaskman_process_") and n != "gputaskman_process_model_info"
        }

    was, now = series(before), series(after)
    assert was == now
    names = set(now)
    assert "gputaskman_process_gpu_utilization_percent" in names
    assert "gputaskman_process_encoder_utilization_percent" in names
    assert not [n for n in names if n.count("_percent") > 1 or n.count("_bytes") > 1]
    assert not [k for n in now for s in now[n] for k, _ in s if k == "model"]
    # the model moves in its info series alone, joined on the process's labels
    info = scrape(Cached(after, None, time.time(), 0.01))["gputaskman_process_model_info"]
    (mine,) = [s for s in info if s.labels["pid"] == "102"]
    assert (mine.labels["model_name"], mine.labels["confirmed"]) == ("maybe-model", "true")
    # every row has its info series, the CPU-only one too (no GPU: empty GPU labels)
    rows = {dict(labels)["pid"]: dict(labels) for labels in now["gputaskman_process_info"]}
    assert set(rows) == {"101", "102", "103", "104"}
    assert rows["104"]["pci_bus_id"] == "" and rows["104"]["contexts"] == ""
    assert rows["101"]["contexts"] == "compute"


def _platform_rows_snapshot():
    """Rows as the Windows/macOS/WSL backends build them (mocked: no such OS here)."""
    base = ms.proc(201, 2 * ms.GIB, name="game.exe")
    paged = dataclasses.replace(base, paged=Reading.measured(300 * ms.MIB, "pdh:Non Local Usage"))
    paged_unknown = dataclasses.replace(
        base, pid=202, paged=Reading.missing(Reason.UNAVAILABLE, "pdh:Non Local Usage", "x")
    )
    mac = dataclasses.replace(
        base,
        pid=203,
        name="Safari",
        paged=Reading.measured(0, "task_vm_info:compressed"),
        footprint=Reading.measured(5 * ms.GIB, "proc_pid_rusage:ri_phys_footprint"),
    )
    mac_denied = dataclasses.replace(
        base, pid=204, footprint=Reading.missing(Reason.DENIED, "proc_pid_rusage", "EPERM")
    )
    linux = ms.proc(205, ms.GIB)  # NVML measures neither
    # a Windows host row whose PID is this test process's own PID here
    host_row = dataclasses.replace(
        base, pid=os.getpid(), create_time=None, host="windows", name="vmwp.exe"
    )
    return ms.snapshot(procs=(paged, paged_unknown, mac, mac_denied, linux, host_row))


def test_platform_mocked_paged_and_footprint_match_json_and_unknown_is_absent():
    snap = _platform_rows_snapshot()
    sysinfo = HostSampler(duvm=False).sample(pids=[os.getpid()])
    got = scrape(Cached(snap, sysinfo, time.time(), 0.01))
    doc = ms.doc(snap, sysinfo)
    for metric, key in (
        ("gputaskman_process_paged_bytes", "paged_bytes"),
        ("gputaskman_process_footprint_bytes", "footprint_bytes"),
    ):
        series = {s.labels["pid"]: s for s in got[metric]}
        known = {
            ("windows:" if p["host"] else "") + str(p["pid"]): p[key]["value"]
            for p in doc["processes"]
            if p[key] is not None and p[key]["value"] is not None
        }
        # exactly the values --json has; unknown (202, 204) and unmeasured (NVML 205): absent
        assert {pid: s.value for pid, s in series.items()} == known
        assert all(s.labels["provenance"] == "measured" for s in series.values())
    assert set(known) == {"203"}
    paged = {s.labels["pid"]: s.value for s in got["gputaskman_process_paged_bytes"]}
    assert paged == {"201": 300 * ms.MIB, "203": 0}  # a measured zero stays 0
    # never mixed into VRAM or the measured sum
    vram = {s.labels["pid"]: s.value for s in got["gputaskman_process_vram_bytes"]}
    assert vram["203"] == 2 * ms.GIB and vram[f"windows:{os.getpid()}"] == 2 * ms.GIB
    assert got["gputaskman_gpu_attributed_bytes"][0].value == doc["attributed_bytes"]
    # the host row: its own pid label, and no RAM/CPU borrowed from the local process
    ram = {s.labels["pid"] for s in got.get("gputaskman_process_ram_bytes", [])}
    assert sysinfo.processes[os.getpid()].rss_bytes is not None
    assert f"windows:{os.getpid()}" not in ram and str(os.getpid()) not in ram


def test_nvml_mocked_no_sample_yet_and_backend_down():
    before = scrape(None)  # the sampler has not finished its first sample
    assert list(before) == ["gputaskman_sample_ready"]
    assert before["gputaskman_sample_ready"][0].value == 0
    snap = ms.snapshot(unavailable=Reason.NO_LIBRARY)
    got = scrape(Cached(snap, None, time.time(), 0.0))
    assert got["gputaskman_backend_up"][0].value == 0
    assert not [n for n in got if n.startswith(("gputaskman_gpu_", "gputaskman_process_"))]
    probs = got["gputaskman_sample_problems"]
    assert [(s.labels["where"], s.labels["reason"], s.value) for s in probs] == [
        ("backend.init", "library not found", 1)
    ]


def test_real_host_sample_exports_system_and_no_unknowns():
    """The system part from a real /proc sample of this machine."""
    sysinfo = HostSampler(duvm=False).sample()
    got = scrape(Cached(ms.snapshot(unavailable=Reason.NO_LIBRARY), sysinfo, time.time(), 0))
    total = got["gputaskman_system_memory_total_bytes"][0]
    assert total.value == sysinfo.memory.total_bytes.value
    assert total.labels == {"provenance": "measured"}
    # CPU% of a first sample is a rate without two points: unknown, so absent
    assert sysinfo.cpu.percent.value is None
    assert "gputaskman_system_cpu_percent" not in got


def test_metric_name_keeps_kinds_apart():
    assert (
        metric_name("gputaskman_process_vram", "bytes", Kind.MEASURED)
        == "gputaskman_process_vram_bytes"
    )
    assert {metric_name("x", "bytes", k) for k in Kind} == {
        "x_bytes",
        "x_inferred_bytes",
        "x_estimated_bytes",
        "x_runtime_bytes",
    }


@given(st.text(max_size=40))
def test_parse_listen_never_crashes(text):
    try:
        host, port = serve.parse_listen(text)
    except Exception as e:
        assert type(e).__name__ == "ArgumentTypeError"
    else:
        assert 0 <= port <= 65535 and isinstance(host, str)


def test_parse_listen_forms():
    assert serve.parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert serve.parse_listen("[::1]:9835") == ("::1", 9835)
    assert serve.parse_listen(":9835") == ("0.0.0.0", 9835)


class _Counting:
    """A real collector, counting the samples taken (to show scrapes never sample)."""

    def __init__(self) -> None:
        from gputaskman.sampling.collector import SCAN_BUDGET, Collector

        self.inner = Collector(scan_budget=SCAN_BUDGET)
        self.samples = 0

    def prime(self) -> None:
        self.inner.prime()

    def sample_with_system(self):
        self.samples += 1
        return self.inner.sample_with_system()

    def close(self) -> None:
        self.inner.close()


def test_scrapes_read_the_cache_and_never_sample():
    holder: list[_Counting] = []

    def factory() -> _Counting:
        holder.append(_Counting())
        return holder[0]

    sampler = server.Sampler(factory, interval=3600)
    sampler.start()
    try:
        deadline = time.monotonic() + 30
        while sampler.latest() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.latest() is not None
        for _ in range(20):
            scrape(sampler.latest())
        assert holder[0].samples == 1
    finally:
        sampler.stop()
    assert not sampler._thread.is_alive()


def _serve(args: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gputaskman.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    if "serving http://" not in line:
        proc.kill()
        raise AssertionError(f"no serving line: {line!r} {proc.stderr.read()}")
    return proc, line.split()[2]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def test_serve_real_gpu_less_machine_scrapes_cleanly():
    proc, url = _serve(
        ["serve", "--listen", "127.0.0.1:0", "--sample-interval", "0.2"], {"GTM_DUVM_SOCKETS": ""}
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            fams = {f.name: f for f in text_string_to_metric_families(_get(url))}
            if fams["gputaskman_sample_ready"].samples[0].value == 1:
                break
            assert time.monotonic() < deadline, "no sample within 30 s"
            time.sleep(0.1)
        names = {s.name for f in fams.values() for s in f.samples}
        assert "gputaskman_system_memory_total_bytes" in names
        if not os.path.exists("/dev/nvidia0"):
            assert fams["gputaskman_backend_up"].samples[0].value == 0
            assert not [n for n in names if n.startswith("gputaskman_gpu_")]
        assert not [n for n in names if n.startswith(("python_", "process_"))]  # own registry
        for f in fams.values():
            for s in f.samples:
                assert s.value == s.value, f"NaN in {s.name}"  # unknowns are absent, not NaN
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "off loopback" not in err  # loopback: nothing to refuse


def test_serve_off_loopback_refuses_to_start_without_a_token_or_client_certificates():
    """Catches `serve` exposing process names, command-line text and the snapshot document on
    a network where anyone may read them. (Checked on `exposure_refusal` and on a refusal
    before binding, never by listening on a public address here.)"""
    assert server.is_loopback("127.0.0.1") and server.is_loopback("::1")
    assert server.is_loopback("localhost") and not server.is_loopback("0.0.0.0")
    assert not server.is_loopback("10.0.0.2") and not server.is_loopback("gpu-host-7")
    assert server.exposure_refusal("127.0.0.1") is None
    refusal = server.exposure_refusal("0.0.0.0")
    assert refusal and "refusing to serve on 0.0.0.0, off loopback" in refusal
    assert "command-line text" in refusal and "--token-file" in refusal
    assert "--tls-client-ca" in refusal
    assert server.exposure_refusal("0.0.0.0", token=True) is None
    assert server.exposure_refusal("0.0.0.0", client_certs=True) is None
    r = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "serve", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "refusing to serve on 0.0.0.0" in r.stderr
    assert "serving" not in r.stdout and "Traceback" not in r.stderr


def test_serve_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "gputaskman.cli", "serve", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def test_serve_bad_listen_is_a_usage_error():
    r = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "serve", "--listen", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not ADDR:PORT" in r.stderr


def _token_file(tmp_path, text: str = "s3cr3t-token-0123456789abcdef", mode: int = 0o600):
    p = tmp_path / "serve.token"
    p.write_text(text + "\n")
    os.chmod(p, mode)
    return p


def _status(url: str, token: str | None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_serve_with_a_token_answers_only_requests_that_carry_it(tmp_path):
    """Catches a token that is read but not checked, checked on the wrong header, or a refusal
    that leaks metrics or this host's software versions."""
    token = "s3cr3t-token-0123456789abcdef"
    path = _token_file(tmp_path, token)
    proc, url = _serve(
        ["serve", "--listen", "127.0.0.1:0", "--sample-interval", "0.2", "--token-file", str(path)],
        {"GTM_DUVM_SOCKETS": ""},
    )
    try:
        for sent in (None, "wrong-token-0123456789abcdef", token + "x", token[:-1], ""):
            code, headers, body = _status(url, sent)
            assert code == 401, sent
            assert headers.get("WWW-Authenticate") == "Bearer"
            assert b"gputaskman_" not in body and b"unauthorized" in body
            assert "Python" not in headers.get("Server", "") and "WSGI" not in headers.get(
                "Server", ""
            )
        basic = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(basic, timeout=10)
        assert e.value.code == 401
        code, _headers, body = _status(url, token)
        assert code == 200 and b"gputaskman_sample_ready" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


GTM_SERVE = [sys.executable, "-m", "gputaskman.cli", "serve", "--listen", "127.0.0.1:0"]


@pytest.mark.parametrize(
    "text,mode,says",
    [
        ("s3cr3t-token-0123456789abcdef", 0o644, "readable by others"),
        ("s3cr3t-token-0123456789abcdef", 0o640, "chmod 600"),
        ("short", 0o600, "at least 16 characters"),
        ("two words-0123456789abcdef", 0o600, "without spaces"),
    ],
)
def test_serve_refuses_a_token_file_it_cannot_trust(tmp_path, text, mode, says):
    """Catches a token file that others may read (their processes could scrape as us) or a
    token too short to resist guessing, taken without a word."""
    path = _token_file(tmp_path, text, mode)
    r = subprocess.run(
        [*GTM_SERVE, "--token-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr
    assert "serving http://" not in r.stdout


def test_serve_refuses_two_sources_at_once(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gputaskman.cli",
            "serve",
            "--demo",
            "--replay",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "two sources" in r.stderr and "Traceback" not in r.stderr


def test_serve_stops_on_a_sigterm_delivered_to_another_thread():
    """Catches the main thread waiting without a timeout: the kernel may deliver SIGTERM to any
    thread of the process, and one delivered to the HTTP or sampler thread left `serve`
    running (seen in a full test run: the serve outlived the test). The signal is sent with
    tgkill to a thread that is not the main one."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("tgkill's syscall number is x86-64's here")
    proc, _url = _serve(
        ["serve", "--listen", "127.0.0.1:0", "--sample-interval", "0.2"], {"GTM_DUVM_SOCKETS": ""}
    )
    try:
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "serve runs its HTTP server and sampler on threads"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(234, proc.pid, others[0], signal.SIGTERM) == 0  # SYS_tgkill
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
