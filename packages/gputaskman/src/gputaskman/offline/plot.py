"""Text charts of memory over time for ``gputaskman summary --plot``.

Theory of operation
-------------------
A chart is a grid of `width` columns by `height` rows. The run's time span is cut into
`width` equal buckets; a column shows the highest reading in its bucket (memory charts are
about peaks, and a short spike must not vanish into an average). Bars use the eight
lower-block characters, so each row has eight steps of resolution.

Honesty rules shared with the summary: a sample without a reading (null) is drawn as ``·``
on the bottom row, never as an empty (zero) bar, so missing data cannot pass for a
measured zero; a measured zero is an empty column above a solid baseline. When there are
more columns than samples, a column no sample falls in repeats the one before it (the
earlier sample holds until the next). The scale tops out at the larger of the highest
reading and the recorded total (so a full bar means a full GPU); a reading above the total
grows the scale instead of being capped. Plain characters only, no colour: the output
stays readable in logs and pipes.
"""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gputaskman.render import report

BLOCKS = " ▁▂▃▄▅▆▇█"
NO_READING = "·"
DEFAULT_HEIGHT = 8
LABEL_WIDTH = 10

_Key = tuple[str, str, str]  # summary's MetricKey: (scope, metric, kind)


class _Peak(Protocol):
    @property
    def peak(self) -> float | None: ...


class _Sample(Protocol):
    @property
    def adapters(self) -> Sequence[Mapping[str, Any]]: ...


class ChartRun(Protocol):
    """What `run_charts` reads of a run. `summary.Run` is one; plot does not import summary
    (summary imports plot to draw its charts)."""

    @property
    def samples(self) -> Sequence[_Sample]: ...

    def stats(self) -> Mapping[_Key, _Peak]: ...

    def series(self, key: _Key) -> list[tuple[float, float | None]]: ...


def chart(
    points: Sequence[tuple[float, float | None]],
    *,
    width: int,
    height: int = DEFAULT_HEIGHT,
    top: float | None = None,
    fmt: Callable[[float], str] = report.fmt_bytes,
) -> list[str]:
    """Lines of a bar chart of (time, value or None) points (see the module docstring)."""
    width = max(1, width)
    known = [v for _, v in points if v is not None]
    if not points or not known:
        return ["(no readings)"]
    scale = max([*known, top or 0.0])
    t0, t1 = points[0][0], points[-1][0]
    span = t1 - t0
    # per column: the highest reading, or None when its samples had no reading; a column
    # no sample falls in (more columns than samples) repeats the one before it
    cols: list[float | None] = [None] * width
    seen = [False] * width
    for t, v in points:
        i = 0 if span <= 0 else min(width - 1, int((t - t0) / span * width))
        cur = cols[i]
        if v is not None:
            cols[i] = v if cur is None else max(cur, v)
        seen[i] = True
    for i in range(1, width):
        if not seen[i]:
            cols[i] = cols[i - 1]
    eighths = [
        None if v is None else (round(v / scale * height * 8) if scale > 0 else 0) for v in cols
    ]
    lines = []
    for row in range(height - 1, -1, -1):
        cells = []
        for e in eighths:
            if e is None:
                cells.append(NO_READING if row == 0 else " ")
                continue
            level = e - row * 8
            cells.append(BLOCKS[max(0, min(8, level))])
        label = fmt(scale) if row == height - 1 else (fmt(0) if row == 0 else "")
        lines.append(f"{label:>{LABEL_WIDTH}} ┤{''.join(cells)}".rstrip())
    lines.append(" " * LABEL_WIDTH + " └" + "─" * width)
    left, right = _hms(t0), _hms(t1)
    pad = max(1, width - len(left) - len(right))
    lines.append(" " * (LABEL_WIDTH + 2) + left + " " * pad + right)
    return lines


def _hms(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%H:%M:%S")


def default_width() -> int:
    cols = shutil.get_terminal_size((100, 24)).columns
    return max(20, min(160, cols - LABEL_WIDTH - 4))


def run_charts(run: ChartRun, *, width: int | None = None) -> list[str]:
    """Memory charts for one run (a `summary.Run`): each GPU's measured memory used (scaled to its
    recorded total), then system RAM used (scaled to RAM total)."""
    width = width or default_width()
    stats = run.stats()
    out: list[str] = []
    for a in run.samples[0].adapters:
        bus = str(a["pci_bus_id"])
        used = (bus, "memory_used_bytes", "measured")
        total = stats.get((bus, "memory_total_bytes", "measured"))
        out.append(
            f"  GPU {a['index']} {a['name'] or 'n/a'}: memory used (measured), UTC;"
            f" {NO_READING} = no reading"
        )
        out += [
            "  " + line
            for line in chart(run.series(used), width=width, top=total.peak if total else None)
        ]
    ram = ("system", "ram_used_bytes", "measured")
    if any(v is not None for _, v in run.series(ram)):
        total = stats.get(("system", "ram_total_bytes", "measured"))
        out.append(f"  system RAM used (OS-reported), UTC; {NO_READING} = no reading")
        out += [
            "  " + line
            for line in chart(run.series(ram), width=width, top=total.peak if total else None)
        ]
    return out
