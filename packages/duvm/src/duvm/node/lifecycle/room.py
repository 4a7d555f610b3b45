"""Room for a new daemon on a node out of memory: the kernel's OOM killer, asked in time.

Theory of operation
-------------------
When the daemon dies with no standby ready, the supervisor starts a new one (the slow way). A
new daemon needs about what the last one held of its own (tens of MiB of heap); on a node
whose memory is all taken, that memory can only come from swapping, and the swap device is
the one waiting for this daemon. Reclaim then waits on the held swap writes, the OOM killer
never runs (pages under writeback look like progress), and after the kernel's 60 s the held
requests fail: every program whose page was being swapped in dies of it, init among them
(a kernel panic, seen in the 256 MiB RDMA guest).

So while a restart the slow way has not served, `making_room` watches from a thread of the
supervisor (locked and realtime, so it runs when the new daemon cannot): once `AFTER_S` have
passed and ``MemAvailable`` is still below what a daemon needs, it asks the kernel's OOM killer
to end one program (``/proc/sysrq-trigger``, ``f``: the kernel's own choice by its OOM score,
its reaper frees the victim's memory even while it waits on the dead device; duvm's daemon,
supervisor and memservers are last in its list, init is never chosen). It asks again every
`EVERY_S` while memory stays short, at most `MAX_KILLS` times per restart. This is the design's
promised fallback (a crashed pool falls back to the OOM killer) made early and deliberate: one
program ends so that the pages of all the others, init's included, are served again.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from duvm.node.lifecycle.standby_process import mem_available_kib

AFTER_S = 10.0  # a new daemon serves within ~5 s under TCG, well under 1 s on hardware
EVERY_S = 5.0  # between two kills while memory stays short
MAX_KILLS = 3  # per restart: past them the kernel's own timer decides
SYSRQ = Path("/proc/sysrq-trigger")


def oom_kill(trigger: Path = SYSRQ) -> None:
    """Ask the kernel's OOM killer for one victim (root; works whatever ``kernel.sysrq`` is:
    that setting is for the keyboard only)."""
    trigger.write_text("f")


@contextlib.contextmanager
def making_room(
    need_kib: int,
    say: Callable[[str], None],
    *,
    after_s: float = AFTER_S,
    every_s: float = EVERY_S,
    max_kills: int = MAX_KILLS,
    available: Callable[[], int | None] = mem_available_kib,
    kill: Callable[[], None] | None = None,
) -> Iterator[list[int]]:
    """Run the body (a restart) while a thread ends programs for memory, as the module doc
    says. Yields the list of ``MemAvailable`` readings (KiB) at which it asked for a kill."""
    done = threading.Event()
    kills: list[int] = []
    kill = kill or oom_kill  # looked up now: a test replaces the module's

    def watch() -> None:
        wait = after_s
        while len(kills) < max_kills and not done.wait(wait):
            wait = every_s
            have = available()
            if have is None or have >= need_kib:
                continue
            try:
                kill()
            except OSError as exc:
                say(f"cannot ask the OOM killer for room ({exc}): the kernel's timer decides")
                return
            kills.append(have)
            say(
                f"no daemon serves yet and {have} KiB are available of the {need_kib} a "
                f"daemon needs: asked the kernel's OOM killer to end one program "
                f"({len(kills)} of at most {max_kills})"
            )

    thread = threading.Thread(target=watch, name="duvm-room", daemon=True)
    thread.start()
    try:
        yield kills
    finally:
        done.set()
        thread.join()
