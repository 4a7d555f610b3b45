"""``gputaskman --watch``: a compact report every interval, as gpustat's ``--watch`` prints.

Theory of operation
-------------------
Each sample is a block: `text_report.title_line` (version, UTC time, backend), then one line
per GPU (memory used / total, utilisation, temperature, power) followed by its processes
with the most VRAM, then the processes with a GPU runtime but no GPU context. Every value is
`fmt_reading`'s text, so provenance marks (``~`` inferred, ``≈`` estimated, ``ʳ``
runtime-reported) and ``n/a`` for unknown read as in ``--once`` and the TUI; the process
cells are `text_report.process_cells`' own.

On a terminal each block replaces the last: the cursor goes home, each line erases what is
left of the old one, and the block is cut to the window so it never scrolls. Into a pipe or
file each block is appended after a blank line and flushed, so ``--watch > log`` or
``| grep`` see every sample as it is taken. The output carries no colour.

Sampling is the TUI's and ``record``'s (one collector, budgeted scans), so watching costs
what the TUI costs. The schedule is fixed-rate: a slow sample delays the next one, never
queues a burst. Ctrl-C ends it with exit status 0; so does a reader that goes away (EPIPE).
"""

from __future__ import annotations

import shutil
import time
from typing import Protocol, TextIO

from gputaskman.base.fmt import NA, fmt_reading
from gputaskman.base.readings import Adapter, ProcGpu, Snapshot
from gputaskman.render import text_report
from gputaskman.render.report import proc_host_lookup
from gputaskman.sampling.host import HostSample

TOP_PROCESSES = 5  # per GPU; the rest are counted on one line
# Terminal control (cursor, erase), never colour.
CURSOR_HOME = "\x1b[H"
ERASE_LINE_END = "\x1b[K"
ERASE_BELOW = "\x1b[J"
_CELLS = tuple(text_report.PROCESS_COLUMNS.index(c) for c in ("PID", "NAME", "VRAM", "MODEL"))


class Sampler(Protocol):
    def sample_with_system(self) -> tuple[Snapshot, HostSample | None]: ...

    def close(self) -> None: ...


def gpu_line(a: Adapter, snapshot: Snapshot) -> str:
    """``[0] NAME  mem USED / TOTAL  util U  temp T  power P``; n/a for what is unknown."""
    head = f"[{a.index}] {a.name or a.pci_bus_id}"
    m = snapshot.metrics.get(a.pci_bus_id)
    if m is None:
        return f"{head}  metrics {NA}"
    return (
        f"{head}  mem {fmt_reading(m.memory_used_bytes, as_bytes=True)}"
        f" / {fmt_reading(m.memory_total_bytes, as_bytes=True)}"
        f"  util {fmt_reading(m.util_gpu_percent, '%')}"
        f"  temp {fmt_reading(m.temperature_c, ' C')}"
        f"  power {fmt_reading(m.power_w, ' W')}"
    )


def _more(n: int) -> str:
    return f"… {n} more process{'' if n == 1 else 'es'}"


def render_block(
    snapshot: Snapshot,
    system: HostSample | None = None,
    *,
    selected_gpu: int | None = None,
    top: int = TOP_PROCESSES,
) -> list[str]:
    """One sample's lines (no trailing newline): title, GPUs with their top processes by
    VRAM, then processes with a GPU runtime but no GPU context."""
    lines = [text_report.title_line(snapshot), *text_report.no_gpu_lines(snapshot)]
    adapters = [a for a in snapshot.adapters if selected_gpu in (None, a.index)]
    if selected_gpu is not None and snapshot.adapters and not adapters:
        lines.append(f"GPU {selected_gpu}: not listed ({len(snapshot.adapters)} GPU(s) here)")
    known = {a.pci_bus_id for a in snapshot.adapters}
    procs = sorted(snapshot.processes, key=text_report.sort_key_vram, reverse=True)
    lookup = proc_host_lookup(system)
    groups: list[tuple[str, list[ProcGpu]]] = [
        (gpu_line(a, snapshot), [p for p in procs if p.adapter == a.pci_bus_id]) for a in adapters
    ]
    orphans = [p for p in procs if p.adapter is None or p.adapter not in known]
    if orphans:
        groups.append(("no GPU context (a GPU runtime is loaded)", orphans))
    rows: list[tuple[str, ...] | str] = []
    for head, members in groups:
        rows.append(head)
        for p in members[:top]:
            cells = text_report.process_cells(p, lookup, snapshot)
            rows.append(tuple(cells[i] for i in _CELLS))
        if len(members) > top:
            rows.append("  " + _more(len(members) - top))
    widths = [max((len(r[i]) for r in rows if isinstance(r, tuple)), default=0) for i in range(4)]
    for r in rows:
        if isinstance(r, str):
            lines.append(r)
        else:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
            lines[-1] = lines[-1].rstrip()
    return lines


def terminal_frame(lines: list[str], columns: int, rows: int) -> str:
    """The block redrawn in place: cursor home, each line cut to the width and the rest of
    its old text erased, at most ``rows - 1`` lines (the last says how many were cut), and
    everything below erased."""
    room = max(rows - 1, 1)
    shown = lines[:room]
    if len(lines) > room:
        shown[-1] = f"… {len(lines) - room + 1} more lines: enlarge the terminal"
    body = "".join(line[: max(columns, 1)] + ERASE_LINE_END + "\n" for line in shown)
    return CURSOR_HOME + body + ERASE_BELOW


def watch(
    sampler: Sampler,
    out: TextIO,
    *,
    interval: float,
    count: int | None = None,
    selected_gpu: int | None = None,
    terminal: bool = False,
) -> int:
    """Sample and print every `interval` seconds until Ctrl-C, a closed pipe, or `count`
    samples; closes the sampler. Returns the exit status (0)."""
    due = time.monotonic()
    taken = 0
    try:
        while True:
            snap, system = sampler.sample_with_system()
            lines = render_block(snap, system, selected_gpu=selected_gpu)
            if terminal:
                size = shutil.get_terminal_size()
                out.write(terminal_frame(lines, size.columns, size.lines))
            else:
                out.write(("\n" if taken else "") + "\n".join(lines) + "\n")
            out.flush()
            taken += 1
            if count is not None and taken >= count:
                return 0
            due += interval
            delay = due - time.monotonic()
            if delay < 0:  # a slow sample: start again from now rather than catch up
                due, delay = time.monotonic(), 0.0
            time.sleep(delay)
    except KeyboardInterrupt:
        return 0
    finally:
        sampler.close()
