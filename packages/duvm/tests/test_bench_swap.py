"""benchmarks/bench_swap.py run for real with a tiny workload: its output shape, that the
workload's pages went to the device under test, that it refuses a rival swap device at its
priority, and that nothing is left behind (swap entry, loop device, FUSE mount, cgroup,
process, work directory), also when it is interrupted mid-workload. Root only (it uses the
machine's swap pool); skipped with the reason elsewhere. Timings are not asserted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.cli import demo
from duvm.node.attach import kernel_swap, processes, systools

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_swap.py"
TINY = ["--reps", "1", "--mib", "64", "--limit-mib", "24"]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the benchmark creates swap, loop devices, FUSE mounts and cgroups"
    problems = demo.preflight()
    if systools.find_tool("nbdkit") is None:
        problems.append("nbdkit missing (install nbdkit)")
    if demo.competing_swaps():
        problems.append(
            f"swap {demo.competing_swaps()} is active at priority "
            f"{demo.MAX_PRIORITY} (another swap test is running?)"
        )
    return "; ".join(problems) if problems else None


root_only = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def test_help_explains_targets_without_root() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0
    for word in ("duvm-3", "nbdkit", "zram", "no-swap", "disk-file", "frontend", "--json"):
        assert word in res.stdout
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--targets", "nbdkit,floppy"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "unknown target(s) floppy" in bad.stderr


def _ours() -> dict[str, set[str]]:
    """Everything of the benchmark's kind on the machine now (to compare before/after)."""
    run_dirs = {str(p) for p in Path("/run").glob("duvm-bench-*")}
    loops = {
        bf.parent.parent.name
        for bf in Path("/sys/block").glob("loop*/loop/backing_file")
        if bf.read_text().startswith("/run/duvm-bench-")
    }
    mounts = {
        ln.split()[1]
        for ln in Path("/proc/mounts").read_text().splitlines()
        if ln.split()[1].startswith("/run/duvm-bench-")
    }
    swaps = {e.filename for e in kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())}
    return {"run_dirs": run_dirs, "loops": loops, "mounts": mounts, "swaps": swaps}


def _assert_nothing_left(before: dict[str, set[str]], runs: list[dict]) -> None:
    after = _ours()
    assert after == before
    for r in runs:
        assert r["leftovers"] == []
        assert r["cgroup"] is None or not Path(r["cgroup"]).exists()
        assert not [p for p in r["pids"] if processes.pid_alive(p)]


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_tiny_run_output_shape_and_clean_teardown(tmp_path: Path, benchmark) -> None:
    before = _ours()
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--targets",
            "nbdkit,duvm-local,no-swap",
            *TINY,
            "--trace",
            str(tmp_path),
            "--json",
            str(out_json),
            "--markdown",
            str(out_md),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out_json.read_text())
    assert {"cpu", "kernel", "loadavg_start", "loadavg_end"} <= doc["machine"].keys()
    assert [r["target"] for r in doc["runs"]] == ["nbdkit", "duvm-local", "no-swap"]
    nbdkit, local, floor = doc["runs"]
    for r in doc["runs"]:
        assert r["intact"] is True and r["error"] is None and r["exit_code"] == 0
        assert r["wall_s"] > 0 and r["fill_s"] is not None and r["verify_s"] is not None
        assert r["setup_s"] is not None and r["teardown_s"] is not None
        assert 0 <= r["steal_pct"] <= 100  # recorded, so a run on a busy host can be told
    # the workload's pages went to the device under test, through duvm's attach frontend
    assert nbdkit["device"].startswith("/dev/") and nbdkit["peak_device_kib"] > 0
    assert nbdkit["frontend"].startswith(("nbdfuse + loop", "kernel nbd"))
    assert nbdkit["pswpout"] > 0 and nbdkit["pswpin"] > 0
    assert nbdkit["fill_pswpout"] is not None and nbdkit["fill_pswpout"] <= nbdkit["pswpout"]
    # the one-hop duvm daemon went through the very same frontend
    assert local["frontend"] == nbdkit["frontend"] and local["device"].startswith("/dev/")
    assert local["peak_device_kib"] > 0 and local["pswpout"] > 0 and local["pswpin"] > 0
    assert floor["device"] is None and floor["peak_device_kib"] is None
    # --trace: the duvm daemon traced every request; every page on the device was written
    traced = benchmark("nbd_trace").load(tmp_path / "duvm-local-0.trace")
    written = sum(n for _, _, cmd, _, n, err in traced if cmd == "write" and not err)
    assert written >= local["peak_device_kib"] * 1024
    assert any(cmd == "read" for _, _, cmd, *_ in traced)
    assert sorted(p.name for p in tmp_path.glob("*.trace")) == ["duvm-local-0.trace"]
    med = doc["median"]
    assert med["nbdkit"]["wall_s_vs_nbdkit"] == 1.0 and med["nbdkit"]["ok"] == 1
    assert med["nbdkit"]["wall_s_min"] == med["nbdkit"]["wall_s_max"] == nbdkit["wall_s"]
    assert med["no-swap"]["wall_s"] == floor["wall_s"]
    assert med["nbdkit"]["over_floor_s"] == pytest.approx(nbdkit["wall_s"] - floor["wall_s"])
    table = out_md.read_text()
    assert "| nbdkit | nbdfuse + loop" in table or "| nbdkit | kernel nbd" in table
    assert "| no-swap | none" in table and "Load average at start" in table
    assert "| duvm-local | " in table and "CPU steal %" in table
    _assert_nothing_left(before, doc["runs"])


@contextlib.contextmanager
def _rival_swap(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB swap file at the benchmark's own priority, removed afterwards."""
    path = tmp_path / "rival.swap"
    path.write_bytes(bytes(16 << 20))
    path.chmod(0o600)
    subprocess.run(
        [systools.SYSTEM_TOOLS.require("mkswap"), str(path)], check=True, capture_output=True
    )
    subprocess.run(
        [systools.SYSTEM_TOOLS.require("swapon"), "-p", str(demo.MAX_PRIORITY), str(path)],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(
            [systools.SYSTEM_TOOLS.require("swapoff"), str(path)], check=True, capture_output=True
        )


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_refuses_a_rival_swap_at_its_priority(tmp_path: Path) -> None:
    with _rival_swap(tmp_path) as rival:
        before = _ours()
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--targets", "no-swap", *TINY],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert res.returncode == 1
        assert f"swap {rival} is already active at priority {demo.MAX_PRIORITY}" in res.stderr
        assert _ours() == before


@pytest.mark.root
@pytest.mark.slow
@root_only
def test_interrupt_mid_workload_tears_down(tmp_path: Path) -> None:
    before = _ours()
    out_json = tmp_path / "r.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--targets",
            "nbdkit",
            "--reps",
            "1",
            "--mib",
            "512",
            "--limit-mib",
            "24",
            "--json",
            str(out_json),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until the workload is swapping to nbdkit
            used = [
                e
                for e in kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())
                if e.priority == demo.MAX_PRIORITY and e.used_kb > 0
            ]
            if used or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert used, "the workload never swapped to the benchmark's device"
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the script
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out
    assert "interrupted; the target in progress was torn down" in out
    doc = json.loads(out_json.read_text())
    assert doc["interrupted"] is True and doc["runs"][0]["error"] == "interrupted"
    _assert_nothing_left(before, doc["runs"])


def test_verdict_warns_when_the_hypervisor_stole_cpu(benchmark) -> None:
    bs = benchmark("bench_swap")
    assert bs.steal_percent((10, 1000), (60, 2000)) == 5.0
    assert bs.steal_percent((10, 1000), (10, 1000)) is None  # no time passed: unknown, not 0
    quiet = {
        "duvm-3": {"wall_s_vs_nbdkit": 1.1, "steal_pct": 0.4},
        "nbdkit": {"wall_s_vs_nbdkit": 1.0, "steal_pct": 0.0},
    }
    assert bs.verdict(quiet) == "target duvm-3 within 1.15x of nbdkit: met (1.10x)"
    busy = {
        "duvm-3": {"wall_s_vs_nbdkit": 1.6, "steal_pct": 31.0},
        "nbdkit": {"wall_s_vs_nbdkit": 1.0, "steal_pct": 2.0},
    }
    v = bs.verdict(busy)
    assert v.startswith("target duvm-3 within 1.15x of nbdkit: NOT met (1.60x)")
    assert "31% of the CPUs (steal)" in v and "run again when quiet" in v
    assert 0 <= bs.cpu_times()[0] <= bs.cpu_times()[1]
