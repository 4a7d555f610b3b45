"""The page arena: slot accounting, isolation of slots, locking and its warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from duvm.memserver.arena import PAGE_SIZE, Arena, ArenaFull


def test_slots_are_distinct_windows_and_accounting_is_exact() -> None:
    arena = Arena(8, lock=False)
    try:
        assert (arena.slots, arena.free_slots, arena.used_slots) == (8, 8, 0)
        slots = [arena.alloc() for _ in range(8)]
        assert sorted(slots) == list(range(8)) and slots[0] == 0  # fills from the start
        for s in slots:
            arena.view(s)[:] = bytes([s + 1]) * PAGE_SIZE
        for s in slots:
            assert bytes(arena.view(s)) == bytes([s + 1]) * PAGE_SIZE
        with pytest.raises(ArenaFull):
            arena.alloc()
        arena.free(slots[3])
        assert (arena.free_slots, arena.used_slots) == (1, 7)
        assert arena.alloc() == slots[3]  # the freed slot is reused, nothing new allocated
    finally:
        arena.close()


def test_arena_memory_is_one_preallocated_mapping() -> None:
    arena = Arena(256, lock=False)
    try:
        mem = arena.memory
        assert mem.nbytes == 256 * PAGE_SIZE
        arena.view(255)[:4] = b"tail"
        assert bytes(mem[255 * PAGE_SIZE : 255 * PAGE_SIZE + 4]) == b"tail"
    finally:
        arena.close()


def test_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        Arena(0)


def test_lock_disabled_reports_why() -> None:
    arena = Arena(4, lock=False)
    assert (arena.locked, arena.lock_error) == (False, "locking disabled")
    arena.close()


def test_root_locks_the_arena() -> None:
    if os.geteuid() != 0:
        pytest.skip("mlock of the arena needs root or CAP_IPC_LOCK here")
    arena = Arena(64)
    try:
        assert arena.locked and arena.lock_error is None
        with open("/proc/self/status") as f:
            locked_kb = next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))
        assert locked_kb >= 64 * PAGE_SIZE // 1024
    finally:
        arena.close()


def test_unprivileged_lock_failure_warns_clearly() -> None:
    """Run as nobody with a 0-byte memlock limit: mlock fails, the arena still works."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("prlimit"):
        pytest.skip("needs root plus setpriv and prlimit to drop privileges")
    code = (
        "import logging; logging.basicConfig();"
        "from duvm.memserver.arena import Arena; a = Arena(16);"
        "a.view(a.alloc())[:2] = b'ok'; print(a.locked, a.lock_error)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [
            "prlimit",
            "--memlock=0",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd="/",
    )
    if proc.returncode != 0 and "Permission denied" in proc.stderr:
        pytest.skip(f"nobody cannot run this interpreter: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("False mlock failed:")
    assert "NOT locked in RAM" in proc.stderr and "CAP_IPC_LOCK" in proc.stderr


def test_alloc_many_takes_what_as_many_allocs_would() -> None:
    one, many = Arena(16, lock=False), Arena(16, lock=False)
    try:
        for arena in (one, many):  # scramble the free lists the same way
            taken = [arena.alloc() for _ in range(10)]
            for s in (taken[7], taken[2], taken[5]):
                arena.free(s)
        expect = [one.alloc() for _ in range(5)]
        assert many.alloc_many(5) == expect
        assert expect[:3] == [5, 2, 7]  # freed slots first, last freed first, then fresh ones
        assert many.free_slots == one.free_slots == 4
        with pytest.raises(ArenaFull):
            many.alloc_many(5)
        assert many.free_slots == 4  # a refused request takes nothing
        assert many.alloc_many(4) == [one.alloc() for _ in range(4)]
        assert many.alloc_many(0) == [] and many.used_slots == 16
    finally:
        one.close()
        many.close()
