"""The system panel: RAM, swap devices and CPU as the OS reports them (never GPU bytes)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from gputaskman.core import text_report
from gputaskman.core.host import HostSample


class SystemPanel(Static):
    DEFAULT_CSS = """
    SystemPanel { height: auto; padding: 0 1; border-top: solid $primary-darken-2; }
    """

    def show(self, system: HostSample | None) -> None:
        lines = text_report.system_lines(system)
        # Text: swap device paths and the like come from the OS, never Rich markup
        self.update(Text("SYSTEM (OS-reported, not GPU)\n" + "\n".join(lines)))
