"""`duvm.node.lifecycle.room`: room for a new daemon on a node out of memory, by ending one
program.

The watch's timing and bounds run with stand-ins for `available`, `pick` and `kill` (ending a
real program of this machine for real would be wrong); `pick_victim` reads a /proc tree laid
out like the kernel's, and `end` ends a real child of this test. The whole path runs in the
QEMU guest's `:dkill` set-ups (tools/qemu_guest/stress.py), where a node with no room for a
standby restarts its daemon the slow way."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from duvm.base import pressure
from duvm.node.lifecycle import room

VICTIM = room.Victim(4242, "hog", 200_000)


def _room(**kw: object):
    ended: list[int] = []
    said: list[str] = []
    kw.setdefault("pick", lambda: VICTIM)
    cm = room.making_room(
        40_000,
        said.append,
        kill=ended.append,
        **kw,  # type: ignore[arg-type]
    )
    return cm, ended, said


def test_memory_short_past_the_grace_ends_one_program_at_a_time() -> None:
    cm, ended, said = _room(after_s=0.05, every_s=0.05, max_kills=3, available=lambda: 1000)
    with cm as victims:
        time.sleep(0.6)
    assert ended == [4242] * 3  # bounded: past that the kernel's own timer decides
    assert victims == [VICTIM] * 3
    assert said[0] == (
        "no daemon serves yet and 1000 KiB are available of the 40000 a daemon needs: ended "
        "pid 4242 (hog, 200000 KiB resident) to make room (1 of at most 3)"
    )
    assert said[2].endswith("(3 of at most 3)")


def test_nothing_ended_within_the_grace_nor_with_memory_enough() -> None:
    """Catches a room that ends a program at once (a new daemon that would have served in its
    ~5 s under TCG costs a program) or whatever memory there is."""
    cm, ended, _ = _room(after_s=5.0, available=lambda: 1000)
    with cm:
        time.sleep(0.2)
    assert ended == []
    cm, ended, _ = _room(after_s=0.01, every_s=0.01, available=lambda: 40_000)
    with cm:
        time.sleep(0.2)
    assert ended == []
    cm, ended, _ = _room(after_s=0.01, every_s=0.01, available=lambda: None)
    with cm:
        time.sleep(0.1)
    assert ended == []  # MemAvailable unreadable: nothing is ended on a guess


def test_memory_back_stops_the_ends() -> None:
    readings = iter([1000, 50_000, 50_000, 50_000, 50_000])
    cm, ended, _ = _room(
        after_s=0.02, every_s=0.02, max_kills=3, available=lambda: next(readings, 50_000)
    )
    with cm:
        time.sleep(0.3)
    assert ended == [4242]


def test_no_candidate_is_said_and_ends_the_watch() -> None:
    cm, ended, said = _room(after_s=0.01, every_s=0.01, available=lambda: 1, pick=lambda: None)
    with cm:
        time.sleep(0.2)
    assert ended == []
    assert said == [
        "1 KiB available of the 40000 a daemon needs, and no program holds memory that could "
        "make room: the kernel's timer decides"
    ]


def test_the_watch_ends_with_the_restart() -> None:
    """Catches a watch thread left running after the restart served: it would end programs
    while the new daemon serves."""
    cm, ended, _ = _room(after_s=0.1, every_s=0.01, available=lambda: 1000)
    with cm:
        pass
    time.sleep(0.3)
    assert ended == []
    assert not [t for t in threading.enumerate() if t.name == "duvm-room"]


def _proc(
    root: Path,
    pid: int,
    adj: int,
    anon: int | None,
    shmem: int = 0,
    name: str = "x",
    locked: int = 0,
    ppid: int = 1,
):
    d = root / str(pid)
    d.mkdir()
    (d / "oom_score_adj").write_text(f"{adj}\n")
    (d / "comm").write_text(f"{name}\n")
    mem = "" if anon is None else f"RssAnon:\t{anon} kB\nRssShmem:\t{shmem} kB\n"
    (d / "status").write_text(
        f"Name:\t{name}\nPPid:\t{ppid}\nVmLck:\t{locked} kB\n{mem}VmSwap:\t999999 kB\n"
    )


def test_the_victim_holds_the_most_memory_and_is_none_of_duvms(tmp_path: Path) -> None:
    """Catches the kernel's own ranking, which counts swap: in the QEMU guest SysRq f first
    ended a workload all out on the dead device (nothing freed), then a memserver at -900;
    and a choice that would end duvm's own processes where their score stayed at 0."""
    _proc(tmp_path, 1, 0, 900_000, name="init")
    _proc(tmp_path, 10, -900, 500_000, name="memserver")
    _proc(tmp_path, 11, -1000, 400_000, name="reporter")
    _proc(tmp_path, 12, 0, 0, name="swapped")  # its 999999 kB are all out on swap
    _proc(tmp_path, 13, 0, None, name="kthread")
    _proc(tmp_path, 14, 0, 30_000, shmem=20_000, name="cache")
    _proc(tmp_path, 15, 500, 40_000, name="workload")
    _proc(tmp_path, 16, 0, 800_000, name="me")
    # where no OOM score could be lowered (no CAP_SYS_RESOURCE): duvm's processes are still
    # locked, and the new daemon is the supervisor's child
    _proc(tmp_path, 18, 0, 700_000, name="memserver", locked=700_000)
    _proc(tmp_path, 19, 0, 600_000, name="new daemon", ppid=16)
    (tmp_path / "self").mkdir()
    assert room.pick_victim(tmp_path, me=16) == room.Victim(14, "cache", 50_000)
    (tmp_path / "14" / "status").unlink()  # ended between the listing and the read
    assert room.pick_victim(tmp_path, me=16) == room.Victim(15, "workload", 40_000)
    _proc(tmp_path, 17, 0, 512, name="tiny")
    (tmp_path / "15" / "oom_score_adj").write_text("-900\n")
    assert room.pick_victim(tmp_path, me=16) is None  # too small to be worth it


def test_end_kills_through_a_pidfd() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        room.end(child.pid)
        assert child.wait(10) == -9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with pytest.raises(ProcessLookupError):  # reaped: the pid names nothing now
        room.end(child.pid)


def test_available_memory_is_read_from_meminfo_or_none(tmp_path: Path) -> None:
    """Catches a reader that takes the wrong line (MemFree: the room would be judged by free
    memory, which leaves out the page cache a kill is not needed for) or that raises on a
    file it cannot read (the supervisor's restart would end with it)."""
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:  1000 kB\nMemFree:  100 kB\nMemAvailable:  700 kB\n")
    assert pressure.mem_available_kib(info) == 700
    info.write_text("MemTotal:  1000 kB\nMemAvailable:  junk kB\n")
    assert pressure.mem_available_kib(info) is None
    assert pressure.mem_available_kib(tmp_path / "absent") is None
    real = pressure.mem_available_kib()
    assert real is not None and real > 0
