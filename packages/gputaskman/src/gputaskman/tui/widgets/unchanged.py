"""Skip the work of a `Static.update` that changes nothing on screen, or nothing of the
widget's size.

Every `update` lays the screen out again and redraws the whole screen; the TUI's panels are
refreshed each second and most seconds most of them show the same text, so an identical
update is left out (the widget keeps what it shows, nothing visible changes). An update of
a widget whose width is set and whose height is fixed, or follows its text and comes out as
before (as many lines, wrapped at that width), cannot change the widget's size: it only
redraws the widget."""

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
    """`widget.update(content)` unless `content` is what it already shows, and without a new
    layout of the screen when the widget's size cannot change (see the module docstring)."""
    if same_content(widget.content, content):
        return
    styles, size = widget.styles, widget.content_size
    fixed = (styles.width is None or not styles.width.is_auto) and size.width > 0
    widget.update(content, layout=not fixed)
    if fixed and (styles.height is None or styles.height.is_auto):
        # as tall as its text: a layout only when the new text takes another number of lines
        height = widget.get_content_height(widget.container_size, widget.app.size, size.width)
        if height != size.height:
            widget.refresh(layout=True)
