"""Room for a new daemon on a node out of memory: one program ended, chosen by what it holds.

Theory of operation
-------------------
When the daemon dies with no standby ready, the supervisor starts a new one (the slow way). A
new daemon needs about what the last one held of its own (tens of MiB of heap); on a node
whose memory is all taken, that memory can only come from swapping, and the swap device is
the one waiting for this daemon. Reclaim then waits on the held swap writes, the kernel's OOM
killer does not run (pages under writeback look like progress), and after the kernel's 60 s
the held requests fail: every program whose page was being swapped in dies of it, init among
them (a kernel panic, seen in the 256 MiB RDMA guest).

So while a restart the slow way has not served, `making_room` watches from a thread of the
supervisor (locked and realtime, so it runs when the new daemon cannot): once `AFTER_S` have
passed and ``MemAvailable`` is still below what a daemon needs, it ends the program holding the
most resident memory of its own (`pick_victim`), and asks the kernel to free that memory at
once (`end`: SIGKILL through a pidfd, then ``process_mrelease``, since the victim may be
waiting on the dead device and would not exit soon). It asks again every `EVERY_S` while
memory stays short, at most `MAX_KILLS` times per restart.

It chooses, rather than asking the kernel's OOM killer (SysRq f), because the kernel ranks by
resident memory plus swap: tried in the QEMU guest, it first ended a workload whose pages were
all out on the dead device (nothing freed), then a memserver despite its -900. Here a program
qualifies only if it holds resident memory and is not init, not this process, not a process
it started (the new daemon), not one of duvm's own (an OOM score adjustment of -900 or lower:
the daemon, the supervisor, the memservers) and has locked no memory (duvm's processes lock
theirs even where their OOM score could not be lowered, and a program that locked its memory
asked to stay resident). This is the design's promised fallback (a crashed pool falls back
to OOM) made early and deliberate: one program ends so that the pages of all the others,
init's included, are served again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from duvm.base.libc import libc
from duvm.base.pressure import OOM_SCORE_ADJ, mem_available_kib

AFTER_S = 10.0  # a new daemon serves within ~5 s under TCG, well under 1 s on hardware
EVERY_S = 5.0  # between two ends while memory stays short
MAX_KILLS = 3  # per restart: past them the kernel's own timer decides
MIN_VICTIM_KIB = 1024  # a program holding less would free too little to be worth ending
_SYS_PROCESS_MRELEASE = 448  # the same number on every architecture (Linux 5.15)


@dataclass(frozen=True)
class Victim:
    pid: int
    name: str
    resident_kib: int  # its own: anonymous and shared-memory pages in RAM


def _status_fields(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    found: dict[str, int] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            found[key] = int(rest.split()[0])
    return found


def pick_victim(proc: Path = Path("/proc"), me: int | None = None) -> Victim | None:
    """The program to end for room, as the module doc says; None when none qualifies. Reads
    only what the kernel keeps itself (status, oom_score_adj, comm), never a process's own
    memory (its cmdline could be out on the dead device)."""
    me = os.getpid() if me is None else me
    best: Victim | None = None
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in (1, me):
            continue
        try:
            if int((entry / "oom_score_adj").read_text()) <= OOM_SCORE_ADJ:
                continue
            mem = _status_fields(entry / "status", ("RssAnon", "RssShmem", "VmLck", "PPid"))
            if "RssAnon" not in mem:  # a kernel thread
                continue
            if mem.get("VmLck", 0) > 0 or mem.get("PPid") == me:
                continue  # locked in RAM (as duvm's processes are), or the daemon started here
            kib = mem["RssAnon"] + mem.get("RssShmem", 0)
            if kib >= MIN_VICTIM_KIB and (best is None or kib > best.resident_kib):
                best = Victim(int(entry.name), (entry / "comm").read_text().strip(), kib)
        except (OSError, ValueError):
            continue  # ended meanwhile
    return best


def end(pid: int) -> None:
    """SIGKILL `pid` through a pidfd (never a recycled pid) and have the kernel free its
    memory now (``process_mrelease``; where the kernel lacks it, the memory comes back when
    the process exits)."""
    fd = os.pidfd_open(pid)
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        libc().syscall(ctypes.c_long(_SYS_PROCESS_MRELEASE), ctypes.c_int(fd), ctypes.c_uint(0))
    finally:
        os.close(fd)


@contextlib.contextmanager
def making_room(
    need_kib: int,
    say: Callable[[str], None],
    *,
    after_s: float = AFTER_S,
    every_s: float = EVERY_S,
    max_kills: int = MAX_KILLS,
    available: Callable[[], int | None] = mem_available_kib,
    pick: Callable[[], Victim | None] = pick_victim,
    kill: Callable[[int], None] = end,
) -> Iterator[list[Victim]]:
    """Run the body (a restart) while a thread ends programs for memory, as the module doc
    says. Yields the list of programs it ended."""
    done = threading.Event()
    ended: list[Victim] = []

    def watch() -> None:
        wait = after_s
        while len(ended) < max_kills and not done.wait(wait):
            wait = every_s
            have = available()
            if have is None or have >= need_kib:
                continue
            victim = pick()
            if victim is None:
                say(
                    f"{have} KiB available of the {need_kib} a daemon needs, and no program "
                    "holds memory that could make room: the kernel's timer decides"
                )
                return
            try:
                kill(victim.pid)
            except OSError as exc:
                say(f"cannot end pid {victim.pid} for room ({exc})")
                continue
            ended.append(victim)
            say(
                f"no daemon serves yet and {have} KiB are available of the {need_kib} a "
                f"daemon needs: ended pid {victim.pid} ({victim.name}, {victim.resident_kib} "
                f"KiB resident) to make room ({len(ended)} of at most {max_kills})"
            )

    thread = threading.Thread(target=watch, name="duvm-room", daemon=True)
    thread.start()
    try:
        yield ended
    finally:
        done.set()
        thread.join()
