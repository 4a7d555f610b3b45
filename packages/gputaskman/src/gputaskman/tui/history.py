"""What the TUI remembers of earlier samples: per GPU its memory use and utilisation, per
process its shown VRAM. Only the samples the TUI already takes feed it (in replay, the
recording's frames): it never probes anything itself.

An unknown reading is remembered as unknown (None) and drawn as a gap, never as 0. Each
series also remembers the kind of its latest reading, so a sparkline of inferred values
carries the `~` mark like any other number. Processes are forgotten once they leave the
snapshot, so the memory used stays bounded by what is on screen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from typing import TypeVar

from gputaskman.base.fmt import KIND_MARK
from gputaskman.base.readings import Kind, Reading, Snapshot

KEEP = 120  # samples per series: two minutes at the default interval
BLOCKS = "▁▂▃▄▅▆▇█"
GAP = " "  # an unknown sample: a hole in the line, never the lowest block
K = TypeVar("K", bound=Hashable)


class Series:
    """One quantity over the last `KEEP` samples."""

    __slots__ = ("kind", "values")

    def __init__(self) -> None:
        self.values: deque[float | None] = deque(maxlen=KEEP)
        self.kind: Kind | None = None

    def add(self, value: float | None, kind: Kind | None) -> None:
        self.values.append(value)
        if value is not None:
            self.kind = kind

    def mark(self) -> str:
        """The provenance mark of the values drawn (`~` inferred, `≈` estimated ...)."""
        return "" if self.kind is None else KIND_MARK[self.kind]


def sparkline(values: Iterable[float | None], width: int, top: float | None = None) -> str:
    """The last `width` values as blocks scaled to `top` (or to the largest value), right
    aligned; unknown values are gaps."""
    tail = list(values)[-width:] if width > 0 else []
    known = [v for v in tail if v is not None]
    hi = top if top is not None else max(known, default=0.0)
    out = []
    for v in tail:
        if v is None:
            out.append(GAP)
        elif hi <= 0:
            out.append(BLOCKS[0])
        else:
            frac = min(1.0, max(0.0, v / hi))
            out.append(BLOCKS[min(len(BLOCKS) - 1, int(frac * len(BLOCKS)))])
    return " " * (width - len(out)) + "".join(out)


def _value(r: Reading | None) -> tuple[float | None, Kind | None]:
    if r is None or r.value is None:
        return None, None
    return float(r.value), r.kind


def _series(table: dict[K, Series], key: K) -> Series:
    """`table[key]`, made on first use (`setdefault` would build a Series every call)."""
    s = table.get(key)
    if s is None:
        s = table[key] = Series()
    return s


class History:
    """The series of one TUI session, fed one snapshot at a time."""

    def __init__(self) -> None:
        self.memory: dict[str, Series] = {}  # GPU bus id -> used memory as % of total
        self.util: dict[str, Series] = {}  # GPU bus id -> utilisation %
        self.vram: dict[tuple[int, float | None], Series] = {}  # process key -> shown VRAM
        self.samples = 0

    def add(self, snapshot: Snapshot) -> None:
        self.samples += 1
        for bus, m in snapshot.metrics.items():
            used, kind = _value(m.memory_used_bytes)
            total, _ = _value(m.memory_total_bytes)
            pct = None if used is None or not total else 100.0 * used / total
            _series(self.memory, bus).add(pct, kind)
            _series(self.util, bus).add(*_value(m.util_gpu_percent))
        seen = set()
        vram = self.vram
        for p in snapshot.processes:
            key = p.key
            if key in seen:
                continue  # one process on two GPUs: its first row's VRAM
            seen.add(key)
            _series(vram, key).add(*_value(p.shown_vram))
        if len(vram) > len(seen):
            for key in [k for k in vram if k not in seen]:
                del vram[key]

    def clear(self) -> None:
        """Forget everything (replay jumped: the frames before are not this one's past)."""
        self.memory.clear()
        self.util.clear()
        self.vram.clear()
        self.samples = 0
