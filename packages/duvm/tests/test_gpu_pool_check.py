"""tools/gpu_pool_check.py on this machine (no GPU): the script a lent GPU machine runs, with
the GPU steps skipped, as CI runs it.

The whole run (root): duvm enabled on 3 local memservers, the worker in a memory cgroup with
3x its limit in pageable memory and a pinned (mlock) buffer. Asserted from its JSON lines:
every byte verified, swap used (the cgroup's swap count, the device's use, the memservers'
stored pages, and the worker's own pageable pages seen swapped out in its pagemap), the pinned
buffer resident in every sample, the GPU steps said to be skipped, exit status 0, and nothing
left behind (checked here too, the way the enable end-to-end tests check). The worker alone
(no swap): a byte changed behind its back through /proc/PID/mem is caught, named and fails it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from duvm.base import cgroup
from duvm.cli import demo
from duvm.node.attach import attach, kernel_swap
from duvm.node.lifecycle import control
from test_enable_e2e import leftovers

TOOLS = Path(__file__).resolve().parents[3] / "tools"
MIB = 1 << 20
# 4 MiB chunks: the worker holds a few chunk-sized copies at once, and 8 MiB ones left the
# 64 MiB group so little room beside the pinned buffer that a slow machine's reclaim could
# give up and OOM-kill the worker
LIMIT_MIB, WORKLOAD_MIB, PINNED_MIB, CHUNK_MIB, ROUNDS = 64, 192, 16, 4, 2
WORKER_ARGS = ("--mib", "16", "--pinned-mib", "1", "--chunk-mib", "4", "--rounds", "1")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("duvm.store.remote_store") is None:
        return "the daemon's memserver-backed store is not in this tree"
    problems = demo.preflight()
    return "; ".join(problems) if problems else None


def run_tool(*args: str, timeout: float = 280) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.Popen(
        [sys.executable, str(TOOLS / "gpu_pool_check.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # it unwinds through its teardown
        out, err = proc.communicate(timeout=120)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, lines, err


@pytest.fixture
def state_dir() -> Iterator[Path]:
    others = demo.competing_swaps()
    if others:
        pytest.skip(f"swap {others} is active at the highest priority (another swap test?)")
    blocking = cgroup.swap_headroom_problems()
    if blocking:
        pytest.skip(f"another cgroup here would make disable refuse: {blocking[0]}")
    path = Path(tempfile.mkdtemp(prefix="duvm-gpu-", dir="/tmp"))
    try:
        yield path
    finally:  # whatever a failed run left enabled
        with contextlib.suppress(Exception):
            attach.detach(control.state_path(path), force=True)
        with contextlib.suppress(Exception):
            control.stop_daemon(path)
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_pool_holds_pageable_memory_and_never_the_pinned(state_dir: Path) -> None:
    rc, lines, err = run_tool(
        "--mib",
        str(WORKLOAD_MIB),
        "--limit-mib",
        str(LIMIT_MIB),
        "--pinned-mib",
        str(PINNED_MIB),
        "--chunk-mib",
        str(CHUNK_MIB),
        "--rounds",
        str(ROUNDS),
        "--state-dir",
        str(state_dir),
    )
    summary = lines[-1]
    assert summary["step"] == "summary", (lines[-3:], err[-2000:])
    assert summary.get("error") is None, summary["error"]
    w = summary["worker"]
    why = ("worker_exit", "worker_oom_kills", "worker_stderr_tail")
    assert w is not None and summary["worker_exit"] == 0, {k: summary.get(k) for k in why}
    # every byte, every round: the pageable buffer and the pinned one
    assert w["bad_chunks"] == 0 and w["intact"] is True and w["first_bad"] == []
    assert w["bytes_verified"] == (WORKLOAD_MIB + PINNED_MIB) * MIB * ROUNDS
    # no GPU here: said so, not silently passed
    assert w["gpu_moves"].startswith("skipped: ") and w["gpu_kernel"].startswith("skipped: ")
    # swap was used, and by this worker: its own pages seen swapped out, the device and the
    # cgroup's swap count, and the memservers stored pages
    least = (WORKLOAD_MIB - 2 * LIMIT_MIB) * MIB // 4096
    assert w["pageable_swapped_max"] >= least, w
    assert summary["device_used_peak_kb"] * 1024 >= least * 4096
    if summary["cgroup_swap_peak_bytes"] is not None:  # swap accounting on
        assert summary["cgroup_swap_peak_bytes"] >= least * 4096
    assert sum(summary["memserver_stored_pages"].values()) >= least
    # the pinned buffer was resident in every sample, and locked
    assert w["pinned_checks"] >= ROUNDS * 2
    assert w["pinned_not_resident_max"] == 0 and w["pinned_swapped_max"] == 0
    assert w["VmLck"] >= PINNED_MIB * 1024
    assert summary["checks"] == dict.fromkeys(summary["checks"], True)
    assert summary["ok"] is True and rc == 0
    # teardown: nothing left, as the script says and as seen from here
    assert summary["left"] == []
    assert leftovers(state_dir, summary["pids"], [summary["cgroup"]]) == []
    assert not [
        e
        for e in kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())
        if e.filename.startswith("/dev/loop") and e.priority >= demo.MAX_PRIORITY
    ]


def test_worker_catches_a_byte_changed_behind_its_back() -> None:
    """Without swap: a byte of the pageable buffer and one of the pinned buffer are changed
    through /proc/PID/mem while the worker holds; it names both and exits 1."""
    proc = subprocess.Popen(
        [sys.executable, str(TOOLS / "gpu_pool_worker.py"), *WORKER_ARGS, "--hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        if ready["event"] == "result":  # mlock refused: a memlock limit below 1 MiB
            pytest.skip(ready["error"])
        offset = 5 * MIB + 123  # chunk 1
        try:
            mem = open(f"/proc/{proc.pid}/mem", "r+b", buffering=0)  # noqa: SIM115
        except PermissionError as exc:
            pytest.skip(f"cannot write the worker's memory here: {exc}")
        with mem:
            for where in (ready["pageable_addr"] + offset, ready["pinned_addr"] + 7):
                mem.seek(where)
                old = mem.read(1)
                mem.seek(where)
                mem.write(bytes([old[0] ^ 0xFF]))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines = [json.loads(x) for x in proc.stdout]
        assert proc.wait(60) == 1
    finally:
        proc.kill()
        proc.wait()
    result = lines[-1]
    assert result["event"] == "result"
    assert result["bad_chunks"] == 1 and result["intact"] is False
    assert result["first_bad"] == [{"chunk": 1, "offset": MIB + 123, "where": "host", "round": 0}]
    assert result["pinned_intact"] is False
