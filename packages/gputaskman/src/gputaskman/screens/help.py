"""The help screen: every key of the app (generated from its bindings, so never stale)
and what the markers in the table mean."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

MARKERS = """\
Provenance markers
  1.2 GiB    measured by the driver (NVML); only these are summed
  ~1.2 GiB   inferred (derived; shown and sorted, never summed)
  ≈1.2 GiB   estimated (computed from a model, e.g. GGUF sizes)
  ʳ1.2 GiB   reported by a runtime (log or local API)
  n/a        unknown, with the reason in the inspector; never 0
  category?  only names support the category (heuristic)
  …          runtimes not scanned yet (scans are budgeted per refresh)"""


def key_lines(bindings: list[Binding]) -> list[str]:
    lines = []
    for b in bindings:
        keys = ", ".join(k.strip() for k in b.key.split(","))
        lines.append(f"  {keys:<14} {b.description}")
    return lines


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q,question_mark", "app.pop_screen", "close help"),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 78; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 1 2;
    }
    """

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self._key_list = bindings

    def compose(self) -> ComposeResult:
        text = "\n".join(
            [
                "gputaskman keys",
                *key_lines(self._key_list),
                "",
                MARKERS,
                "",
                "escape, q or ? closes this help",
            ]
        )
        with VerticalScroll():
            yield Static(text, id="help-text", markup=False)
