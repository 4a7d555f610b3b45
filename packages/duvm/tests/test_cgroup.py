"""Memory cgroups: created with the limit, the child joins before exec, the limit bites, and
everything is removed afterwards, also with processes still inside. Root only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.base import cgroup
from hypothesis import given
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates cgroups)"),
    pytest.mark.skipif(cgroup.detect_version() is None, reason="no cgroup memory controller"),
]


def test_detects_the_layout_this_machine_has() -> None:
    root = Path("/sys/fs/cgroup")
    v = cgroup.detect_version()
    if (root / "cgroup.controllers").exists() and "memory" in (
        root / "cgroup.controllers"
    ).read_text().split():
        assert v == 2
    else:
        assert v == 1 and (root / "memory" / "memory.limit_in_bytes").exists()


def test_own_v1_path_parser() -> None:
    text = "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n"
    assert cgroup._own_v1_memory_path(text) == "/process_api/abc"
    assert cgroup._own_v1_memory_path("4:cpu,memory:/a/b\n") == "/a/b"
    assert cgroup._own_v1_memory_path("0::/\n") == "/"


@given(st.text(max_size=300))
def test_fuzz_own_v1_path_parser(text: str) -> None:
    assert isinstance(cgroup._own_v1_memory_path(text), str)


def test_child_runs_inside_with_limit_and_group_is_removed() -> None:
    limit = 32 << 20
    with cgroup.MemoryCgroup(limit) as cg:
        path = cg.path
        assert path.is_dir()
        limit_file = "memory.max" if cg.version == 2 else "memory.limit_in_bytes"
        assert int((path / limit_file).read_text()) == limit
        # the child reads its own membership: it was inside before its first instruction
        res = cg.run(
            [sys.executable, "-c", "print(open('/proc/self/cgroup').read())"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert res.returncode == 0
        assert cg.name in res.stdout
    assert not path.exists()


def test_limit_is_enforced() -> None:
    """Allocating 4x the limit never lets usage pass the limit (swap or OOM kill, either way)."""
    limit = 16 << 20
    with cgroup.MemoryCgroup(limit) as cg:
        code = "b = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1"
        res = cg.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        peak = cg.peak_bytes()
        assert peak is not None and 0 < peak <= limit
        assert res.returncode in (0, -9), res.stderr  # finished via swap, or OOM-killed
        # the group's own count of OOM kills tells the two apart
        assert cg.oom_kills() == (1 if res.returncode == -9 else 0)
        if cg.version == 1:
            assert int((cg.path / "memory.failcnt").read_text()) > 0, "the limit was hit"


def test_remove_kills_leftover_processes() -> None:
    cg = cgroup.MemoryCgroup(16 << 20).create()
    try:
        proc = cg.popen(["sleep", "300"])
        grandchild = cg.popen(["sh", "-c", "sleep 300 & wait"])
        assert proc.pid in cg.pids() and grandchild.pid in cg.pids()
    finally:
        cg.remove()
    assert proc.wait(10) == -9
    assert grandchild.wait(10) == -9
    assert not cg.path.exists()
    cg.remove()  # idempotent


def test_a_preexec_runs_in_the_child_after_it_joined(tmp_path: Path) -> None:
    """Catches a `preexec_fn` dropped, or run before the join (what it sets up would then be
    done outside the group): the child sees itself in the group when its preexec runs."""
    with cgroup.MemoryCgroup(16 << 20) as cg:
        code = "import sys; print(open(sys.argv[1]).read().strip())"
        marker = tmp_path / "preexec"

        def preexec() -> None:
            own = Path("/proc/self/cgroup").read_text()
            marker.write_text("joined" if cg.name in own else "outside")

        proc = cg.popen(
            [sys.executable, "-c", code, str(marker)],
            preexec_fn=preexec,
            stdout=subprocess.PIPE,
            text=True,
        )
        out, _ = proc.communicate(timeout=30)
        assert (proc.returncode, out.strip()) == (0, "joined")


def test_bad_limit_rejected() -> None:
    with pytest.raises(ValueError, match="below one page"):
        cgroup.MemoryCgroup(100)


def test_no_controller_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(cgroup.CgroupError, match="no cgroup memory controller"):
        cgroup.MemoryCgroup(1 << 20, root=tmp_path)


def test_headroom_check_is_quiet_without_swap_pressure() -> None:
    with cgroup.MemoryCgroup(16 << 20) as cg:
        cg.run([sys.executable, "-c", "pass"], timeout=30)
        assert not [p for p in cgroup.swap_headroom_problems() if cg.name in p]


def test_workload_in_cgroup_reports_intact(tmp_path: Path) -> None:
    with cgroup.MemoryCgroup(256 << 20) as cg:
        res = cg.run(
            [sys.executable, "-m", "duvm.cli.workload", "--mib", "16"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert res.returncode == 0, res.stderr
    assert '"intact": true' in res.stdout.splitlines()[-1]


def test_the_unswappable_group_forbids_swap_and_enables_the_controller(tmp_path: Path) -> None:
    """Catches nbdfuse's group left swappable (memory.swap.max not 0: nbdfuse swapped out to
    the device it serves waits for itself, seen hang a QEMU guest), or left reclaimable
    (memory.min not max: nbdfuse refaulting its evicted code needs a page only its own progress
    would free, seen hang one too), or made without the memory controller enabled for the
    root's children (those files would not exist). This machine's memory controller is cgroup
    v1, so the v2 tree here is a stand-in of plain files; the QEMU guests of tools/qemu_guest
    (`stress.py --method nbdfuse-loop`) use the real one."""
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    group = cgroup.unswappable_group(tmp_path)
    assert group == tmp_path / cgroup.UNSWAPPABLE
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "memory.min").read_text() == "max"  # its code is never evicted either
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    assert not (group / "memory.max").exists()  # no RAM limit: nbdfuse must never be OOM-killed
    assert cgroup.unswappable_group(tmp_path) == group  # made once, found again


def test_no_unswappable_group_without_cgroup_v2(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    with pytest.raises(cgroup.CgroupError, match="cgroup v1 cannot forbid swapping"):
        cgroup.unswappable_group(tmp_path)


def test_a_joined_child_writes_its_own_pid_before_it_runs(tmp_path: Path) -> None:
    import subprocess

    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    child = subprocess.Popen(["sleep", "0"], preexec_fn=cgroup.joiner(tmp_path))
    child.wait(10)
    assert procs.read_text() == str(child.pid)
    cgroup.remove_if_empty(tmp_path)  # not empty (a plain folder with files): left in place
    assert tmp_path.exists()
