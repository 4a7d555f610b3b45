"""`SlabTable` on its own: geometry, page state, checksums and replica sets, with no network
(RemoteStore's tests drive it through real memservers). Every test runs against the reference
(`duvm.store.slab_table`) and its compiled twin (`duvm.store._slabtable`), and a differential
test drives both with the same operations, drawn by Hypothesis, over in-memory and persisted
page tables. Without the compiled module its runs skip, except where DUVM_REQUIRE_COMPILED=1
(CI) makes that a failure."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest
from crc32c import crc32c
from duvm.base import accel
from duvm.store import slab_table
from duvm.store.state_files import PageTables
from duvm.store.storage import DATA, EMPTY, LOST
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
BUILT = accel.state("duvm.store._slabtable")
compiled = importlib.import_module("duvm.store._slabtable") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
TYPES = [
    pytest.param(slab_table.SlabTable, id="reference"),
    pytest.param(
        compiled.SlabTable if compiled else None,
        id="compiled",
        marks=pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}"),
    ),
]


@pytest.fixture(params=TYPES)
def SlabTable(request: pytest.FixtureRequest) -> Any:  # stands in for the class
    return request.param


def table(
    SlabTable: Any, pages: int = 10, slab_pages: int = 4
) -> tuple[Any, list[tuple[int, int]]]:
    t = SlabTable(pages, slab_pages, ["peer-a", "peer-b", "peer-c"])
    changes: list[tuple[int, int]] = []
    t.on_change = lambda first, count: changes.append((first, count))
    t.assign([[0, 1], [1, 2], [2, 0]])
    return t, changes


def test_geometry_cuts_at_slab_boundaries_with_a_short_last_slab(SlabTable: Any) -> None:
    t, _ = table(SlabTable)
    assert t.nslabs == 3 and [t.slab_size(s) for s in range(3)] == [4, 4, 2]
    assert list(t.runs(2, 7)) == [(0, 2, 2), (1, 4, 4), (2, 8, 1)]
    assert t.slab_clients[1] == ("peer-b", "peer-c")


def test_every_change_of_page_state_tells_on_change_first(SlabTable: Any) -> None:
    """Catches a state change that skips `on_change`: the readahead would keep a window of
    bytes that are no longer the pages' (rule 12 in AGENTS.md)."""
    t, changes = table(SlabTable)
    data = memoryview(os.urandom(3 * PS))
    t.mark_stored(1, 3, data, None)
    t.record(5, 1, [crc32c(bytes(PS))])
    t.mark_lost(2, 1)
    t.clear(3, 2)
    assert changes == [(1, 3), (5, 1), (2, 1), (3, 2)]
    assert list(t.state[:6]) == [EMPTY, DATA, LOST, EMPTY, EMPTY, DATA]
    assert t.counters.snapshot() == {"pages_lost": 1}
    assert t.crc[1] == crc32c(data[:PS]) and t.crc[5] == crc32c(bytes(PS))


def test_only_written_pages_become_lost(SlabTable: Any) -> None:
    t, _ = table(SlabTable)
    t.mark_stored(0, 1, memoryview(bytes(PS)), None)
    t.mark_lost(0, 4)
    assert list(t.state[:4]) == [LOST, EMPTY, EMPTY, EMPTY] and t.counters.pages_lost == 1


def test_a_failed_write_loses_every_page_and_one_in_doubt_counts_none(SlabTable: Any) -> None:
    """Catches `write_failed` not counting the pages it loses (the pages_lost line gone), or
    losing only the pages written before (a never-written page the write may have reached
    would read zeros); and a write in doubt counted as lost."""
    t, changes = table(SlabTable)
    t.mark_stored(1, 1, memoryview(bytes(PS)), None)
    t.mark_in_doubt(0, 3)
    assert list(t.state[:4]) == [LOST, LOST, LOST, EMPTY] and t.counters.pages_lost == 0
    t.record(0, 1, [crc32c(bytes(PS))])  # the general path stored it after all
    t.write_failed(1, 3)
    assert list(t.state[:5]) == [DATA, LOST, LOST, LOST, EMPTY] and t.counters.pages_lost == 3
    assert changes == [(1, 1), (0, 3), (0, 1), (1, 3)]


def test_a_write_under_a_trim_in_flight_leaves_its_pages_trimmed(SlabTable: Any) -> None:
    """Catches `mark_stored` (or `record`) marking written a page that a trim in flight is
    freeing (its `keep_trimmed` call gone): the trim's FREE may reach a memserver after the
    write's STORE."""
    t, changes = table(SlabTable)
    t.mark_stored(2, 4, memoryview(os.urandom(4 * PS)), None)
    token = t.trim_started(3, 2)
    assert list(t.state[2:6]) == [DATA, EMPTY, EMPTY, DATA] and changes[-1] == (3, 2)
    t.mark_stored(1, 6, memoryview(os.urandom(6 * PS)), None)
    t.record(4, 1, [0])
    t.mark_stored(3, 1, memoryview(os.urandom(PS)), None)
    assert list(t.state[:8]) == [EMPTY, DATA, DATA, EMPTY, EMPTY, DATA, DATA, EMPTY]
    t.trim_ended(token)
    assert not t.trims
    t.mark_stored(3, 1, memoryview(os.urandom(PS)), None)
    assert t.state[3] == DATA


def test_a_trim_frees_the_keys_of_pages_that_are_not_empty_by_slab(SlabTable: Any) -> None:
    t, _ = table(SlabTable)
    t.state[0:10] = bytes([DATA, EMPTY, LOST, EMPTY, DATA, DATA, EMPTY, EMPTY, EMPTY, DATA])
    assert t.trimmed_slabs(0, 10) == {0: [0, 2], 1: [4, 5], 2: [9]}
    assert t.trimmed_slabs(6, 3) == {}


def test_bad_pages_judges_written_pages_only_and_spares_a_write_in_flight(SlabTable: Any) -> None:
    t, _ = table(SlabTable)
    old = os.urandom(2 * PS)
    t.mark_stored(4, 2, memoryview(old), None)
    assert t.bad_pages(4, 2, memoryview(old)) == [] and t.pages_match(4, 2, memoryview(old))
    new = os.urandom(2 * PS)
    assert t.bad_pages(4, 2, memoryview(new)) == [4, 5]
    t.pending_writes[0] = (5, 1, memoryview(new[PS:]))  # page 5's new bytes are on their way
    assert t.bad_pages(4, 2, memoryview(new)) == [4]
    t.clear(5, 1)
    assert not t.pages_match(4, 2, memoryview(old))  # page 5 holds no data any more


def test_a_replica_set_change_is_reported_and_counted_per_peer(SlabTable: Any) -> None:
    t, _ = table(SlabTable)
    saved: list[list[list[int]]] = []
    t.on_placement_change = lambda: saved.append([list(s) for s in t.sets])
    t.state[0:2] = bytes([DATA, DATA])
    t.state[9] = DATA
    assert t.pages_per_peer() == [3, 2, 1]
    t.set_replicas(0, [1])
    assert saved == [[[1], [1, 2], [2, 0]]] and t.slab_clients[0] == ("peer-b",)
    assert t.degraded_slabs(2) == [0] and t.pages_per_peer() == [1, 2, 1]


def test_persisted_tables_of_the_wrong_size_are_refused(SlabTable: Any) -> None:
    with pytest.raises(ValueError, match="10 entries"):
        SlabTable(10, 4, ["a"], (bytearray(9), bytearray(40)))


# --- differential: the compiled twin against the reference ---------------------------------

PAGES, SLAB = 24, 5
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                *("store", "store", "record", "lost", "clear", "forget", "start", "end"),
                *("bad", "bad", "match", "trim", "replicas", "per_peer"),
                *("doubt", "failed", "trim_start", "trim_start", "trim_end"),
            ]
        ),
        st.integers(0, PAGES - 1),
        st.integers(1, 7),
        st.integers(0, 255),
    ),
    max_size=40,
)


def _drive(tx: Any, ops: list, tables: Any) -> list:
    log: list = []
    t = tx(PAGES, SLAB, ["a", "b", "c"], tables)
    t.on_change = lambda first, count: log.append(("changed", first, count))
    t.on_placement_change = lambda: log.append(("placement", [list(x) for x in t.sets]))
    t.assign([[i % 3, (i + 1) % 3] for i in range(t.nslabs)])
    tokens: list[int] = []
    trims: list[int] = []
    written: dict[int, bytes] = {}
    for op, first, count, b in ops:
        count = min(count, PAGES - first)
        data = memoryview(bytes([b]) * (count * PS))
        if op == "store":
            t.mark_stored(first, count, data, None if b % 2 else slab_table.page_crcs(data, count))
            for p in range(first, first + count):
                written[p] = bytes([b])
        elif op == "record":
            t.record(first, count, [crc32c(bytes([b]) * PS)] * count)
        elif op == "lost":
            t.mark_lost(first, count)
        elif op == "clear":
            t.clear(first, count)
        elif op == "forget":
            t.forget()
        elif op == "start":
            tokens.append(t.write_started(first, count, data))
            log.append(("token", tokens[-1]))
        elif op == "end" and tokens:
            t.write_ended(tokens.pop(b % len(tokens)))
        elif op in ("bad", "match"):
            # what a LOAD brought back: the bytes written, one page of them replaced
            got = bytearray(
                b"".join(written.get(p, b"\0") * PS for p in range(first, first + count))
            )
            k = b % (count + 1)
            if k < count:
                got[k * PS : (k + 1) * PS] = bytes([b ^ 0x5A]) * PS
            if op == "bad":
                log.append(("bad", t.bad_pages(first, count, memoryview(got))))
            else:
                log.append(("match", t.pages_match(first, count, memoryview(got))))
        elif op == "trim":
            log.append(("trim", t.trimmed_slabs(first, count)))
        elif op == "replicas":
            t.set_replicas(first % t.nslabs, [b % 3] if b % 2 else [])
            log.append(("degraded", t.degraded_slabs(2)))
        elif op == "per_peer":
            log.append(("per_peer", t.pages_per_peer()))
        elif op == "doubt":
            t.mark_in_doubt(first, count)
        elif op == "failed":
            t.write_failed(first, count)
        elif op == "trim_start":
            trims.append(t.trim_started(first, count))
            log.append(("trim token", trims[-1]))
        elif op == "trim_end" and trims:
            t.trim_ended(trims.pop(b % len(trims)))
        log.append(
            (op, bytes(t.state), list(t.crc), t.counters.snapshot(), sorted(t.pending_writes))
        )
        log.append(("trims", sorted(t.trims.items())))
    log.append(
        ("geometry", t.pages, t.slab_pages, t.nslabs, [t.slab_size(s) for s in range(t.nslabs)])
    )
    log.append(("runs", list(t.runs(3, 17)), list(t.inflight), t.slab_clients))
    return log


@pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")
@settings(
    max_examples=int(os.environ.get("DUVM_DIFF_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=OPS, persisted=st.booleans())
def test_compiled_table_matches_the_reference(ops: list, persisted: bool, tmp_path: Path) -> None:
    runs = []
    for n, tx in enumerate((slab_table.SlabTable, compiled.SlabTable)):  # type: ignore[union-attr]
        tables = None
        if persisted:  # the daemon's mapped tables (state_files.PageTables)
            path = tmp_path / f"pages-{n}.bin"
            path.unlink(missing_ok=True)
            pt = PageTables(path, PAGES, False, create=True)
            tables = (pt.state, pt.crc)
        runs.append(_drive(tx, ops, tables))
        if persisted:
            pt.close()
    assert runs[1] == runs[0]
