"""The `/` filter line of the host view and of the fleet: hidden until opened, its text kept
when it closes (enter), emptied by `clear` (esc). Its owner narrows its rows on
`Input.Changed`, which also fires when `clear` empties it."""

from __future__ import annotations

from textual.widgets import Input


class FilterBox(Input):
    DEFAULT_CSS = """
    FilterBox, FilterBox:focus { height: 1; border: none; padding: 0 1; }
    FilterBox.-hidden { display: none; }
    """

    def __init__(self, placeholder: str, id: str) -> None:
        super().__init__(placeholder=placeholder, id=id)
        self.add_class("-hidden")

    def open(self) -> None:
        self.remove_class("-hidden")
        self.focus()

    def close(self) -> None:
        self.add_class("-hidden")

    def clear(self) -> None:
        """Close and forget the filter (an `Input.Changed` follows when it held text)."""
        self.close()
        self.value = ""
