"""What a Textual app draws on a terminal, for pilot tests: a Textual driver that writes into a
grid of cells instead of a tty, and waits on what the grid shows.

A pilot's `pause()` runs the current screen's pending update itself, so a screen whose own
update timer no longer runs still looks drawn in `export_screenshot()` and in the widgets'
state. Here nothing is forced: the grid holds only what the app sent, as a terminal would.
The model reads what Textual writes: cursor moves (``ESC [ row ; col H``) and text; every
other escape sequence (colours, synchronized output, cursor shape) is skipped.

    term = Terminal(200, 60)
    app.driver_class = term.driver()
    async with app.run_test(size=(200, 60), headless=False) as pilot:
        await term.shows("HOST")
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from rich.cells import get_character_cell_size
from textual.driver import Driver
from textual.drivers.headless_driver import HeadlessDriver

# CSI sequences, two-byte escapes and OSC strings; only CSI ... H (cursor position) moves
_ESCAPE = re.compile(
    r"\x1b\[([0-9;?<>=]*)[ -/]*([@-~])"  # CSI: parameters, intermediates, final byte
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC, ended by BEL or ST
    r"|\x1b[()][0-9A-Za-z]|\x1b[=>78]"
)


class Terminal:
    """A `width` x `height` grid of cells, fed with what the app writes."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.cells = [[" "] * width for _ in range(height)]
        self.x = self.y = 0
        self.writes = 0

    def driver(self) -> type[Driver]:
        """A driver class for `App.driver_class` that writes into this grid (and reads no
        input: the pilot presses the keys)."""
        term = self

        class TerminalDriver(HeadlessDriver):
            @property
            def is_headless(self) -> bool:
                return False  # the app renders and writes its output

            def write(self, data: str) -> None:
                term.feed(data)

        return TerminalDriver

    def feed(self, data: str) -> None:
        self.writes += 1
        pos = 0
        for m in _ESCAPE.finditer(data):
            self._text(data[pos : m.start()])
            pos = m.end()
            if m.group(2) == "H":
                row, _, col = (m.group(1) or "").partition(";")
                self.y = int(row or 1) - 1
                self.x = int(col or 1) - 1
        self._text(data[pos:])

    def _text(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self.x, self.y = 0, self.y + 1
                continue
            if ch == "\r":
                self.x = 0
                continue
            width = get_character_cell_size(ch)
            if width == 0:
                continue
            if 0 <= self.y < self.height and 0 <= self.x < self.width:
                self.cells[self.y][self.x] = ch
                if width == 2 and self.x + 1 < self.width:
                    self.cells[self.y][self.x + 1] = ""
            self.x += width

    def lines(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.cells]

    def text(self) -> str:
        return "\n".join(self.lines())

    async def shows(self, *texts: str, timeout: float = 10.0) -> None:
        """Wait until every one of `texts` is on the screen; fail with the screen if not."""
        await self._until(lambda s: all(t in s for t in texts), f"shows {texts}", timeout)

    async def lacks(self, *texts: str, timeout: float = 10.0) -> None:
        """Wait until none of `texts` is on the screen; fail with the screen if not."""
        await self._until(lambda s: not any(t in s for t in texts), f"lacks {texts}", timeout)

    async def _until(self, cond: Callable[[str], bool], what: str, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not cond(self.text()):
            if loop.time() > end:
                raise AssertionError(f"the terminal never {what}; it shows:\n{self.text()}")
            await asyncio.sleep(0.02)  # the app's own timers run meanwhile
