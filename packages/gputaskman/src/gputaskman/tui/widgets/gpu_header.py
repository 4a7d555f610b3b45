"""The header for the selected GPU: identity, a measured memory bar and engine loads.

The bar is drawn from the device's used / total readings (NVML, amdgpu sysfs: measured;
Intel: inferred, shown with the ``~`` mark); when either is unknown the header says n/a
with the reason instead of drawing an empty bar. When the
backend is unavailable the header explains why (and what that means) in place of a GPU.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from gputaskman.base.readings import Adapter, DeviceMetrics, Reading, Snapshot
from gputaskman.core import report, text_report

BAR_WIDTH = 32


def memory_bar(used: Reading, total: Reading, width: int = BAR_WIDTH) -> Text:
    """A bar of measured used/total memory, or n/a with the reason."""
    if used.value is None or total.value is None or total.value <= 0:
        missing = used if used.value is None else total
        return Text(f"memory {report.fmt_reading(missing, reason=True)}", style="yellow")
    frac = max(0.0, min(1.0, used.value / total.value))
    filled = round(frac * width)
    style = "green" if frac < 0.75 else "yellow" if frac < 0.9 else "red"
    text = Text("memory ")
    text.append("█" * filled, style=style)
    text.append("░" * (width - filled), style="grey37")
    # fmt_reading keeps the provenance mark: an Intel card's used/total are inferred (~)
    text.append(
        f" {report.fmt_reading(used, as_bytes=True)} / {report.fmt_reading(total, as_bytes=True)}"
        f" used ({frac * 100:.0f}%)"
    )
    return text


def gpu_text(snapshot: Snapshot | None, adapter: Adapter | None) -> Text:
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
    n = len(snapshot.adapters)
    out = Text()
    out.append(f"GPU {adapter.index}", style="bold")
    out.append(f" of {n}  {adapter.name or 'n/a'}  {adapter.pci_bus_id}", style="bold")
    if snapshot.driver_version:
        out.append(f"  driver {snapshot.driver_version}")
    m = snapshot.metrics.get(adapter.pci_bus_id)
    if m is None:
        out.append("\nmetrics n/a")
        return out
    out.append("\n")
    out.append_text(memory_bar(m.memory_used_bytes, m.memory_total_bytes))
    out.append(f"  reserved {report.fmt_reading(m.memory_reserved_bytes, as_bytes=True)}")
    out.append("\n" + engines_line(m))
    att = snapshot.attributed_on(adapter.pci_bus_id)
    complete = snapshot.attributed_complete_on(adapter.pci_bus_id)
    out.append(
        f"\nattributed to processes (measured only) {report.fmt_bytes(att)}"
        + ("" if complete else "  · lower bound: some memory hidden or a list failed")
    )
    gtt = snapshot.extra_metrics.get(adapter.pci_bus_id)
    if gtt:
        out.append("\n" + report.gtt_text(gtt))
    for pr in snapshot.problems:
        if pr.adapter == adapter.pci_bus_id:
            detail = f": {pr.detail}" if pr.detail else ""
            out.append(f"\n{pr.where} {pr.reason}{detail}", style="yellow")
    for note in notes_for(snapshot, adapter):
        out.append(f"\nnote: {note}", style="italic")
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
    f = report.fmt_reading
    return (
        f"gpu {f(m.util_gpu_percent, '%')}  mem {f(m.util_memory_percent, '%')}"
        f"  enc {f(m.encoder_percent, '%')}  dec {f(m.decoder_percent, '%')}"
        f"  temp {f(m.temperature_c, ' C')}  power {f(m.power_w, ' W')}"
        f" / {f(m.power_limit_w, ' W')}  clock {f(m.clock_graphics_mhz, ' MHz')}"
    )


class GpuHeader(Static):
    """Shows one adapter of the latest snapshot; `show()` re-renders it."""

    DEFAULT_CSS = """
    GpuHeader { height: auto; padding: 0 1; border-bottom: solid $primary-darken-2; }
    """

    def show(self, snapshot: Snapshot | None, adapter: Adapter | None) -> None:
        self.update(gpu_text(snapshot, adapter))
