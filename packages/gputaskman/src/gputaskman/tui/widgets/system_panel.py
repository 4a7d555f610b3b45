"""The system panel: RAM, swap devices and CPU as the OS reports them (never GPU bytes); on a
short terminal (`compact`) in one run of text."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from gputaskman.render import text_report
from gputaskman.sampling.host import HostSample
from gputaskman.tui.widgets.unchanged import update_static


class SystemPanel(Static):
    DEFAULT_CSS = """
    SystemPanel { height: auto; padding: 0 1; border-top: solid $primary-darken-2; }
    """

    def show(self, system: HostSample | None, compact: bool = False) -> None:
        lines = text_report.system_lines(system)
        # Text: swap device paths and the like come from the OS, never Rich markup
        label = "SYSTEM (OS-reported, not GPU)" if self.app.size.width >= 100 else "SYSTEM"
        if compact:  # one run of text: the aligned columns of the full panel would waste rows
            update_static(
                self, Text(f"{label}: " + " · ".join(" ".join(ln.split()) for ln in lines))
            )
        else:
            update_static(self, Text(label + "\n" + "\n".join(lines)))
