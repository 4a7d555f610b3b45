"""Skip a `Static.update` whose content is the one already shown.

Every `update` lays the screen out again and redraws the widget; the TUI's panels are
refreshed each second and most seconds most of them show the same text, so an identical
update is left out (the widget keeps what it shows, nothing visible changes)."""

from __future__ import annotations

from rich.text import Text
from textual.visual import VisualType
from textual.widgets import Static


def same_content(a: VisualType, b: VisualType) -> bool:
    """Whether `a` and `b` render alike: equal strings, or Texts equal in their text, spans
    and every setting that changes how they render; anything else is never the same."""
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if isinstance(a, Text) and isinstance(b, Text):
        return (
            a.plain == b.plain
            and a.spans == b.spans
            and a.style == b.style
            and (a.justify, a.overflow, a.no_wrap, a.end, a.tab_size)
            == (b.justify, b.overflow, b.no_wrap, b.end, b.tab_size)
        )
    return False


def update_static(widget: Static, content: VisualType) -> None:
    """`widget.update(content)` unless `content` is what it already shows."""
    if not same_content(widget.content, content):
        widget.update(content)
