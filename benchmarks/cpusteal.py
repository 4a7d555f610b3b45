"""CPU steal: time the hypervisor gave other guests, which slows every target of a benchmark
alike and makes its ratios noisy (on this project's VM it reached 20-45% for minutes)."""

from __future__ import annotations

from pathlib import Path


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal guest guest_nice (guest time is already
    # counted in user and nice)
    return fields[7], sum(fields[:8])


def steal_percent(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Steal between two `cpu_times()`, in percent of all CPU time; None if none passed."""
    total = after[1] - before[1]
    return round(100 * (after[0] - before[0]) / total, 1) if total > 0 else None
