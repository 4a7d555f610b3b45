"""The confirmation before a signal: which process, and TERM (the default), INT or KILL."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from gputaskman.base.readings import ProcGpu
from gputaskman.tui.signalling import CHOICES

HINTS = {
    "TERM": "ask it to exit (it may clean up)",
    "INT": "as Ctrl-C would",
    "KILL": "end it at once (no clean-up; its GPU memory is freed by the driver)",
}


class SignalScreen(ModalScreen[str | None]):
    """Dismisses with the chosen signal's name, or None (esc: nothing is sent)."""

    DEFAULT_CSS = """
    SignalScreen { align: center middle; }
    SignalScreen > Vertical { width: 64; height: auto; border: thick $warning;
                              background: $surface; padding: 0 1; }
    SignalScreen OptionList { height: auto; }
    """
    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "cancel")]

    def __init__(self, row: ProcGpu) -> None:
        super().__init__()
        self.row = row

    def compose(self) -> ComposeResult:
        with Vertical():
            # Text: the process name comes from outside and is never markup
            yield Static(Text(f"Signal {self.row.name or 'process'} (PID {self.row.pid})?"))
            yield OptionList(
                *(Option(f"{name:<5} {HINTS[name]}", id=name) for name, _ in CHOICES),
                id="signals",
            )
            yield Static("enter: send · esc: cancel", classes="hint")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = 0  # TERM
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
