"""The header: one line per GPU, then the details of the focused one.

Each GPU's line carries its name, a bar of memory used / total (NVML, amdgpu sysfs: measured;
Intel: inferred, shown with the ``~`` mark), utilisation, temperature and power where known,
and, where the width allows, sparklines of memory use and utilisation from the samples the TUI
already took (`tui.history`). When either memory reading is unknown the line says n/a with the
reason instead of drawing an empty bar. The focused GPU (``g``) is marked ``▶`` and its
details follow: PCI address, driver, the other engines, what is attributed to processes, and
its health (`report_health.health_lines`: the verdict, XID, ECC, retired pages, remapped
rows, clock event reasons, fan, PCIe and NVLink rates; a GPU whose readings say it is unhealthy
is marked ``UNHEALTHY`` on its line too) and MIG instances, its problems and notes. On a short
terminal (`compact`) the details shrink to the attributed line, the health verdict and the
problems. The header scrolls when it is taller than its share of the screen.

When the backend is unavailable the header explains why (and what that means) in one
statement in place of the GPUs.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from gputaskman.base.gpuhealth import UNHEALTHY, verdict
from gputaskman.base.readings import Adapter, DeviceMetrics, Reading, Snapshot
from gputaskman.render import report, text_report
from gputaskman.render.report_health import health_lines, mig_lines
from gputaskman.render.report_owners import totals_lines
from gputaskman.tui.history import History, Series, sparkline
from gputaskman.tui.widgets.unchanged import update_static

SPARK_WIDTH = 20  # samples drawn per sparkline, when the line has room for them
NAME_WIDTH = 32


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: max(1, n - 1)] + "…"


def _spark(label: str, series: Series | None, top: float | None) -> Text:
    if series is None or not series.values:
        return Text("")
    out = Text(f"  {label}{series.mark()} ", style="dim")
    out.append(sparkline(series.values, SPARK_WIDTH, top), style="cyan")
    return out


def memory_cell(used: Reading, total: Reading, width: int) -> Text:
    """A short bar and ``used/total pct``, or n/a with the reason."""
    if used.value is None or total.value is None or total.value <= 0:
        missing = used if used.value is None else total
        return Text(f"memory {report.fmt_reading(missing, reason=True)}", style="yellow")
    frac = max(0.0, min(1.0, used.value / total.value))
    filled = round(frac * width)
    style = "green" if frac < 0.75 else "yellow" if frac < 0.9 else "red"
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="grey37")
    f = report.fmt_reading
    text.append(f" {f(used, as_bytes=True)}/{f(total, as_bytes=True)} {frac * 100:.0f}%")
    return text


def gpu_line(
    snapshot: Snapshot, adapter: Adapter, focused: bool, history: History | None, width: int
) -> Text:
    """One GPU in one line of at most `width` cells: the name is cut to fit, and the parts
    that do not fit are left out, the sparklines first, then power and temperature."""
    bus = adapter.pci_bus_id
    m = snapshot.metrics.get(bus)
    f = report.fmt_reading
    if m is None:
        rest = Text("metrics n/a", style="yellow")
    else:
        rest = memory_cell(m.memory_used_bytes, m.memory_total_bytes, 10 if width < 100 else 16)
        rest.append(f"  gpu {f(m.util_gpu_percent, '%')}")
    health = snapshot.health.get(bus)
    if health and verdict(health).state == UNHEALTHY:
        rest.append("  UNHEALTHY", style="bold red")  # why: in the focused GPU's details
    mark = f"{'▶' if focused else ' '} {adapter.index} "
    room = max(8, min(NAME_WIDTH, width - len(mark) - 2 - rest.cell_len))
    line = Text(mark, style="bold")
    line.append(_clip(adapter.name or "n/a", room), style="bold" if focused else "")
    line.append("  ")
    line.append_text(rest)
    if m is None:
        return line
    optional = [Text(f"  {f(m.temperature_c, ' C')}"), Text(f"  {f(m.power_w, ' W')}")]
    if history is not None:
        optional.append(_spark("mem", history.memory.get(bus), 100.0))
        optional.append(_spark("gpu", history.util.get(bus), 100.0))
    for p in optional:
        if line.cell_len + p.cell_len > width:
            break
        line.append_text(p)
    return line


def details(snapshot: Snapshot, adapter: Adapter, compact: bool) -> Text:
    """The focused GPU's lines below the per-GPU lines."""
    out = Text()
    m = snapshot.metrics.get(adapter.pci_bus_id)
    if not compact:
        out.append(f"GPU {adapter.index}: {adapter.pci_bus_id}")
        if snapshot.driver_version:
            out.append(f"  driver {snapshot.driver_version}")
        if m is not None:
            out.append(f"  reserved {report.fmt_reading(m.memory_reserved_bytes, as_bytes=True)}")
            out.append("\n" + engines_line(m))
        out.append("\n")
    att = snapshot.attributed_on(adapter.pci_bus_id)
    complete = snapshot.attributed_complete_on(adapter.pci_bus_id)
    if compact:
        lower = "" if complete else "; a lower bound"
        out.append(f"attributed to processes {report.fmt_bytes(att)} (measured only{lower})")
    else:
        out.append(
            f"attributed to processes (measured only) {report.fmt_bytes(att)}"
            + ("" if complete else "  · lower bound: some memory hidden or a list failed")
        )
    if not compact:  # measured VRAM by user, pod and job ("+": a lower bound)
        for line in totals_lines(snapshot, adapter.pci_bus_id, limit=4):
            out.append("\nby " + line)
    gtt = snapshot.extra_metrics.get(adapter.pci_bus_id)
    if gtt and not compact:
        out.append("\n" + report.gtt_text(gtt))
    for line in health_lines(snapshot, adapter.pci_bus_id)[: 1 if compact else None]:
        out.append("\n" + line, style="bold red" if line.startswith("health  UNHEALTHY") else "")
    if not compact:
        for line in mig_lines(snapshot, adapter.pci_bus_id):
            out.append("\n" + line)
    for pr in snapshot.problems:
        if pr.adapter == adapter.pci_bus_id:
            detail = f": {pr.detail}" if pr.detail else ""
            out.append(f"\n{pr.where} {pr.reason}{detail}", style="yellow")
    if not compact:
        for note in notes_for(snapshot, adapter):
            out.append(f"\nnote: {note}", style="italic")
    return out


def gpu_text(
    snapshot: Snapshot | None,
    adapter: Adapter | None,
    history: History | None = None,
    width: int = 200,
    compact: bool = False,
) -> Text:
    if snapshot is None:
        return Text("collecting the first sample…", style="italic")
    if not snapshot.available:
        bp = snapshot.backend_problem
        assert bp is not None
        # one statement, not three: the hint explains the reason when there is one (the
        # library's own message says the same again); else the library's detail
        out = Text(f"No GPU: {snapshot.backend} unavailable ({bp.reason})", style="bold yellow")
        hint = text_report.BACKEND_HINTS.get(bp.reason)
        why = hint or (f"{snapshot.backend}: {bp.detail}" if bp.detail else None)
        if why:
            out.append(f": {why}")
        return out
    if adapter is None:
        return Text(f"{snapshot.backend} answered but lists no GPU", style="bold yellow")
    out = Text()
    for a in snapshot.adapters:
        out.append_text(gpu_line(snapshot, a, a is adapter, history, width))
        out.append("\n")
    out.append_text(details(snapshot, adapter, compact))
    return out


def notes_for(snapshot: Snapshot, adapter: Adapter) -> list[str]:
    """The snapshot's notes that concern `adapter`: those naming its PCI address, the
    Intel memory note on an Intel GPU, and notes naming no GPU at all."""
    buses = [a.pci_bus_id for a in snapshot.adapters]
    out = []
    for note in snapshot.notes:
        if note.startswith("Intel memory:"):
            if adapter.vendor == "intel":
                out.append(note)
        elif adapter.pci_bus_id in note or not any(b in note for b in buses):
            out.append(note)
    return out


def engines_line(m: DeviceMetrics) -> str:
    """The focused GPU's readings its one-line summary leaves out."""
    f = report.fmt_reading
    return (
        f"mem {f(m.util_memory_percent, '%')}  enc {f(m.encoder_percent, '%')}"
        f"  dec {f(m.decoder_percent, '%')}  power limit {f(m.power_limit_w, ' W')}"
        f"  clock {f(m.clock_graphics_mhz, ' MHz')}"
    )


class GpuHeader(VerticalScroll):
    """Shows the latest snapshot's GPUs; `show()` re-renders it. `text` is what it shows."""

    DEFAULT_CSS = """
    GpuHeader { height: auto; max-height: 45%; padding: 0 1;
                border-bottom: solid $primary-darken-2; }
    GpuHeader > Static { width: 1fr; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body = Static("", id="gpu-body")
        self.text = Text("")

    def compose(self) -> ComposeResult:
        yield self.body

    def show(
        self,
        snapshot: Snapshot | None,
        adapter: Adapter | None,
        history: History | None = None,
        compact: bool = False,
    ) -> None:
        width = max(20, (self.size.width or self.app.size.width) - 2)
        self.text = gpu_text(snapshot, adapter, history, width, compact)
        update_static(self.body, self.text)
