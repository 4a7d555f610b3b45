"""`duvm.node.lifecycle.room`: room for a new daemon on a node out of memory, from the kernel's
OOM killer.

The OOM killer itself is never asked here (it would end the largest program on this machine):
`kill` and `available` are stand-ins, and the supervisor tests pass a room that asks nothing.
The real request runs in the QEMU guest's `:dkill` set-ups (tools/qemu_guest/stress.py),
where a node with no room for a standby restarts its daemon the slow way."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from duvm.node.lifecycle import room


def _room(**kw: object):
    kills: list[str] = []
    said: list[str] = []
    cm = room.making_room(
        40_000,
        said.append,
        kill=lambda: kills.append("f"),
        **kw,  # type: ignore[arg-type]
    )
    return cm, kills, said


def test_memory_short_past_the_grace_asks_for_one_victim_at_a_time() -> None:
    cm, kills, said = _room(after_s=0.05, every_s=0.05, max_kills=3, available=lambda: 1000)
    with cm as asked:
        time.sleep(0.6)
    assert kills == ["f"] * 3  # bounded: past that the kernel's own timer decides
    assert asked == [1000] * 3
    assert said[0].startswith("no daemon serves yet and 1000 KiB are available of the 40000")
    assert "(1 of at most 3)" in said[0] and "(3 of at most 3)" in said[2]


def test_no_victim_within_the_grace_nor_with_memory_enough() -> None:
    """Catches a room that kills at once (a new daemon that would have served in its ~5 s
    under TCG costs a program) or whatever memory there is."""
    cm, kills, _ = _room(after_s=5.0, available=lambda: 1000)
    with cm:
        time.sleep(0.2)
    assert kills == []
    cm, kills, _ = _room(after_s=0.01, every_s=0.01, available=lambda: 40_000)
    with cm:
        time.sleep(0.2)
    assert kills == []
    cm, kills, _ = _room(after_s=0.01, every_s=0.01, available=lambda: None)
    with cm:
        time.sleep(0.1)
    assert kills == []  # MemAvailable unreadable: nothing is killed on a guess


def test_memory_back_stops_the_kills() -> None:
    readings = iter([1000, 50_000, 50_000, 50_000, 50_000])
    cm, kills, _ = _room(
        after_s=0.02, every_s=0.02, max_kills=3, available=lambda: next(readings, 50_000)
    )
    with cm:
        time.sleep(0.3)
    assert kills == ["f"]


def test_the_watch_ends_with_the_restart() -> None:
    """Catches a watch thread left running after the restart served: it would end programs
    while the new daemon serves."""
    cm, kills, _ = _room(after_s=0.1, every_s=0.01, available=lambda: 1000)
    with cm:
        pass
    time.sleep(0.3)
    assert kills == []
    assert not [t for t in threading.enumerate() if t.name == "duvm-room"]


def test_a_refused_request_is_said_and_ends_the_watch() -> None:
    said: list[str] = []
    calls: list[int] = []

    def refuse() -> None:
        calls.append(1)
        raise PermissionError(13, "Permission denied")

    with room.making_room(
        40_000, said.append, after_s=0.01, every_s=0.01, available=lambda: 1, kill=refuse
    ):
        time.sleep(0.2)
    assert calls == [1]
    assert said == [
        "cannot ask the OOM killer for room ([Errno 13] Permission denied): the kernel's "
        "timer decides"
    ]


def test_the_request_is_sysrq_f(tmp_path: Path) -> None:
    trigger = tmp_path / "sysrq-trigger"
    room.oom_kill(trigger)
    assert trigger.read_text() == "f"  # include/linux/sysrq.h: 'f' is moom_op, the OOM killer
