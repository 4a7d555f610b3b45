"""The memory client's compiled send side (`duvm.store._sendqueue.SendQueue`) against the
reference (`duvm.store.memclient_send.SendQueue`): differential.

Both queues get the same operations drawn by Hypothesis, over the same recording transport
and a real `storage.Batching`: STOREs and LOADs on the callback path and the awaitable path
(which merge), FREEs and encoded messages (which do not), corking and uncorking, the loop's
flushes, a smaller batch limit, the connection lost (the transport gone or closing, the table
failed), a refused merged batch sent again part by part, an explicit flush, and replies
completing pending requests; a STORE's pages in a bytearray, in a bytes object viewed whole
(sent as that object: `wire_part`), in part, or backwards. Every byte written, how it was
split into writes and what each part was, the table of pending requests, every completion
and every waiter's state must be the same. Without the
compiled module these tests skip, except where DUVM_REQUIRE_COMPILED=1 (CI) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
from typing import Any

import pytest
from duvm.base import accel
from duvm.store import memclient_send
from duvm.store.memclient_replies import Batch
from duvm.store.memserver_errors import MemserverUnreachable
from duvm.store.storage import Batching
from duvm.wire import pageproto as pp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
BUILT = accel.state("duvm.store._sendqueue")
compiled = importlib.import_module("duvm.store._sendqueue") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")

FREE = int(pp.MsgType.FREE)


def _digest(b: bytes | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


class _Loop:
    """The real loop's futures; `call_soon` recorded, run when the test says."""

    def __init__(self, real: asyncio.AbstractEventLoop, log: list) -> None:
        self.real, self.log, self.soon = real, log, []

    def create_future(self) -> asyncio.Future:
        return self.real.create_future()

    def call_soon(self, fn: Any) -> Any:
        self.log.append(("call_soon",))
        handle = _Handle(self, fn)
        self.soon.append(handle)
        return handle


class _Handle:
    def __init__(self, loop: _Loop, fn: Any) -> None:
        self.loop, self.fn, self.cancelled = loop, fn, False

    def cancel(self) -> None:
        self.cancelled = True


class _Transport:
    def __init__(self, log: list) -> None:
        self.log, self.closing = log, False

    def is_closing(self) -> bool:
        return self.closing

    def writelines(self, bufs: list) -> None:
        parts = [(len(b), type(b).__name__) for b in bufs]
        self.log.append(("write", parts, _digest(b"".join(bytes(b) for b in bufs))))


PAGE_OPS = st.sampled_from(["store_cb"] * 3 + ["load_cb"] * 2 + ["store", "load"])
OTHER_OPS = st.sampled_from(
    [
        "cork",
        "uncork",
        "run_soon",
        "run_soon",
        "flush",
        "fail_all",
        "fail_all",
        "lose",
        "closing",
        "reconnect",
        "resend",
        "reply",
        "reply",
    ]
)
OPS = st.one_of(
    st.tuples(PAGE_OPS, st.integers(0, 200), st.sampled_from([1, 1, 1, 2, 3, 8, 16, 40, 63])),
    st.tuples(PAGE_OPS, st.integers(0, 200), st.sampled_from([1, 1, 2, 3])),
    st.tuples(st.just("free"), st.integers(0, 200), st.integers(1, 4)),
    st.tuples(st.just("reserve"), st.integers(0, 1000), st.just(0)),
    st.tuples(OTHER_OPS, st.integers(0, 7), st.just(0)),
    st.tuples(st.just("max_batch"), st.sampled_from([1, 2, 3, 8, 64]), st.just(0)),
)


def _state(f: Any) -> object:
    if not f.done():
        return "waiting"
    if isinstance(f, asyncio.Future):
        if f.exception() is not None:
            return ("failed", type(f.exception()).__name__, str(f.exception()))
        return ("done", f.result())
    return "finished"  # a Callback: what it was called with is in the log


async def _run_async(queue_type: type, ops: list) -> list:
    log: list = []
    loop = _Loop(asyncio.get_running_loop(), log)
    batching = Batching()
    q = queue_type("m0:1", batching)
    t = _Transport(log)
    q.connected(loop, t)
    futs: list = []
    corked = False
    for n, (op, a, b) in enumerate(ops):
        before = q.busy_since
        if op in ("store_cb", "load_cb", "store", "load"):
            keys = tuple(range(a, a + b))
            fill = bytes([n & 0xFF, a & 0xFF]) * (b * PS // 2)
            buf = memoryview(bytearray(fill))
            if op in ("store_cb", "store") and a % 4:  # the bytes object a seal made, viewed:
                buf = memoryview(fill)  # whole (sent as that object),
                if a % 4 == 2:
                    buf = memoryview(fill + bytes(PS))[: b * PS]  # in part,
                elif a % 4 == 3:
                    buf = memoryview(fill)[::-1]  # or backwards (sent as the view)

            def cb(exc: BaseException | None, n: int = n) -> None:
                log.append(("cb", n, None if exc is None else (type(exc).__name__, str(exc))))

            if op == "store_cb":
                q.store_cb(keys, buf, cb)
            elif op == "load_cb":
                q.load_cb(keys, buf, cb)
            else:
                mtype = memclient_send.STORE if op == "store" else memclient_send.LOAD
                data, out = (buf, None) if op == "store" else (None, buf)
                futs.append(q.queue(mtype, keys, data, out))
        elif op == "free":
            futs.append(q.queue(FREE, tuple(range(a, a + b)), None, None))
        elif op == "reserve":
            futs.append(q.queue(0, None, None, None, pp.Reserve(0, a)))
        elif op == "cork":
            if not corked:
                corked = batching.cork()
        elif op == "uncork":
            if corked:
                batching.uncork()
                corked = False
        elif op == "run_soon":
            soon, loop.soon = loop.soon, []
            for h in soon:
                if not h.cancelled:
                    h.fn()
        elif op == "flush":
            q.flush()
        elif op == "fail_all":
            q.fail_all(MemserverUnreachable("connection lost"))
        elif op == "lose":
            q.disconnected()
        elif op == "closing":
            t.closing = True
        elif op == "reconnect":
            t = _Transport(log)
            q.connected(loop, t)
        elif op == "resend":
            batches = [rid for rid, e in q.pending.items() if isinstance(e, Batch)]
            if batches:
                q.resend_each(q.pending.pop(batches[a % len(batches)]))
        elif op == "reply":  # the receive side completes one pending request
            if q.pending:
                rid = sorted(q.pending)[a % len(q.pending)]
                entry = q.pending.pop(rid)
                for f in [w[0] for w in entry.waiters] if isinstance(entry, Batch) else [entry]:
                    if not f.done():
                        f.set_result(rid)
        elif op == "max_batch":
            q.max_batch = a
        log.append(
            (
                op,
                sorted(
                    (rid, type(e).__name__, list(e.keys) if isinstance(e, Batch) else None)
                    for rid, e in q.pending.items()
                ),
                q.idle,
                q.busy_since != before,
                q.max_batch,
                q.transport is t,
            )
        )
    log.append(("futures", [_state(f) for f in futs]))
    for f in futs:  # nothing left pending at the end of the loop
        if not f.done():
            f.cancel()
    return log


def _run(queue_type: type, ops: list) -> list:
    return asyncio.run(_run_async(queue_type, ops))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=40))
def test_the_compiled_send_queue_does_what_the_reference_does(ops: list) -> None:
    assert compiled is not None
    assert _run(compiled.SendQueue, ops) == _run(memclient_send.SendQueue, ops)


def test_both_queues_merge_a_burst_into_one_frame_and_one_write() -> None:
    """The common case itself, on each queue, so a rule broken on both alike still fails:
    three STOREs of one iteration leave as one frame of three pages, in one writelines."""
    assert compiled is not None
    ops = [("store_cb", 10, 1), ("store_cb", 11, 1), ("store_cb", 30, 1), ("run_soon", 0, 0)]
    for queue_type in (compiled.SendQueue, memclient_send.SendQueue):
        log = _run(queue_type, ops)
        writes = [e for e in log if e[0] == "write"]
        parts = [(32 + 3 * 8, "bytes")] + [(PS, "memoryview")] * 3
        assert len(writes) == 1 and writes[0][1] == parts, writes
        assert [e for e in log if e[0] == "call_soon"] == [("call_soon",)]
        assert log[-2][1] == [(1, "Batch", [10, 11, 30])]  # one request id, three pages


def test_a_merged_frame_holds_as_many_pages_as_fit_and_never_more() -> None:
    """Requests merge greedily up to min(MERGE_PAGES, max_batch) pages per frame, on each
    queue: a frame one page over the memserver's limit is refused by it."""
    assert compiled is not None
    for limit in (1, 2, 3, 8, 64, 200):
        counts = [1, 2, 1, 3, 1, 1, 8, 40, 63, 1, 2]
        counts = [c for c in counts if c <= limit]
        ops = [("max_batch", limit, 0)]
        ops += [("store_cb", 1000 * i, c) for i, c in enumerate(counts)] + [("run_soon", 0, 0)]
        want, frame = [], 0  # the greedy split
        for c in counts:
            if frame and frame + c > min(memclient_send.MERGE_PAGES, limit):
                want.append(frame)
                frame = 0
            frame += c
        want.append(frame)
        for queue_type in (compiled.SendQueue, memclient_send.SendQueue):
            got = [len(keys) for _, _, keys in _run(queue_type, ops)[-2][1]]
            assert got == want, (queue_type, limit)


def test_the_frame_prefix_is_the_encoders() -> None:
    """The twin writes a frame's header and keys itself: byte for byte what
    `pageencode.batch_prefix` packs (little-endian, the length of the pages that follow)."""
    assert compiled is not None
    from duvm.wire.pageencode import batch_prefix

    got: list = []

    class T:
        def is_closing(self) -> bool:
            return False

        def writelines(self, bufs: list) -> None:
            got.append(bytes(bufs[0]))

    async def main() -> None:
        for mtype in (memclient_send.STORE, memclient_send.LOAD):
            q = compiled.SendQueue("m", Batching())
            q.connected(asyncio.get_running_loop(), T())
            keys = (7, 2**40, 3)
            data = memoryview(bytes(3 * PS)) if mtype == memclient_send.STORE else None
            out = None if data is not None else memoryview(bytearray(3 * PS))
            q.queue(mtype, keys, data, out)
            q.send_queued()
            assert got[-1] == batch_prefix(mtype, 1, keys)

    asyncio.run(main())


def test_a_client_takes_the_chosen_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MemClient` builds its send side through `send_queue_type`: the reference when
    DUVM_PURE_PYTHON is set, else the compiled twin."""
    from duvm.store.memclient import MemClient

    monkeypatch.setenv(accel.ENV, "1")
    assert type(MemClient("h", 1, "c").queue) is memclient_send.SendQueue
    monkeypatch.delenv(accel.ENV)
    assert type(MemClient("h", 1, "c").queue) is compiled.SendQueue


def test_a_whole_bytes_object_goes_out_as_itself_on_both_queues() -> None:
    """The encrypting filter's sealed pages are a bytes object viewed whole: each queue sends
    that object (uvloop then writes it as it is), the same bytes as the view; any other view
    (of a bytearray, part of a bytes object, backwards) goes out as the view."""
    assert compiled is not None
    sealed = bytes(range(256)) * (2 * PS // 256)
    cases = [
        (memoryview(sealed), "bytes"),
        (memoryview(memoryview(sealed)), "bytes"),
        (memoryview(bytearray(sealed)), "memoryview"),
        (memoryview(sealed + b"x")[: 2 * PS], "memoryview"),
        (memoryview(sealed)[::-1], "memoryview"),
    ]
    got: list = []

    class T:
        def is_closing(self) -> bool:
            return False

        def writelines(self, bufs: list) -> None:
            got.append(bufs)

    for data, kind in cases:
        for queue_type in (compiled.SendQueue, memclient_send.SendQueue):
            got.clear()

            async def main(queue_type: type = queue_type, data: memoryview = data) -> None:
                q = queue_type("m", Batching())
                q.connected(asyncio.get_running_loop(), T())
                q.store_cb((5, 6), data, lambda exc: None)
                q.send_queued()

            asyncio.run(main())
            part = got[0][1]
            assert type(part).__name__ == kind, (queue_type, kind)
            assert bytes(part) == bytes(data)
            if kind == "bytes":
                assert part is sealed
