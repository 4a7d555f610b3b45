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
from gputaskman import __version__, report

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
    assert r.returncode == 0
    assert r.stdout.startswith("no GPU listed: NVML probe failed (library not found)")


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
    from gputaskman.demo import demo_snapshot, unavailable_snapshot

    assert cli._check_gpu_index(demo_snapshot(), 1) == 0
    assert cli._check_gpu_index(demo_snapshot(), None) == 0
    assert cli._check_gpu_index(demo_snapshot(), 5) == 2
    assert "no GPU 5; NVML lists 2 GPU(s)" in capsys.readouterr().err
    assert cli._check_gpu_index(unavailable_snapshot(), 5) == 0
