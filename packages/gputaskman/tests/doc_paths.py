"""Every place in a parsed JSON document, for tests that change one place at a time."""

from __future__ import annotations

from typing import Any


def json_paths(node: Any, at: tuple = ()) -> list[tuple]:
    """The path of every value in `node` (keys and list indices from the top), `()` first."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += json_paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += json_paths(v, (*at, i))
    return out
