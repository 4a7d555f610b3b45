"""Formatting of readings shared by the JSON object, the text report and the TUI.

Theory of operation
-------------------
`reading_json` is the one place a `Reading` becomes the five-key JSON reading object;
`fmt_reading` the one place it becomes display text: the value with its provenance mark
(none for measured, ``~`` inferred, ``≈`` estimated, ``ʳ`` runtime-reported), or ``n/a``
(with the reason when asked). Unknown is never shown as 0. `report` re-exports all of these.
"""

from __future__ import annotations

from typing import Any

from gputaskman.base.readings import Kind, Reading


def reading_json(r: Reading | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "value": r.value,
        "kind": str(r.kind),
        "source": r.source,
        "reason": None if r.reason is None else str(r.reason),
        "detail": r.detail,
    }


# One-character provenance markers used in text and the TUI. Measured has none.
KIND_MARK: dict[Kind, str] = {
    Kind.MEASURED: "",
    Kind.INFERRED: "~",
    Kind.ESTIMATED: "≈",
    Kind.RUNTIME: "ʳ",
}
NA = "n/a"


def fmt_bytes(n: int | float | None) -> str:
    """Binary units, one decimal; None is n/a (never 0)."""
    if n is None:
        return NA
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_reading(
    r: Reading | None, unit: str = "", *, as_bytes: bool = False, reason: bool = False
) -> str:
    """A reading for display: value with its provenance marker, or n/a (plus the reason)."""
    if r is None or r.value is None:
        if reason and r is not None and r.reason is not None:
            return f"{NA} ({r.reason})"
        return NA
    mark = KIND_MARK[r.kind]
    if as_bytes:
        text = fmt_bytes(r.value)
    elif isinstance(r.value, float):
        text = f"{r.value:.1f}{unit}"
    else:
        text = f"{r.value}{unit}"
    return f"{mark}{text}"
