"""`SlabTable` on its own: geometry, page state, checksums and replica sets, with no network
(RemoteStore's tests drive it through real memservers)."""

from __future__ import annotations

import os

import pytest
from crc32c import crc32c
from duvm.store.slab_table import SlabTable
from duvm.store.storage import DATA, EMPTY, LOST

PS = 4096


def table(pages: int = 10, slab_pages: int = 4) -> tuple[SlabTable, list[tuple[int, int]]]:
    t = SlabTable(pages, slab_pages, ["peer-a", "peer-b", "peer-c"])  # type: ignore[list-item]
    changes: list[tuple[int, int]] = []
    t.on_change = lambda first, count: changes.append((first, count))
    t.assign([[0, 1], [1, 2], [2, 0]])
    return t, changes


def test_geometry_cuts_at_slab_boundaries_with_a_short_last_slab() -> None:
    t, _ = table()
    assert t.nslabs == 3 and [t.slab_size(s) for s in range(3)] == [4, 4, 2]
    assert list(t.runs(2, 7)) == [(0, 2, 2), (1, 4, 4), (2, 8, 1)]
    assert t.slab_clients[1] == ("peer-b", "peer-c")


def test_every_change_of_page_state_tells_on_change_first() -> None:
    """Catches a state change that skips `on_change`: the readahead would keep a window of
    bytes that are no longer the pages' (rule 12 in AGENTS.md)."""
    t, changes = table()
    data = memoryview(os.urandom(3 * PS))
    t.mark_stored(1, 3, data, None)
    t.record(5, 1, [crc32c(bytes(PS))])
    t.mark_lost(2, 1)
    t.clear(3, 2)
    assert changes == [(1, 3), (5, 1), (2, 1), (3, 2)]
    assert list(t.state[:6]) == [EMPTY, DATA, LOST, EMPTY, EMPTY, DATA]
    assert t.counters.snapshot() == {"pages_lost": 1}
    assert t.crc[1] == crc32c(data[:PS]) and t.crc[5] == crc32c(bytes(PS))


def test_only_written_pages_become_lost() -> None:
    t, _ = table()
    t.mark_stored(0, 1, memoryview(bytes(PS)), None)
    t.mark_lost(0, 4)
    assert list(t.state[:4]) == [LOST, EMPTY, EMPTY, EMPTY] and t.counters.pages_lost == 1


def test_a_trim_frees_the_keys_of_pages_that_are_not_empty_by_slab() -> None:
    t, _ = table()
    t.state[0:10] = bytes([DATA, EMPTY, LOST, EMPTY, DATA, DATA, EMPTY, EMPTY, EMPTY, DATA])
    assert t.trimmed_slabs(0, 10) == {0: [0, 2], 1: [4, 5], 2: [9]}
    assert t.trimmed_slabs(6, 3) == {}


def test_bad_pages_judges_written_pages_only_and_spares_a_write_in_flight() -> None:
    t, _ = table()
    old = os.urandom(2 * PS)
    t.mark_stored(4, 2, memoryview(old), None)
    assert t.bad_pages(4, 2, memoryview(old)) == [] and t.pages_match(4, 2, memoryview(old))
    new = os.urandom(2 * PS)
    assert t.bad_pages(4, 2, memoryview(new)) == [4, 5]
    t.pending_writes[0] = (5, 1, memoryview(new[PS:]))  # page 5's new bytes are on their way
    assert t.bad_pages(4, 2, memoryview(new)) == [4]
    t.clear(5, 1)
    assert not t.pages_match(4, 2, memoryview(old))  # page 5 holds no data any more


def test_a_replica_set_change_is_reported_and_counted_per_peer() -> None:
    t, _ = table()
    saved: list[list[list[int]]] = []
    t.on_placement_change = lambda: saved.append([list(s) for s in t.sets])
    t.state[0:2] = bytes([DATA, DATA])
    t.state[9] = DATA
    assert t.pages_per_peer() == [3, 2, 1]
    t.set_replicas(0, [1])
    assert saved == [[[1], [1, 2], [2, 0]]] and t.slab_clients[0] == ("peer-b",)
    assert t.degraded_slabs(2) == [0] and t.pages_per_peer() == [1, 2, 1]


def test_persisted_tables_of_the_wrong_size_are_refused() -> None:
    with pytest.raises(ValueError, match="10 entries"):
        SlabTable(10, 4, ["a"], (bytearray(9), bytearray(40)))  # type: ignore[list-item]
