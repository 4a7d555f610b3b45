"""The kernel's swap and memory, as attach and detach need them: the ``vm.min_free_kbytes``
reserve, watermark boosting, ``/proc/swaps``, and whether a swapoff can bring the pages home.

Swapping over a network block device needs memory on the I/O path (socket buffers, FUSE
requests). If free memory runs out, the kernel cannot allocate for the request that would free
memory, and the machine freezes. ``vm.min_free_kbytes`` is the reserve the allocator keeps for
such atomic/reclaim allocations; see :func:`safe_min_free_kbytes` for the floor we set. It is
raised (never lowered) on attach and restored on detach if nobody changed it meanwhile.

``vm.watermark_boost_factor`` is set to 0 the same way (and put back on detach). A boost
raises every zone watermark, ``min`` included, by up to 150 % of ``high`` after a
fragmentation event, until kswapd has reclaimed that much; but kswapd reclaims by swapping out
through the daemon. In a QEMU guest with its only memserver stopped for 20 s, a boost of 20 MB
put ``min`` at 29 MB with 14 MB free: the daemon's socket buffers for the resumed memserver were
below even its realtime reserve, and the node hung (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from duvm.base import cgroup, pressure
from duvm.node.attach.attach_state import AttachError

MIN_FREE_SYSCTL = Path("/proc/sys/vm/min_free_kbytes")
WATERMARK_BOOST_SYSCTL = Path("/proc/sys/vm/watermark_boost_factor")  # Linux 5.0 and later


# --- vm.min_free_kbytes ----------------------------------------------------------------------


def safe_min_free_kbytes(mem_total_kb: int) -> int:
    """The reserve we want while swapping over the network, in KiB.

    The kernel's own default is ``sqrt(16 * lowmem_kb)``: 1447 KiB in a 192 MiB guest, where
    swap over NBD froze 4 of 6 runs; 8192 KiB (5.6x the default, 4.2 % of RAM) froze none of 12.
    We take 4x the kernel formula, never below that measured 8192 KiB, and cap it at the
    kernel's own upper bound for the default (262144 KiB), so the reserve grows with the square
    root of RAM: 192 MiB -> 8192, 1 GiB -> 16384, 16 GiB -> 65536, 24 GiB -> ~79500,
    >= 256 GiB -> 262144.
    """
    return int(min(262144, max(8192, 4 * math.sqrt(16 * max(mem_total_kb, 0)))))


def mem_total_kb(meminfo: str | None = None) -> int:
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    raise AttachError("MemTotal missing from /proc/meminfo")


def raise_min_free(sysctl: Path = MIN_FREE_SYSCTL) -> tuple[int, int | None]:
    """Raise to the safe floor if lower. Returns (value before, value we set or None)."""
    before = int(sysctl.read_text())
    floor = safe_min_free_kbytes(mem_total_kb())
    if before >= floor:
        return before, None
    sysctl.write_text(str(floor))
    return before, floor


def restore_min_free(
    before: int | None, we_set: int | None, sysctl: Path = MIN_FREE_SYSCTL
) -> None:
    """Put back the old value, unless someone changed it after we did (then theirs stands)."""
    restore_sysctl(before, we_set, sysctl)


def stop_watermark_boost(
    sysctl: Path = WATERMARK_BOOST_SYSCTL,
) -> tuple[int | None, int | None]:
    """Set ``vm.watermark_boost_factor`` to 0 (see the module docstring). Returns (value
    before, 0 or None when it was 0 already); (None, None) on a kernel without the setting."""
    try:
        before = int(sysctl.read_text())
    except FileNotFoundError:
        return None, None
    if before == 0:
        return before, None
    sysctl.write_text("0")
    return before, 0


def restore_sysctl(before: int | None, we_set: int | None, sysctl: Path) -> None:
    """Put back the value a sysctl had before we set it, unless someone changed it after we did
    (then theirs stands). Nothing to do when we set nothing."""
    if before is None or we_set is None:
        return
    if int(sysctl.read_text()) == we_set:
        sysctl.write_text(str(before))


# --- /proc/swaps -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwapEntry:
    filename: str
    type: str
    size_kb: int
    used_kb: int
    priority: int


def parse_proc_swaps(text: str) -> list[SwapEntry]:
    """Lines of /proc/swaps -> entries. Malformed lines are skipped, never fatal."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) != 5:
            continue
        name, kind, size, used, prio = parts
        try:
            out.append(SwapEntry(name.replace("\\040", " "), kind, int(size), int(used), int(prio)))
        except ValueError:
            continue
    return out


def swap_entry(device: str) -> SwapEntry | None:
    real = os.path.realpath(device)
    for e in parse_proc_swaps(Path("/proc/swaps").read_text()):
        if e.filename in (device, real):
            return e
    return None


# --- swapoff ---------------------------------------------------------------------------------


def swapoff_problems(entry: SwapEntry) -> list[str]:
    """Reasons swapoff of `entry` would fail or make the kernel kill processes (empty: none).

    The cgroup check cannot tell which swap device a group's pages are on, so it is
    conservative; it is skipped when nothing is on our device.
    """
    problems: list[str] = []
    if entry.used_kb == 0:
        return problems
    available = pressure.mem_available_kib()
    if available is not None and entry.used_kb > available:
        problems.append(
            f"{entry.used_kb >> 10} MiB are swapped out to {entry.filename} but only "
            f"{available >> 10} MiB of RAM are available to bring them home"
        )
    problems += cgroup.swap_headroom_problems()
    return problems


def swapoff_failure(device: str, error: str) -> str:
    """What a failed swapoff means, from what it said: RAM too short, or pages unreadable."""
    if "Input/output error" in error or "EIO" in error:
        why = (
            "the kernel could not read some swapped pages back from it (I/O errors: is the "
            "daemon running and are its memservers reachable? `duvm status` shows both). "
            "Pages it did read are back in RAM; fix the cause and run disable again"
        )
    else:
        why = (
            "the kernel must bring every swapped page back into RAM first; this usually "
            "means there is not enough free memory (and a memory-limited cgroup that could "
            "not take its pages back may have been OOM-killed). Free memory and run disable "
            "again"
        )
    return f"swapoff of {device} failed, so it stays attached: {why}. ({error})"
