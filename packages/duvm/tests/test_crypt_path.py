"""The encrypting filter's compiled fast path (`duvm.store._cryptpath.CryptFastPath`) against
the reference (`duvm.store.crypt_store.CryptFastPath`): differential.

Two `CryptStore`s with the same key, one on each path, each over its own scripted store below,
get the same requests drawn by Hypothesis: writes and reads of any pages (some outside the
export), with the store below declining, answering at once or later, failing, handing over
its own bytes, continuing on its coroutine path, or returning bytes that fail their tag.
Every return value, every completion (its outcome, and what a continuation does when run),
every byte read, the ciphertext the store below holds, the nonce/tag table and the counters
must be the same. Without the compiled module these tests skip, except where
DUVM_REQUIRE_COMPILED=1 (CI) makes that a failure.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import os
from typing import Any

import pytest
from duvm.base import accel
from duvm.store import crypt_store
from duvm.store.crypt_store import CryptStore
from duvm.store.storage import BlockStore, Done, StorageError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
PAGES = 16
KEY = bytes(range(32))
BUILT = accel.state("duvm.store._cryptpath")
compiled = importlib.import_module("duvm.store._cryptpath") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")


class _Below(BlockStore):
    """A store in RAM whose fast path does what the test says next (`how`)."""

    fast_path = True

    def __init__(self) -> None:
        self.size = PAGES * PS
        self.data = bytearray(self.size)
        self.how = "now"
        self.later: list = []

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        how = self.how
        if how == "decline":
            return False
        if how == "fail":
            done(tag, StorageError(errno.EIO, "below failed"))
        elif how == "continue":
            done(tag, self.write(offset, data))
        else:
            self.data[offset : offset + len(data)] = data
            if how == "later":
                self.later.append(lambda: done(tag, None))
            else:
                done(tag, None)
        return True

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        how, n = self.how, len(out)
        if how == "decline":
            return False
        if how == "fail":
            done(tag, StorageError(errno.EIO, "below failed"))
        elif how == "continue":
            done(tag, self.read(offset, out))
        elif how == "own":
            done(tag, memoryview(bytes(self.data[offset : offset + n])))
        elif how == "corrupt":
            out[:] = self.data[offset : offset + n]
            out[n - 1] ^= 1
            done(tag, None)
        else:
            out[:] = self.data[offset : offset + n]
            if how == "later":
                self.later.append(lambda: done(tag, None))
            else:
                done(tag, None)
        return True

    async def read(self, offset: int, out: memoryview) -> None:
        out[:] = self.data[offset : offset + len(out)]

    async def write(self, offset: int, data: memoryview) -> None:
        self.data[offset : offset + len(data)] = data

    async def trim(self, offset: int, length: int) -> None:
        self.data[offset : offset + length] = bytes(length)

    async def flush(self) -> None:
        pass

    async def close(self) -> None:
        pass


WRITE_HOW = st.sampled_from(["now", "now", "now", "later", "decline", "fail", "continue"])
READ_HOW = st.sampled_from(
    ["now", "now", "now", "later", "decline", "fail", "continue", "own", "corrupt"]
)


@st.composite
def requests(draw: st.DrawFn) -> list[tuple]:
    out = [("write", 0, 12, 0x5A, "now")]  # most pages written: most reads are taken
    for _ in range(draw(st.integers(1, 12))):
        first = draw(st.integers(0, PAGES + 1))
        count = draw(st.sampled_from([1, 1, 2, 3]))
        if draw(st.booleans()):
            out.append(("write", first, count, draw(st.integers(0, 255)), draw(WRITE_HOW)))
        else:
            out.append(("read", first, count, 0, draw(READ_HOW)))
    return out


def _outcome(x: object) -> object:
    if x is None or isinstance(x, BaseException):
        return x if x is None else (type(x).__name__, str(x))
    return "continues"


async def _run(store: CryptStore, below: _Below, reqs: list[tuple]) -> list:
    log: list = []
    start_read, start_write = store.fast_entries()
    for i, (op, first, count, fill, how) in enumerate(reqs):
        below.how = how
        outcomes: list = []

        def done(tag: object, cont: object, outcomes: list = outcomes) -> None:
            outcomes.append((tag, cont))

        buf = bytearray([fill]) * (count * PS) if op == "write" else bytearray(b"\xee" * count * PS)
        try:
            start = start_write if op == "write" else start_read
            taken: object = start(first * PS, memoryview(buf), done, i)
        except Exception as e:
            taken = (type(e).__name__, str(e))
        for f in below.later:
            f()
        below.later.clear()
        results = []
        for tag, cont in outcomes:
            results.append((tag, _outcome(cont)))
            if _outcome(cont) == "continues":
                try:
                    await cont  # type: ignore[misc]
                    results.append("continued")
                except Exception as e:
                    results.append(("continued", type(e).__name__, str(e)))
        log.append((op, taken, results, bytes(buf)))
    log.append(("below", bytes(below.data)))
    log.append(("table", bytes(store._meta)))
    log.append(("counters", store.counters()))
    return log


class _Reserving(CryptStore):
    """A store whose nonce hook does something (as PersistentCryptStore's stores the counter):
    it records each call with the counter the cipher stood at, which must be before the seal."""

    def __init__(self, inner: BlockStore, key: bytes) -> None:
        super().__init__(inner, key=key)
        self.reserved: list[tuple[int, int]] = []

    def reserve_nonces(self, n: int) -> None:
        self.reserved.append((n, self.cipher.counter))

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "reserved": self.reserved}  # type: ignore[dict-item]


def _store(pure: bool, cls: type[CryptStore] = CryptStore) -> tuple[CryptStore, _Below]:
    below = _Below()
    old = os.environ.get(accel.ENV)
    os.environ[accel.ENV] = "1" if pure else "0"
    try:
        store = cls(below, key=KEY)
    finally:
        if old is None:
            del os.environ[accel.ENV]
        else:
            os.environ[accel.ENV] = old
    return store, below


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.sampled_from([CryptStore, _Reserving]))
def test_the_compiled_crypt_path_does_what_the_reference_does(
    reqs: list[tuple], cls: type[CryptStore]
) -> None:
    """Also with a nonce hook that does something: called with the same counts, before each
    seal, on both paths (the compiled one skips only the base class's, which does nothing)."""
    ref, ref_below = _store(pure=True, cls=cls)
    fast, fast_below = _store(pure=False, cls=cls)
    assert type(ref.fast) is crypt_store.CryptFastPath
    assert type(fast.fast) is compiled.CryptFastPath
    assert asyncio.run(_run(fast, fast_below, reqs)) == asyncio.run(_run(ref, ref_below, reqs))


def test_both_paths_seal_what_they_are_given_and_read_it_back() -> None:
    """The common write and read themselves, on each path, so a rule broken on both alike
    still fails: the store below holds ciphertext, the table commits after its answer, the
    read opens it, and bytes that fail their tag are never handed back."""
    for pure in (True, False):
        store, below = _store(pure)
        reqs = [
            ("write", 2, 2, 0x41, "later"),
            ("read", 2, 2, 0, "now"),
            ("read", 5, 1, 0, "now"),  # never written: declined, the coroutine path gives zeros
            ("read", 2, 1, 0, "corrupt"),
        ]
        log = asyncio.run(_run(store, below, reqs))
        (_, w_taken, w_res, _), (_, r_taken, r_res, r_buf) = log[0], log[1]
        assert w_taken is True and w_res == [(0, None)]
        assert below.data[2 * PS : 4 * PS] != b"\x41" * (2 * PS)  # ciphertext below
        assert r_taken is True and r_res == [(1, None)] and r_buf == b"\x41" * (2 * PS)
        assert log[2][1] is False and log[2][2] == []
        _, c_taken, c_res, c_buf = log[3]
        assert c_taken is True and c_res[0][1][0] == "StorageError"
        assert c_buf == bytes(PS)  # zeroed, never the unauthenticated bytes
        counters = log[-1][1]
        assert counters["pages_sealed"] == 2 and counters["pages_opened"] == 2
        assert counters["tag_failures"] == 1


def test_a_store_takes_the_chosen_path() -> None:
    assert type(_store(pure=True)[0].fast) is crypt_store.CryptFastPath
    assert type(_store(pure=False)[0].fast) is compiled.CryptFastPath


def test_a_write_outside_the_export_never_touches_the_table() -> None:
    """The compiled twin indexes the nonce/tag table without bounds checks: a request past
    the end (which the NBD layer never sends) must be refused, on both paths alike."""
    for pure in (True, False):
        store, _below = _store(pure)
        start_read, start_write = store.fast_entries()
        done_calls: list[Any] = []
        for start in (start_write, start_read):
            with pytest.raises(ValueError, match="outside the export"):
                start((PAGES - 1) * PS, memoryview(bytearray(2 * PS)), done_calls.append, 0)
        assert done_calls == [] and bytes(store._meta) == bytes(PAGES * 28)


async def test_a_persistent_store_closes_while_a_connection_holds_its_fast_path(
    tmp_path,
) -> None:
    """An NBD connection keeps the fast path's callables (`fast_entries`) until it is gone. The
    compiled path held a typed view of the table's memoryview, so closing the store failed
    with "memoryview has 1 exported buffer" (PersistentCryptStore releases that view)."""
    from duvm.store import daemon_state as ds
    from duvm.store.memory_store import MemoryStore

    tables = ds.PageTables.create(tmp_path / "pages.bin", PAGES, encrypted=True)
    store = ds.PersistentCryptStore(MemoryStore(PAGES * PS), KEY, tables)
    held = store.fast_entries()  # as a connection holds them
    await store.close()
    tables.close()
    assert callable(held[0]) and store.fast is None


def test_the_nonce_hook_is_skipped_only_where_it_does_nothing() -> None:
    """`nonce_hook` is what the compiled path calls before each seal: None only for the base
    class's own `reserve_nonces`; any override runs, a subclass's or one set on the object."""
    from duvm.store import daemon_state as ds

    base, _ = _store(pure=False)
    assert base.nonce_hook() is None
    reserving, _ = _store(pure=False, cls=_Reserving)
    hook = reserving.nonce_hook()
    assert hook is not None and hook.__func__ is _Reserving.reserve_nonces  # type: ignore[attr-defined]
    assert ds.PersistentCryptStore.reserve_nonces is not CryptStore.reserve_nonces
    calls: list[int] = []
    base.reserve_nonces = calls.append  # type: ignore[method-assign]
    assert base.nonce_hook() is not None
    base.fast = compiled.CryptFastPath(base)
    base.fast.start_write(0, memoryview(bytearray(3 * PS)), lambda tag, cont: None, 0)
    assert calls == [3]


def test_a_reserving_store_reserves_before_each_seal_on_both_paths() -> None:
    """The counter a write's seal will reach is stored before it seals (PersistentCryptStore):
    the hook sees the counter as it was before the seal, on both paths."""
    for pure in (True, False):
        store, _below = _store(pure, cls=_Reserving)
        start_write = store.fast_entries()[1]
        for first, count in ((0, 2), (5, 1), (7, 3)):
            start_write(first * PS, memoryview(bytearray(count * PS)), lambda t, c: None, 0)
        assert store.reserved == [(2, 0), (1, 2), (3, 3)]  # type: ignore[attr-defined]
        assert store.cipher.counter == 6
