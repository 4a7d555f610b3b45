"""The memserver's compiled STORE/LOAD/FREE loop against the reference loop (differential).

Two memserver connections, one on each path, get the same byte stream, cut into the same
chunks: a login, then requests drawn by Hypothesis (STOREs with repeated keys and beyond the
reservation, LOADs of pages not stored and larger than the compiled loop copies, FREEs,
RESERVEs, a frame with a broken header or count). Every reply byte, whether and when the
connection closes, which slot holds which page and what it holds, and every counter must be
the same. Without the compiled module these tests skip, except where DUVM_REQUIRE_COMPILED=1
(CI) makes that a failure.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from duvm.base import accel
from duvm.memserver.connection import Connection, compiled_loop
from duvm.memserver.server import MemServer
from duvm.wire import pageproto as pp
from duvm.wire.pageencode import encode_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

PS = pp.PAGE_SIZE
BUILT = accel.state("duvm.memserver._hotloop")
if BUILT != "compiled" and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(BUILT != "compiled", reason=f"compiled path: {BUILT}")


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed_at: int | None = None

    def writelines(self, parts) -> None:
        for p in parts:
            self.out += p

    def write(self, data) -> None:
        self.out += data

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = len(self.out)

    abort = close

    def is_closing(self) -> bool:
        return self.closed_at is not None

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default=None):
        return ("diff", 0) if name == "peername" else default


def _page(seed: int) -> bytes:
    return bytes([seed & 0xFF]) * (PS // 2) + seed.to_bytes(8, "little") * (PS // 16)


KEY = st.integers(0, 12) | st.sampled_from([2**64 - 1, 2**40])
FRAME = st.one_of(
    st.tuples(st.just("store"), st.lists(KEY, min_size=1, max_size=6), st.integers(0, 255)),
    st.tuples(st.just("load"), st.lists(KEY, min_size=1, max_size=20), st.just(0)),
    st.tuples(st.just("free"), st.lists(KEY, min_size=1, max_size=6), st.just(0)),
    st.tuples(st.just("reserve"), st.just([]), st.integers(0, 24)),
    st.tuples(st.just("broken"), st.lists(KEY, min_size=1, max_size=3), st.integers(0, 31)),
)


def _wire(frames: list, reserve: int) -> bytes:
    out = [encode_bytes(pp.Hello(1, "diff")), encode_bytes(pp.Auth(2, bytes(32)))]
    out.append(encode_bytes(pp.Reserve(3, reserve)))
    for i, (kind, keys, arg) in enumerate(frames, start=10):
        if kind == "store":
            data = b"".join(_page(arg + j) for j in range(len(keys)))
            out.append(encode_bytes(pp.make_store(i, keys, data)))
        elif kind == "load":
            out.append(encode_bytes(pp.Load(i, tuple(keys))))
        elif kind == "free":
            out.append(encode_bytes(pp.Free(i, tuple(keys))))
        elif kind == "reserve":
            out.append(encode_bytes(pp.Reserve(i, arg)))
        else:  # a FREE with one byte of its header or count broken
            frame = bytearray(encode_bytes(pp.Free(i, tuple(keys))))
            frame[arg % 32] ^= 0x41
            out.append(bytes(frame))
    return b"".join(out)


async def _feed(conn: Connection, t: _Transport, stream: bytes, chunk: int) -> None:
    """`stream` in reads of at most `chunk` bytes, as the event loop would hand them over."""
    conn.connection_made(t)
    i = 0
    while i < len(stream) and t.closed_at is None:
        buf = conn.get_buffer(-1)
        n = min(len(buf), chunk, len(stream) - i)
        buf[:n] = stream[i : i + n]
        conn.buffer_updated(n)
        i += n


def _run(stream: bytes, chunk: int, pure: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    loop = asyncio.new_event_loop()
    try:
        server = MemServer(64 * PS, lease_s=60, lock=False)
        with monkeypatch.context() as m:
            if pure:
                m.setenv(accel.ENV, "1")
            else:
                m.delenv(accel.ENV, raising=False)
            conn = Connection(server)
        assert (conn._hot is None) is pure  # each side runs the path it is here for
        t = _Transport()
        loop.run_until_complete(_feed(conn, t, stream, chunk))
        st_ = server.store
        ns = st_.namespaces.get("diff")
        pages = dict(ns.pages) if ns else {}
        result = {
            # after the CHALLENGE, whose nonce is random
            "replies": bytes(t.out[pp.HEADER_SIZE + pp.CHALLENGE_BODY.size :]),
            "closed_at": t.closed_at,
            "pages": pages,
            "bytes": {k: bytes(st_.arena.view(s)) for k, s in pages.items()},
            "reserved": ns.reserved if ns else None,
            "free_slots": st_.arena.free_slots,
            "next_slots": [st_.arena.alloc() for _ in range(st_.arena.free_slots)],
            "counters": dict(st_.counters),
        }

        async def lost() -> None:
            conn.connection_lost(None)

        loop.run_until_complete(lost())
        st_.close()
        return result
    finally:
        loop.close()


@settings(max_examples=150)
@given(
    frames=st.lists(FRAME, min_size=1, max_size=30),
    reserve=st.integers(1, 16),
    chunk=st.sampled_from([7, 100, 4096, 1 << 20]),
)
def test_both_loops_answer_every_stream_alike(frames, reserve, chunk) -> None:
    """Catches a compiled rule that differs from the reference: a STORE beyond the reservation
    taken, a repeated key given two slots, a LOAD of a missing page answered, freed slots
    pushed back in another order, a broken frame served instead of refused, a frame cut across
    two reads served before it is whole, a counter missed."""
    mp = pytest.MonkeyPatch()
    try:
        stream = _wire(frames, reserve)
        fast = _run(stream, chunk, False, mp)
        ref = _run(stream, chunk, True, mp)
    finally:
        mp.undo()
    assert fast == ref


def test_the_compiled_loop_serves_the_hot_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a compiled loop that never serves anything (every frame left to the reference,
    so the differential test above would pass with it doing nothing), and a `Connection` that
    does not serve with the compiled loop by default."""
    from duvm.memserver import _hotloop

    calls: list[int] = []
    real = _hotloop.serve

    class Spy:
        IndexCore = _hotloop.IndexCore

        @staticmethod
        def serve(buf, start, end, *rest):
            to = real(buf, start, end, *rest)
            calls.append(to - start)
            return to

    monkeypatch.delenv(accel.ENV, raising=False)
    assert compiled_loop() is _hotloop  # what a Connection serves with by default
    stream = _wire([("store", [1, 2], 5), ("load", [2, 1], 0), ("free", [1], 0)], 4)
    loop = asyncio.new_event_loop()
    try:
        server = MemServer(16 * PS, lease_s=60, lock=False)
        conn = Connection(server, hot_loop=lambda: Spy)
        t = _Transport()

        loop.run_until_complete(_feed(conn, t, stream, 1 << 20))
    finally:
        loop.close()
    hot = sum(calls)
    want = len(stream) - len(_wire([], 4))  # everything after the login
    assert hot == want, (calls, want)
    c = server.store.counters
    assert (c["store_requests"], c["load_requests"], c["free_requests"]) == (1, 1, 1)
    assert b"".join(_page(5 + j) for j in (1, 0)) in bytes(t.out)  # LOAD [2, 1] answered


def test_the_compiled_loop_stores_pages_without_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a compiled loop that allocates per page it stores (a Python object per page in
    the namespace's index, as the dict it replaced did: about 104 bytes per page held, faulted
    in while the node it serves swaps), after the pages came and went once."""
    import tracemalloc

    monkeypatch.delenv(accel.ENV, raising=False)
    n, batch = 4096, 64
    stores = [("store", list(range(k, k + batch)), k) for k in range(0, n, batch)]
    frees = [("free", list(range(k, k + batch)), 0) for k in range(0, n, batch)]
    again = b"".join(
        encode_bytes(
            pp.make_store(9000 + k, list(range(k << 20, (k << 20) + batch)), b"x" * PS * batch)
        )
        for k in range(0, n, batch)
    )
    loop = asyncio.new_event_loop()
    try:
        server = MemServer((n + 64) * PS, lease_s=60, lock=False)
        conn = Connection(server)
        t = _Transport()
        loop.run_until_complete(_feed(conn, t, _wire(stores + frees, n), 1 << 20))
        ns = server.store.namespaces["diff"]
        assert len(ns.pages) == 0 and t.closed_at is None

        async def more() -> None:
            i = 0
            while i < len(again):
                buf = conn.get_buffer(-1)
                m = min(len(buf), 1 << 20, len(again) - i)
                buf[:m] = again[i : i + m]
                conn.buffer_updated(m)
                i += m

        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            loop.run_until_complete(more())
            grown = tracemalloc.get_traced_memory()[0] - before - len(t.out)
        finally:
            tracemalloc.stop()
    finally:
        loop.close()
    assert len(ns.pages) == n and server.store.counters["store_requests"] == 2 * n // batch
    assert grown < 16 << 10, f"{grown} bytes stayed after storing {n} pages"
