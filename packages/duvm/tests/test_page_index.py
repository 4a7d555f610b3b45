"""The memserver's page index (duvm.memserver.pageindex) and its compiled twin: the same
answers as a dict for every sequence of operations, and no memory taken while pages arrive.

Without the compiled module the compiled half skips, except where DUVM_REQUIRE_COMPILED=1
(CI) makes that a failure.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest
from duvm.base import accel, pressure
from duvm.memserver.pageindex import EMPTY, IndexFull, PageIndex, buckets_for
from duvm.memserver.pagestore import PageStore
from hypothesis import given, settings
from hypothesis import strategies as st

BUILT = accel.state("duvm.memserver._hotloop")
if BUILT != "compiled" and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")


def _compiled() -> type:
    if BUILT != "compiled":
        pytest.skip(f"compiled path: {BUILT}")
    from duvm.memserver import _hotloop

    return _hotloop.PageIndex


@pytest.fixture(params=["reference", "compiled"])
def index_type(request: pytest.FixtureRequest) -> type:
    return PageIndex if request.param == "reference" else _compiled()


# few buckets and keys that share them, so probe runs wrap around the table's end and removals
# must shift entries back; and the ends of the key range
KEY = st.integers(0, 40) | st.sampled_from([2**64 - 1, 2**63, 2**40 + 3])
OP = st.one_of(
    st.tuples(st.just("set"), KEY, st.integers(0, 1000)),
    st.tuples(st.just("pop"), KEY, st.just(0)),
    st.tuples(st.just("del"), KEY, st.just(0)),
    st.tuples(st.just("resize"), st.just(0), st.integers(0, 24)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("run"), KEY, st.integers(1, 5)),
)


def _apply(idx, model: dict, cap: list[int], op: tuple) -> object:
    """Apply `op` to the index, and what it must do to `model` (a dict held to `cap[0]`
    entries); the outcome, for comparison."""
    kind, key, arg = op
    try:
        if kind == "set":
            if key not in model and len(model) >= cap[0]:
                with pytest.raises(IndexFull):
                    idx[key] = arg
                return "full"
            idx[key] = model[key] = arg
        elif kind == "pop":
            return idx.pop(key, None), model.pop(key, None)
        elif kind == "del":
            if key not in model:
                with pytest.raises(KeyError):
                    del idx[key]
                return "missing"
            del idx[key]
            del model[key]
        elif kind == "resize":
            if arg < len(model):
                with pytest.raises(ValueError):
                    idx.resize(arg)
                return "too small"
            idx.resize(arg)
            cap[0] = arg
        elif kind == "clear":
            idx.clear()
            model.clear()
        else:
            key = min(key, 2**64 - 1 - arg)
            new = sum(key + i not in model for i in range(arg))
            if len(model) + new > cap[0]:
                with pytest.raises(IndexFull):
                    idx.insert_run(key, 7, arg)
                for i in range(arg):  # what went in before the first key with no room stays
                    if key + i not in model and len(model) >= cap[0]:
                        break
                    model[key + i] = 7 + i
                return "full"
            idx.insert_run(key, 7, arg)
            model.update({key + i: 7 + i for i in range(arg)})
    finally:
        assert dict(idx.items()) == model, op
    return None


@settings(max_examples=300)
@given(ops=st.lists(OP, min_size=1, max_size=60), cap=st.integers(0, 12))
def test_every_operation_answers_as_a_dict_does(ops: list, cap: int) -> None:
    """Catches a probe that stops early (a key found by a dict but not by the index), a
    removal that leaves a gap in a probe run or moves an entry before its home bucket (later
    lookups miss it), a rehash on resize that drops an entry, an insert beyond the capacity,
    and a compiled twin that differs from the reference in any of these."""
    kinds = [PageIndex] + ([_compiled()] if BUILT == "compiled" else [])
    for kind in kinds:
        idx, model, c = kind(cap), {}, [cap]
        for op in ops:
            _apply(idx, model, c, op)
            assert len(idx) == len(model)
            for k in [*range(41), 2**64 - 1, 2**63, 2**40 + 3]:
                assert idx.get(k) == model.get(k)
                assert (k in idx) == (k in model)
        assert sorted(idx) == sorted(model) and sorted(idx.values()) == sorted(model.values())
        assert idx == model


def test_the_table_is_sized_once_with_the_capacity(index_type: type) -> None:
    """Catches a table that grows with what it holds (the dict's doubling, made while pages
    arrive), one too full for short probes (more than two-thirds), and one rounded up to a
    power of two (up to twice the memory, all of it taken when a device is enabled)."""
    idx = index_type(1000)
    size = buckets_for(1000)
    assert size == 1500 and idx.nbytes == size * 12
    for k in range(1000):
        idx[k * 7919] = k
    assert (len(idx), idx.nbytes) == (1000, size * 12)
    with pytest.raises(IndexFull):
        idx[1] = 1
    for k in range(0, 1000, 2):
        del idx[k * 7919]
    for k in range(500):
        idx[2**50 + k] = k  # come and go as often as they like: the table stays as it was
    assert (len(idx), idx.nbytes) == (1000, size * 12)
    assert all(c * 1.5 <= buckets_for(c) <= max(8, c * 1.5 + 1) for c in range(1, 5000))
    assert index_type(0).nbytes == 0 and index_type(0).get(5) is None


def test_out_of_range_keys_and_slots_are_refused(index_type: type) -> None:
    """Catches a key or slot silently truncated to its C width (another page's entry)."""
    idx = index_type(4)
    for key, slot in ((-1, 0), (2**64, 0), (0, EMPTY), (0, -1)):
        with pytest.raises(ValueError):
            idx[key] = slot
    assert len(idx) == 0 and idx.get(-1) is None and 2**64 not in idx


@pytest.mark.parametrize("batch", [1, 64])
def test_storing_within_a_reservation_allocates_nothing_that_stays(
    index_type: type, batch: int
) -> None:
    """Catches a page index that allocates per page held (the dict this replaced grew about
    104 bytes per page, faulted in while the node it serves swaps), on the page store's own
    STORE path (one page and a batch), with FREEs and new STOREs after them."""
    n = 8192
    store = PageStore(n + 64, lease_s=60, lock=False, index_type=index_type)
    try:
        ns, _ = store.attach("a")
        store.reserve(ns, n)
        page = bytes(range(256)) * 16
        data = memoryview(page * batch)

        def fill(first: int) -> None:
            for k in range(first, first + n, batch):
                store.store(ns, tuple(range(k, k + batch)), data)

        fill(0)
        store.free(ns, tuple(range(0, n, 2)))
        store.free(ns, tuple(range(1, n, 2)))
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            fill(1 << 40)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(ns.pages) == n and store.arena.used_slots == n
        assert grown < 16 << 10, f"{grown} bytes stayed after storing {n} pages"
        assert bytes(store.load(ns, (1 << 40,))) == page
    finally:
        store.close()


def test_a_probe_run_that_wraps_around_the_table_survives_removals(index_type: type) -> None:
    """Catches a backward shift that ignores the wrap from the last bucket to the first: an
    entry whose run wrapped is then left past a gap and never found again (or moved before
    its home bucket)."""
    idx = index_type(8)  # 12 buckets
    size = buckets_for(8)

    def home(k: int) -> int:
        return (((k * 0x9E3779B97F4A7C15) & (2**64 - 1)) * size) >> 64

    a, b = [k for k in range(10_000) if home(k) == size - 1][:2]
    c, d = [k for k in range(10_000) if home(k) == 0][:2]
    for slot, k in enumerate((a, c, d, b)):  # buckets 11, 0 and 1 (homes 11, 0, 0), then 2
        idx[k] = slot
    del idx[a]  # c and d are at (or after) their home: they stay; b moves back to 11
    assert (a in idx, idx.get(c), idx.get(d), idx.get(b), len(idx)) == (False, 1, 2, 3, 3)
    del idx[c]
    assert (idx.get(d), idx.get(b), len(idx)) == (2, 3, 2)


def test_the_table_is_resident_once_sized(index_type: type) -> None:
    """Catches a table left untouched when sized (a malloc and a memset of zeros the compiler
    makes one calloc, so fresh pages are faulted in only when pages arrive, 16 bytes per page
    held in the measured run): its memory must be resident when `resize` returns."""
    rss = pressure.rss_kib(field="RssAnon")
    if rss is None:
        pytest.skip("no /proc/self/status RssAnon here")
    idx = index_type(1 << 20)
    grown = (pressure.rss_kib(field="RssAnon") or 0) - rss
    assert idx.nbytes == 18 << 20
    assert grown >= (idx.nbytes >> 10) * 0.9, f"{grown} KiB resident of {idx.nbytes >> 10}"
    del idx
