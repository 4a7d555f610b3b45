"""The `gputaskman` command run for real, as a subprocess, on this machine.

This machine has no NVIDIA driver, so the GPU part must say so and why while the rest
(system panel, process scanning) still works. Tests that depend on the driver being
absent skip where libnvidia-ml is installed.
"""

from __future__ import annotations

import ctypes.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf as ggufpkg
import numpy as np
import psutil
import pytest
from gputaskman import __version__
from gputaskman.render import report

BIN = Path(sys.executable).parent
GTM = str(BIN / "gputaskman")
NO_DRIVER = not ctypes.util.find_library("nvidia-ml")
needs_no_driver = pytest.mark.skipif(not NO_DRIVER, reason="libnvidia-ml is installed here")
REPO = Path(__file__).resolve().parents[3]


def run(
    *args: str, cmd: list[str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*(cmd or [GTM]), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gputaskman {__version__}"
    alias = run("--version", cmd=[str(BIN / "gtm")])
    assert alias.returncode == 0 and alias.stdout == r.stdout


@pytest.mark.slow
def test_uv_run_once_is_the_documented_command():
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    r = run("--once", cmd=[uv, "run", "--no-sync", "gputaskman"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "SYSTEM" in r.stdout


@needs_no_driver
def test_once_without_driver_says_why_and_shows_system():
    r = run("--once")
    assert r.returncode == 0, r.stderr
    assert "GPU: none usable via nvml (library not found)" in r.stdout
    assert "NVML Shared Library Not Found" in r.stdout
    assert "RAM   used" in r.stdout and "swap" in r.stdout and "CPU" in r.stdout
    assert r.stderr == ""


@needs_no_driver
def test_json_without_driver_is_null_with_reason():
    r = run("--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "gputaskman.snapshot" and doc["schema_version"] == 1
    assert doc["available"] is False
    assert doc["unavailable"]["reason"] == "library not found"
    assert doc["adapters"] == [] and doc["attributed_bytes"] is None
    assert doc["system"]["memory"]["total_bytes"]["value"] > 0
    assert report.null_rule_violations(doc) == []


@needs_no_driver
def test_list_gpus_reports_a_failed_probe_not_an_empty_list():
    r = run("--list-gpus")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith("nvml: probe failed (library not found: ")
    assert "probe succeeded" not in r.stdout


@needs_no_driver
def test_gpu_index_without_driver_still_reports():
    r = run("--once", "--gpu", "3")
    assert r.returncode == 0 and "library not found" in r.stdout


def test_default_mode_without_a_terminal_prints_the_report():
    r = run()
    assert r.returncode == 0
    assert "not a terminal" in r.stderr
    assert "SYSTEM" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "must be a positive number"),
        (["--interval", "nan"], "must be a positive number"),
        (["--gpu", "-1"], "GPU index must be 0 or more"),
        (["--once", "--json"], "not allowed with"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
    r = run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def write_gguf(path: Path) -> None:
    w = ggufpkg.GGUFWriter(str(path), "llama")
    w.add_name("cli test model")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


HOLDER = """
import mmap, sys, time
f = open(sys.argv[-1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print('ready', flush=True)
time.sleep(60)
"""


def test_json_finds_a_process_mapping_a_real_gguf_and_redacts_its_secret(tmp_path):
    model = tmp_path / "cli-test.gguf"
    write_gguf(model)
    secret = "sk-cli-test-do-not-show-1234"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "--api-key", secret, "-m", str(model)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        r = run("--json")
        assert r.returncode == 0, r.stderr
        assert secret not in r.stdout  # redacted before it reaches any output
        doc = json.loads(r.stdout)
        rows = [p for p in doc["processes"] if p["pid"] == child.pid]
        assert len(rows) == 1, [p["pid"] for p in doc["processes"]]
        row = rows[0]
        assert row["model_files"] == [str(model)]
        assert {"evidence": "mapped", "path": str(model)} in row["model_evidence"]
        assert {"evidence": "cmdline", "path": str(model)} in row["model_evidence"]
        assert row["scanned"] is True and row["gpu"] is None
        assert row["vram_bytes"]["value"] is None and row["vram_bytes"]["reason"]
        assert row["ram_bytes"]["value"] > 0 and row["ram_bytes"]["kind"] == "measured"
        # the same (pid, create_time) identity psutil computes
        assert row["started_at"] == pytest.approx(psutil.Process(child.pid).create_time(), abs=0.01)
        assert report.null_rule_violations(doc) == []
        text = run("--once")
        assert str(child.pid) in text.stdout and "cli-test.gguf" in text.stdout
        assert secret not in text.stdout
    finally:
        child.kill()
        child.wait()


def test_gpu_index_that_nvml_does_not_list_is_a_usage_error(capsys):
    """With a working backend (the demo snapshot stands in for NVML's answer), asking for a
    GPU it does not list exits 2 with a message; without a backend it is 0 (the report
    already says why)."""
    from gputaskman import cli
    from gputaskman.fixtures.demo import demo_snapshot, unavailable_snapshot

    assert cli._check_gpu_index(demo_snapshot(), 1) == 0
    assert cli._check_gpu_index(demo_snapshot(), None) == 0
    assert cli._check_gpu_index(demo_snapshot(), 5) == 2
    assert "no GPU 5; NVML lists 2 GPU(s)" in capsys.readouterr().err
    assert cli._check_gpu_index(unavailable_snapshot(), 5) == 0


# ------------------------------------------------------------ DRM fixture trees (issue 8)
# The tree is `gputaskman.fixtures.drm_fixtures.write_demo_tree`: kernel formats, NOT measured on
# hardware. --sysroot reads /sys and /proc below it and does not ask NVML.


@pytest.fixture
def drm_tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    r = run(
        "-c",
        "import sys; from gputaskman.fixtures.drm_fixtures import main; "
        f"sys.exit(main([{str(root)!r}]))",
        cmd=[sys.executable],
    )
    assert r.returncode == 0, r.stderr
    return root


def test_json_sysroot_shows_amd_and_intel_with_provenance(drm_tree: Path):
    r = run("--json", "--sysroot", str(drm_tree))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert report.null_rule_violations(doc) == []
    assert doc["backend"] == "drm" and doc["available"] is True
    amd, intel = doc["adapters"]
    assert (amd["vendor"], amd["backend"], amd["pci_bus_id"]) == ("amd", "drm", "00000000:03:00.0")
    assert (intel["vendor"], intel["backend"]) == ("intel", "drm")
    used = amd["metrics"]["memory_used_bytes"]
    assert used["kind"] == "measured" and used["value"] == 5 * 1024**3
    assert used["source"].endswith("mem_info_vram_used")
    gtt = amd["extra_metrics"]["gtt_used_bytes"]
    assert gtt["value"] == 300 * 1024**2 and gtt["source"].endswith("mem_info_gtt_used")
    assert intel["extra_metrics"] == {}
    # Intel: used is a sum over visible clients, total a BAR size: inferred, with the note
    iused = intel["metrics"]["memory_used_bytes"]
    assert iused["kind"] == "inferred" and iused["value"] == 150 * 1024**2
    assert any(n.startswith("Intel memory:") for n in doc["notes"])
    assert any("--sysroot" in n and "NVML is not asked" in n for n in doc["notes"])
    procs = {p["pid"]: p for p in doc["processes"]}
    llama = procs[4100]
    assert llama["name"] == "llama-server" and llama["gpu"] == amd["pci_bus_id"]
    assert llama["vram_bytes"]["kind"] == "measured"
    assert llama["vram_bytes"]["value"] == 4 * 1024**3  # fd 5 and its dup fd 9 count once
    assert llama["vram_bytes"]["source"].startswith("drm-fdinfo")
    assert procs[4400]["gpu"] == intel["pci_bus_id"]
    assert procs[4400]["vram_bytes"]["value"] == 150 * 1024**2
    for pid in (4300, 4301):  # one client inherited across fork: credited to nobody
        v = procs[pid]["vram_bytes"]
        assert v["value"] is None and v["reason"] == "shared"
        assert "4300" in v["detail"] and "4301" in v["detail"]
    assert procs[4200]["vram_bytes"]["value"] is None  # a primary-node client: not provable
    # only the provably private clients are summed, and the sum says it is a lower bound
    assert amd["attributed_bytes"] == 4 * 1024**3 and amd["attributed_complete"] is False
    assert intel["attributed_bytes"] == 150 * 1024**2


def test_once_sysroot_shows_both_adapters_and_their_processes(drm_tree: Path):
    r = run("--once", "--sysroot", str(drm_tree))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "backend drm" in out.splitlines()[0]
    assert "GPU 0  n/a  00000000:03:00.0" in out and "GPU 1  n/a  00000000:00:02.0" in out
    assert "memory  used ~150.0 MiB / ~256.0 MiB" in out  # Intel: inferred, marked ~
    assert "GTT (system memory mapped by the GPU) used 300.0 MiB / 12.0 GiB" in out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  4")}
    assert "llama-server" in rows["4100"] and "4.0 GiB" in rows["4100"]
    assert "firefox" in rows["4400"] and "150.0 MiB" in rows["4400"]
    assert "n/a" in rows["4300"].split()[3]
    assert "Intel memory:" in out and "frequency throttled (pl1)" in out


def test_gpu_selects_the_intel_adapter_under_sysroot(drm_tree: Path):
    r = run("--json", "--gpu", "1", "--sysroot", str(drm_tree))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["selected_gpu"] == 1 and doc["backend"] == "drm"
    missing = run("--once", "--sysroot", str(drm_tree / "nope"))
    assert missing.returncode != 0 and "not a directory" in missing.stderr
