"""`duvm.base.pressure.lock_in_memory` brings back the pages a process already had out on swap.

Real parts: a swap file turned on here, a memory cgroup (v1) that pushes a child's pages out to
it, the child's own mlockall, and /proc/PID/status's VmSwap before and after. The child's
memory limit is raised before it locks, so faulting its pages back in is allowed."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.base import cgroup

MIB = 1 << 20
CHILD = textwrap.dedent(
    """
    import mmap, sys
    from duvm.base import pressure

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    buf = mmap.mmap(-1, 48 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, len(buf), 4096):
        buf[i : i + 8] = i.to_bytes(8, "little")
    print("filled", flush=True)
    sys.stdin.readline()  # the parent saw the pages go out and raised the limit
    swapped = status("VmSwap")
    why = pressure.lock_in_memory()
    after, locked = status("VmSwap"), status("VmLck")  # before the check below touches pages
    ok = all(buf[i : i + 8] == i.to_bytes(8, "little") for i in range(0, len(buf), 4096))
    print(swapped, after, locked, why, ok, flush=True)
    """
)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (swapon, a memory cgroup, mlockall)"
    if cgroup.detect_version() != 1:
        return "needs a cgroup v1 memory hierarchy (this project's machines have one)"
    for tool in ("mkswap", "swapon", "swapoff"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@contextlib.contextmanager
def _swap_file(mib: int = 96) -> Iterator[Path]:
    """A swap file on disk (not tmpfs, which cannot hold one), off and removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="duvm-swapped-", dir="/var/tmp"))
    path = folder / "test.swap"
    try:
        with open(path, "wb") as f:
            f.write(bytes(mib * MIB))
        path.chmod(0o600)
        subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
        subprocess.run(["swapon", str(path)], check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["swapoff", str(path)], check=True, capture_output=True)
    finally:
        shutil.rmtree(folder)


def _vm_swap_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSwap:"):
            return int(line.split()[1])
    return 0


@pytest.mark.root
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_locking_brings_back_the_pages_already_out_on_swap() -> None:
    """Catches a lock_in_memory that leaves pages already swapped out where they are (mlockall
    with MCL_ONFAULT does): a supervisor started while its node swapped had pages of its own on
    the duvm device, and its first touch of one after the daemon died waited for that dead
    device until the kernel failed the held reads and init died with them (QEMU guest, 256 MiB
    RDMA set-up)."""
    with _swap_file(), cgroup.MemoryCgroup(16 * MIB) as group:
        child = group.popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "filled", child.stderr.read()  # type: ignore[union-attr]
            out_kib = _vm_swap_kib(child.pid)
            assert out_kib > 16 * 1024  # at least a third of its 48 MiB went out
            (group.path / "memory.limit_in_bytes").write_text(str(512 * MIB))
            child.stdin.write("go\n")
            child.stdin.flush()
            swapped, after, locked, why, ok = child.stdout.readline().split()
        finally:
            child.kill()
            child.wait()
    assert why == "None" and ok == "True"
    assert int(swapped) >= out_kib - 1024
    assert int(after) == 0  # every page it had out is back
    assert int(locked) >= 48 * 1024  # and locked with the rest
