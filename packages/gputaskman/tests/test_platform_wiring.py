"""The non-Linux backends wired into the core: which source the collector picks per
platform, WSL rows end to end, the Paged column and JSON fields, and ``--list-gpus``
telling an empty probe from a failed one.

There is no Windows, WSL, Mac or Ascend NPU here. Platform detection is mocked (a
patched ``sys.platform`` or ``WSL_DISTRO_NAME`` in a real subprocess); Windows host
counters are synthetic replays in the stream format (see test_wsl.py), IOKit answers are
mocked, and ``npu-smi`` is a shell script printing a recorded-format table. Linux
processes, /proc, the DRM fixture tree and the ``gputaskman`` command are real.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gputaskman import cli
from gputaskman.backends import registry
from gputaskman.backends.macos import Accelerator, MacCounters
from gputaskman.backends.wsl import Interop, WslBackend, dxg_holders
from gputaskman.backends.wslhost import StreamParser
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuSample, GpuSource
from gputaskman.base.readings import Problem, Reason
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.offline.recorded import snapshot_from_json
from gputaskman.render import report, text_report
from gputaskman.sampling.collector import Collector, NullScanner

GIB = 1024**3
MIB = 1024**2
BIN = Path(sys.executable).parent
GTM = str(BIN / "gputaskman")
NO_DRIVER = not ctypes.util.find_library("nvidia-ml")
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="libnvidia-ml is installed here")
ON_WSL = "microsoft" in platform.release().lower() or bool(os.environ.get("WSL_DISTRO_NAME"))
NPU_FIXTURE = Path(__file__).with_name("npu_smi") / "single.txt"


def run_gtm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("WSL_DISTRO_NAME", None)
    full.update(env or {})
    return subprocess.run(
        [GTM, *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=full,
    )


class NoNvml(GpuSource):
    """NVML absent (this machine has no NVIDIA driver either; this keeps tests exact)."""

    def sample(self):
        p = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
        return GpuSample("nvml", problems=(p,), backend_problem=p)

    def close(self):
        pass


# -- which source, per platform (platform detection mocked) ------------------------------


@pytest.mark.parametrize(
    ("backend", "kind"),
    [("wddm", "WddmBackend"), ("wsl", "WslBackend"), ("metal", "MacCounters")],
)
def test_mocked_platform_selects_its_backend_and_loads_nothing(backend, kind):
    src = registry.gpu_source(backend)
    try:
        assert type(src).__name__ == kind
    finally:
        src.close()


def test_mocked_linux_appends_ascend_only_when_npu_smi_is_installed(tmp_path, monkeypatch):
    """Catches the NPU being appended whether or not ``npu-smi`` is installed (or never): PATH
    names an empty folder, then one holding a mocked ``npu-smi`` script (no NPU here)."""
    from gputaskman.backends import ascend
    from gputaskman.backends.linux import LinuxGpus

    if any(os.access(p, os.X_OK) for p in ascend.SEARCH):
        pytest.skip("npu-smi is installed on this machine")
    cat = shutil.which("cat")  # the script's, found before PATH is narrowed
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    plain = registry.gpu_source("nvml")
    assert isinstance(plain, LinuxGpus) and plain.ascend is None
    bindir = write_tool(tmp_path, f"{cat} {NPU_FIXTURE}\n")
    monkeypatch.setenv("PATH", str(bindir))
    both = registry.gpu_source("nvml")
    assert isinstance(both, LinuxGpus) and isinstance(both.ascend, ascend.AscendBackend)
    npus = both.ascend.sample().adapters  # found on PATH and run: the script's two NPUs
    assert [a.pci_bus_id for a in npus] == ["00000000:5a:00.0", "00000000:19:00.0"]
    plain.close()
    both.close()


DETECT = "import sys; PATCH; from gputaskman.backends import registry; print(registry.BACKEND)"


@pytest.mark.parametrize(
    ("patch", "env", "want"),
    [
        ("pass", {}, "nvml"),
        ("pass", {"WSL_DISTRO_NAME": "Ubuntu"}, "wsl"),
        ("sys.platform = 'win32'", {}, "wddm"),
        ("sys.platform = 'darwin'", {}, "metal"),
    ],
)
def test_mocked_platform_detection_sets_the_collector_backend(patch, env, want):
    if ON_WSL and want == "nvml":
        pytest.skip("this machine is WSL")
    full = {k: v for k, v in os.environ.items() if k != "WSL_DISTRO_NAME"} | env
    out = subprocess.run(
        [sys.executable, "-c", DETECT.replace("PATCH", patch)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=full,
    )
    assert out.stdout.strip() == want


# -- WSL end to end: inferred rows never summed, host rows never joined with /proc --------

LUID = "luid_0x00000000_0x0000d1a2"
VMWP = 6140


def host_frame(seq: int, vm_bytes: int, other_pid: int) -> str:
    """One synthetic host sample (stream format of wslhost): vmwp.exe and a "dwm" whose
    Windows PID equals a live Linux PID here, 50 MiB each otherwise made up."""
    inst = "pid_{}_luid_0x00000000_0x0000D1A2_phys_0"
    lines = [f"gtm1\tT\t{seq}\t{1796000000000 + seq * 1000}"]
    for pid, b in ((VMWP, vm_bytes), (other_pid, 50 * MIB)):
        lines += [f"gtm1\tC\tL\t{inst.format(pid)}\t{b}", f"gtm1\tC\tN\t{inst.format(pid)}\t{MIB}"]
    lines.append(f"gtm1\tC\tD\tluid_0x00000000_0x0000D1A2_phys_0\t{vm_bytes + 150 * MIB}")
    lines += [f"gtm1\tP\t{VMWP}\tvmwp", f"gtm1\tP\t{other_pid}\tdwm", f"gtm1\tZ\t{seq}"]
    return "\n".join(lines) + "\n"


class ReplayHost:
    def __init__(self, text: str) -> None:
        self.frames = StreamParser().feed(text.encode())

    def start(self):
        pass

    def latest(self, max_age=None):
        return (self.frames.pop(0) if len(self.frames) > 1 else self.frames[0]), None

    def close(self):
        pass


@pytest.fixture
def dxg_child(tmp_path):
    """A real Linux process holding a file open, standing in for /dev/dxg."""
    dev = tmp_path / "dxg"
    dev.write_bytes(b"")
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time; f = open({str(dev)!r}); time.sleep(60)"]
    )
    try:
        for _ in range(200):
            if dxg_holders(device=str(dev))[0]:
                break
            time.sleep(0.02)
        yield child, str(dev)
    finally:
        child.kill()
        child.wait(10)


def test_wsl_replay_rows_end_to_end_through_collector_json_and_replay(dxg_child):
    child, dev = dxg_child
    calls = iter(range(100))
    host = ReplayHost(host_frame(1, 300 * MIB, child.pid) + host_frame(2, 4396 * MIB, child.pid))
    b = WslBackend(
        nvml=NoNvml(),
        host=host,
        interop=Interop(True, None, "/mnt/c/ps.exe"),
        holders=lambda: ({}, 0) if next(calls) == 0 else dxg_holders(device=dev),
    )
    c = Collector(source=b, scanner=NullScanner())
    try:
        c.sample()  # baseline: the VM idle at 300 MiB, nobody holds the device
        snap, system = c.sample_with_system()
    finally:
        c.close()
    doc = report.to_json_dict(snap, system)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    rows = {(p["pid"], p["host"]): p for p in doc["processes"]}
    vm, dwm, wsl = rows[(VMWP, "windows")], rows[(child.pid, "windows")], rows[(child.pid, None)]
    # measured host bytes are summed once; the WSL row's inferred 4 GiB never
    assert doc["attributed_bytes"] == 4396 * MIB + 50 * MIB
    assert doc["attributed_complete"] is True  # the WSL row's bytes are inside vmwp.exe's
    assert wsl["vram_bytes"]["value"] is None and wsl["vram_bytes"]["reason"] == "not listed"
    assert wsl["vram_inferred_bytes"] == {
        **wsl["vram_inferred_bytes"],
        "value": 4096 * MIB,
        "kind": "inferred",
    }
    assert wsl["parent_pid"] == VMWP and wsl["inferred_unique"] is True
    # the Linux process keeps its /proc identity; the Windows process with the same
    # number keeps the host's name and gets nothing of the Linux process
    assert wsl["name"] == Path(f"/proc/{child.pid}/comm").read_text().strip()
    assert wsl["started_at"] is not None and wsl["ram_bytes"]["value"] is not None
    assert dwm["name"] == "dwm" and dwm["started_at"] is None and dwm["scanned"] is False
    assert dwm["ram_bytes"]["value"] is None and "windows process" in dwm["ram_bytes"]["detail"]
    assert dwm["paged_bytes"]["value"] == MIB and vm["paged_bytes"]["value"] == MIB
    assert report.null_rule_violations(doc) == []
    # replay gives the same object back (document/reader.py reads the new fields)
    again = report.to_json_dict(*snapshot_from_json(doc))
    assert again == doc
    text = text_report.render_text(snap, system)
    assert f"windows:{child.pid}" in text and "~4.0 GiB*" in text
    assert "never added again" in text and "PAGED" in text


# -- Paged column and JSON (macOS, IOKit mocked) -------------------------------------------

OWN = 4242


class FakeIOKit:
    def __init__(self, result):
        self.result = result

    def accelerators(self):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


class RootFootprint:
    """Mocked system accounting, as root: graphics ledgers readable."""

    def phys_footprint(self, pid: int) -> int:
        return 5 * GIB

    def graphics(self, pid: int) -> tuple[int, int]:
        return 4 * GIB, 512 * MIB


def mac_source(result) -> MacCounters:
    return MacCounters(iokit=FakeIOKit(result), footprint=RootFootprint(), memsize=lambda: 16 * GIB)


def agx() -> Accelerator:
    props = {
        "model": "Apple M4",
        "PerformanceStatistics": {"In use system memory": 6 * GIB, "Device Utilization %": 37},
    }
    return Accelerator(
        0x100000ABC,
        "AGXAcceleratorG16X",
        props,
        [{"IOUserClientCreator": f"pid {OWN}, llama-server"}],
    )


def mac_snapshot():
    c = Collector(source=mac_source([agx()]), scanner=NullScanner())
    try:
        return c.sample_with_system()
    finally:
        c.close()


def test_iokit_mocked_paged_and_footprint_are_json_readings_never_summed():
    snap, system = mac_snapshot()
    doc = report.to_json_dict(snap, system)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    (row,) = [p for p in doc["processes"] if p["pid"] == OWN and p["gpu"] is not None]
    assert row["vram_bytes"]["value"] == 4 * GIB
    assert row["paged_bytes"]["value"] == 512 * MIB and row["paged_bytes"]["kind"] == "measured"
    assert "compressed" in row["paged_bytes"]["source"]
    assert row["footprint_bytes"]["value"] == 5 * GIB
    assert doc["attributed_bytes"] == 4 * GIB  # neither paged nor footprint
    assert row["host"] is None and row["parent_pid"] is None and row["inferred_unique"] is False
    assert report.null_rule_violations(doc) == []
    assert report.to_json_dict(*snapshot_from_json(doc)) == doc


def test_paged_column_only_when_a_backend_measures_it():
    snap, system = mac_snapshot()
    assert text_report.process_columns(snap) == text_report.PAGED_COLUMNS
    text = text_report.render_text(snap, system)
    header = next(line for line in text.splitlines() if line.strip().startswith("PID"))
    assert header.split()[:5] == ["PID", "NAME", "GPU", "VRAM", "PAGED"]
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(str(OWN)))
    assert "4.0 GiB" in line and "512.0 MiB" in line
    linux = demo_snapshot()
    assert text_report.process_columns(linux) == text_report.PROCESS_COLUMNS
    assert "PAGED" not in text_report.render_text(linux, DemoSystem())


def test_old_record_lines_without_platform_fields_still_read():
    snap, system = mac_snapshot()
    doc = report.to_json_dict(snap, system)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    for p in doc["processes"]:
        for k in ("paged_bytes", "footprint_bytes", "host", "parent_pid", "inferred_unique"):
            del p[k]
    back, _ = snapshot_from_json(doc)
    assert all(p.paged is None and p.host is None and not p.unique for p in back.processes)
    bad = report.to_json_dict(snap, system)
    bad["processes"][0]["parent_pid"] = "6140"
    from gputaskman.offline.recordfile import SnapshotError

    with pytest.raises(SnapshotError, match="parent_pid"):
        snapshot_from_json(bad)


class FixedCollector:
    def __init__(self, *results):
        self.results = list(results)

    def sample_with_system(self):
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    def rescan(self, pid, create_time):
        return None  # fixed data: nothing to scan

    def close(self):
        pass


async def test_tui_iokit_mocked_shows_paged_column_and_drops_it_without_paged():
    from gputaskman.tui.app import create_app
    from gputaskman.tui.widgets.process_table import (
        ENGINE_COLUMNS,
        IDENTITY_COLUMNS,
        ProcessTable,
    )

    mac = mac_snapshot()
    fake = FixedCollector(mac, (demo_snapshot(), DemoSystem()))
    app = create_app(collector_factory=lambda: fake, interval=60.0)
    async with app.run_test(size=(220, 40)) as pilot:  # wide enough for every column
        for _ in range(200):
            await pilot.pause(0.01)
            if app.samples >= 1:
                break
        table = app.query_one(ProcessTable)

        def memory_columns() -> tuple[str, ...]:  # less the TUI's own engine/identity columns
            extra = (*ENGINE_COLUMNS, *IDENTITY_COLUMNS)
            return tuple(c for c in table.columns_shown if c not in extra)

        assert memory_columns() == text_report.PAGED_COLUMNS
        row = table.get_row(f"{OWN}@{mac[0].adapters[0].pci_bus_id}")
        assert str(row[table.columns_shown.index("PAGED")]) == "512.0 MiB"
        table.sort_column = "PAGED"
        table.show(list(demo_snapshot().processes), demo_snapshot(), DemoSystem(), 220)
        assert memory_columns() == text_report.PROCESS_COLUMNS
        assert table.sort_column == "VRAM"  # the PAGED sort went with its column
        assert len(table.labels) == len(table.widths) == len(table.columns_shown)


# -- --list-gpus: empty vs failed ------------------------------------------------------------


def list_gpus(source, capsys) -> tuple[int, list[str]]:
    rc = cli._list_gpus(argparse.Namespace(sysroot=None), source=source)
    return rc, capsys.readouterr().out.splitlines()


def test_list_gpus_iokit_mocked_empty_probe_is_not_a_failed_one(capsys):
    rc, empty = list_gpus(mac_source([]), capsys)
    assert rc == 0 and "metal: probe succeeded, 0 GPUs" in empty
    rc, failed = list_gpus(
        mac_source(OSError("IOServiceGetMatchingServices returned 0xe00002c7")), capsys
    )
    assert rc == 0
    assert (
        "metal: probe failed (query failed: IOKit: IOServiceGetMatchingServices returned "
        "0xe00002c7)" in failed
    )
    assert not any("probe succeeded" in line for line in failed)
    rc, ok = list_gpus(mac_source([agx()]), capsys)
    assert ok[0].startswith("0  Apple M4  ") and ok[0].endswith("[metal]")
    assert not any("probe" in line for line in ok)  # a plain success needs no probe line


def test_list_gpus_pdh_mocked_windows_empty_probe(capsys):
    from gputaskman.backends.win.backend import WddmBackend

    class NoAdapters:
        def enum_adapters(self):
            return []

    class NoCounters:
        def read(self, paths):
            return {}

        def close(self):
            pass

    rc, out = list_gpus(WddmBackend(dxgi=NoAdapters(), pdh=NoCounters(), tcc=False), capsys)
    assert rc == 0 and "wddm: probe succeeded, 0 GPUs" in out


def test_list_gpus_drm_without_a_card_is_one_probe_line_and_one_snapshot_note(tmp_path, capsys):
    """Catches the DRM part's empty probe going missing (nothing would say DRM was looked
    for) or being said twice in ``--list-gpus`` (as a probe line and again as a note)."""
    from gputaskman.backends.drm import DrmBackend
    from gputaskman.backends.linux import LinuxGpus

    def source() -> LinuxGpus:
        return LinuxGpus(NoNvml(), DrmBackend(str(tmp_path)))

    rc, out = list_gpus(source(), capsys)
    assert rc == 0
    assert out == [
        "nvml: probe failed (library not found: NVML Shared Library Not Found)",
        "drm: no amdgpu, i915 or xe card in /sys/class/drm",
    ]
    snap = Collector(source=source(), scanner=NullScanner()).sample()
    assert snap.notes == ("DRM: no amdgpu, i915 or xe card in /sys/class/drm",)


def write_tool(tmp_path: Path, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "npu-smi"
    tool.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return bindir


@needs_no_driver
def test_list_gpus_subprocess_here_says_which_probes_failed_or_found_nothing():
    r = run_gtm("--list-gpus")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.splitlines()[0].startswith("nvml: probe failed (library not found: ")


@needs_no_driver
def test_list_gpus_subprocess_mocked_wsl_says_interop_is_off():
    if Path("/proc/sys/fs/binfmt_misc/WSLInterop").exists():
        pytest.skip("WSL interop is on here")
    r = run_gtm("--list-gpus", env={"WSL_DISTRO_NAME": "Ubuntu"})
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("wsl: probe failed (library not found: ")
    assert "problem: wsl.interop: unavailable: WSL interop is off" in r.stdout


@needs_no_driver
def test_list_gpus_subprocess_mocked_npu_smi_lists_npus_after_a_failed_nvml(tmp_path):
    bindir = write_tool(tmp_path, f"cat {NPU_FIXTURE}\n")
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = run_gtm("--list-gpus", env=env)
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    npus = [line for line in lines if line.endswith("[ascend]")]
    assert [line.split()[0] for line in npus] == ["0", "1"]
    assert any(line.startswith("nvml: probe failed (library not found") for line in lines)
    once = run_gtm("--json", env=env)
    doc = json.loads(once.stdout)
    assert doc["backend"] == "ascend" and doc["available"] is True
    assert report.null_rule_violations(doc) == []


@needs_no_driver
def test_list_gpus_subprocess_mocked_npu_smi_failing_is_a_failed_probe(tmp_path):
    fail = 'echo "dcmi model initialized failed, ret is -8020" >&2\nexit 255\n'
    bindir = write_tool(tmp_path, fail)
    r = run_gtm("--list-gpus", env={"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert r.returncode == 0
    assert (
        "ascend: probe failed (query failed: npu-smi exited with 255: dcmi model "
        "initialized failed, ret is -8020)" in r.stdout
    )


def test_list_gpus_subprocess_sysroot_lists_fixture_cards_and_the_unasked_nvml(tmp_path):
    root = tmp_path / "root"
    subprocess.run(
        [sys.executable, "-m", "gputaskman.fixtures.drm_fixtures", str(root)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    r = run_gtm("--sysroot", str(root), "--list-gpus")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines if line.endswith("[drm]")] == ["0", "1"]
    assert any(line.startswith("nvml: probe failed (unavailable: NVML not asked") for line in lines)
