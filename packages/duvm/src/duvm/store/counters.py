"""Counters, owned by the component that counts: one class per component, one reader interface.

Each component of a store (its reads, writes, trims, readahead, repair, encryption, the slab
table) owns one `Counters` subclass, a slotted dataclass of ints, and is the only code that
increments it. Status and metrics read them through `BlockStore.counters()`, which takes every
component's `snapshot()` and `merge`s them into one flat mapping. A name two components count
(the waits while no replica answers: reads and writes both wait) is summed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(slots=True)
class Counters:
    """Base of one component's counters: subclasses add `int` fields defaulting to 0."""

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def merge(*snapshots: Mapping[str, int]) -> dict[str, int]:
    """One flat mapping of several components' counters; a name in several is summed."""
    out: dict[str, int] = {}
    for snap in snapshots:
        for name, value in snap.items():
            out[name] = out.get(name, 0) + value
    return out
