"""The memory client's compiled reply loop (`duvm.store._replies.deliver`) against the reference
loop (`ReplyProtocol._deliver` alone): differential.

Two `ReplyProtocol`s, one on each path, each with its own copy of the same waiting requests
(merged STORE and LOAD batches of callbacks, some already cancelled, and plain Futures), get the
same reply stream cut into the same chunks. The replies are drawn by Hypothesis: plain ones,
refusals (per-key ones that make a merged batch be sent again, and others), LOAD replies of the
wrong size, replies to unknown ids, broken headers. Every waiter's outcome, every byte of the
callers' buffers, the batches sent again, when the connection is aborted, what is left pending
and what is left in the receive buffer must be the same. Without the compiled module these
tests skip, except where DUVM_REQUIRE_COMPILED=1 (CI) makes that a failure.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import struct
from dataclasses import dataclass, field

import pytest
from duvm.base import accel
from duvm.store.memclient_replies import Batch, Callback, ReplyProtocol
from duvm.store.storage import Batching
from duvm.wire import pageproto as pp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = pp.PAGE_SIZE
HEADER = struct.Struct("<IHHQII")
BUILT = accel.state("duvm.store._replies")
compiled = importlib.import_module("duvm.store._replies") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")

STORE, LOAD = int(pp.MsgType.STORE), int(pp.MsgType.LOAD)


class _Transport:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes
        self.aborted_at: int | None = None

    def abort(self) -> None:
        if self.aborted_at is None:
            self.aborted_at = len(self.outcomes)  # how far delivery had got


@dataclass
class _Owner:
    peer: str = "diff:0"
    batching: Batching = field(default_factory=Batching)
    pending: dict = field(default_factory=dict)
    last_rx: float = 0.0
    resent: list = field(default_factory=list)

    def resend_each(self, batch: Batch) -> None:
        self.resent.append(batch.keys[0])

    def reply_connection_lost(self, proto: ReplyProtocol, exc: Exception | None) -> None:
        pass


def _build(spec: list, hot: object) -> tuple[ReplyProtocol, _Owner, list, list]:
    """A protocol whose owner waits on the requests of `spec`; (proto, owner, outcomes, outs)."""
    owner = _Owner()
    outcomes: list = []
    outs: list[bytearray] = []
    for rid, (kind, sizes, cancelled) in enumerate(spec, start=1):
        if kind == "future":
            owner.pending[rid] = asyncio.get_running_loop().create_future()
            continue
        batch = Batch(STORE if kind == "store" else LOAD)
        key = rid * 100
        for i, n in enumerate(sizes):
            keys = tuple(range(key, key + n))
            key += n
            out = None
            if kind == "load":
                buf = bytearray(b"\xee" * (n * PS))
                outs.append(buf)
                out = memoryview(buf)

            def record(exc, tag=(rid, i)) -> None:
                outcomes.append((tag, None if exc is None else f"{type(exc).__name__}: {exc}"))

            cb = Callback(record)
            if i in cancelled:
                cb.finished = True  # the caller gave up: its reply is dropped
            batch.keys += keys
            batch.waiters.append((cb, keys, None, out))
        owner.pending[rid] = batch
    proto = ReplyProtocol(owner, lambda: hot)
    proto.transport = _Transport(outcomes)  # type: ignore[assignment]
    return proto, owner, outcomes, outs


def _frame(spec: list, choice: tuple) -> bytes:
    """One reply frame as drawn: (request id, what, seed)."""
    rid, what, seed = choice
    kind, sizes, _ = spec[(rid - 1) % len(spec)]
    mtype = (STORE if kind == "store" else LOAD) | pp.REPLY_BIT
    pages = sum(sizes) if kind != "future" else 1
    if what == "ok":
        body = bytes([seed]) * (pages * PS) if kind == "load" else b""
        return HEADER.pack(pp.MAGIC, mtype, 0, rid, 0, len(body)) + body
    if what in ("not_found", "no_space", "internal"):
        code = {"not_found": 3, "no_space": 2, "internal": 6}[what]
        msg = b"refused %d" % seed if seed % 4 else b""  # empty: a STORE reply's size
        return HEADER.pack(pp.MAGIC, mtype, 0, rid, code, len(msg)) + msg
    if what == "short_load":
        body = bytes(PS * max(0, pages - 1) + seed % 3)
        return HEADER.pack(pp.MAGIC, LOAD | pp.REPLY_BIT, 0, rid, 0, len(body)) + body
    if what == "unknown_id":
        return HEADER.pack(pp.MAGIC, STORE | pp.REPLY_BIT, 0, 10_000 + seed, 0, 0)
    if what == "flags":
        return HEADER.pack(pp.MAGIC, mtype, 1, rid, 0, 0)
    return HEADER.pack(0x12345678, mtype, 0, rid, 0, 0)  # bad magic


_request = st.tuples(
    st.sampled_from(["store", "load", "future"]),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
    st.sets(st.integers(0, 3), max_size=2),
)
_what = st.sampled_from(
    ["ok"] * 8 + ["not_found", "no_space", "internal", "short_load", "unknown_id", "flags", "bad"]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.lists(_request, min_size=1, max_size=8),
    replies=st.lists(st.tuples(st.integers(1, 9), _what, st.integers(0, 255)), max_size=12),
    cuts=st.lists(st.integers(1, 20000), min_size=1, max_size=6),
)
def test_compiled_reply_loop_matches_the_reference(spec, replies, cuts) -> None:
    """Catches a compiled rule that drifts from the reference: pages copied to the wrong
    caller or offset, a cancelled caller's buffer written, a refusal (the status not read) or
    a wrong-size reply completed as a success, a frame consumed twice or not at all."""
    stream = b"".join(_frame(spec, r) for r in replies)

    async def run(hot: object) -> tuple:
        proto, owner, outcomes, outs = _build(spec, hot)
        view, i = memoryview(stream), 0
        while view and proto.transport.aborted_at is None:
            dst = proto.get_buffer(-1)
            n = min(len(dst), len(view), cuts[i % len(cuts)])
            i += 1
            dst[:n] = view[:n]
            view = view[n:]
            proto.buffer_updated(n)
        futures = {
            rid: (f.done(), repr(f.exception()) if f.done() else None)
            for rid, f in owner.pending.items()
            if isinstance(f, asyncio.Future)
        }
        return (
            outcomes,
            [bytes(b) for b in outs],
            owner.resent,
            proto.transport.aborted_at,
            sorted(owner.pending),
            futures,
            proto.decoder.buffered,
        )

    ref = asyncio.run(run(None))
    hot = asyncio.run(run(compiled.deliver))
    assert hot == ref


def test_plain_replies_are_completed_by_the_compiled_loop() -> None:
    """The compiled loop does the work (not the reference behind it): with the reference
    loop's frame decoding broken, plain replies are still delivered."""

    async def run() -> tuple:
        spec = [("load", [1, 2], ()), ("store", [1], ())]
        proto, owner, outcomes, outs = _build(spec, compiled.deliver)
        proto.decoder.next_frame = _need_data_only(proto.decoder)
        stream = _frame(spec, (1, "ok", 7)) + _frame(spec, (2, "ok", 0))
        dst = proto.get_buffer(-1)
        dst[: len(stream)] = stream
        proto.buffer_updated(len(stream))
        return outcomes, outs, owner.pending

    outcomes, outs, pending = asyncio.run(run())
    assert [tag for tag, err in outcomes if err is None] == [(1, 0), (1, 1), (2, 0)]
    assert outs == [bytearray(b"\x07" * PS), bytearray(b"\x07" * 2 * PS)] and pending == {}


def test_a_protocol_given_no_compiled_loop_runs_the_reference_alone() -> None:
    """Catches a `ReplyProtocol` that ignores the loop it is given (`deliver`) and takes the
    compiled one anyway: the differential test above would then compare the compiled loop
    with itself."""

    async def run() -> None:
        spec = [("store", [1], ())]
        proto, _owner, outcomes, _outs = _build(spec, None)
        proto.decoder.next_frame = _need_data_only(proto.decoder)
        stream = _frame(spec, (1, "ok", 0))
        proto.get_buffer(-1)[: len(stream)] = stream
        with pytest.raises(AssertionError, match="the reference loop was left a plain reply"):
            proto.buffer_updated(len(stream))
        assert outcomes == []

    asyncio.run(run())


def _need_data_only(decoder):
    """A next_frame that only ever says the buffer holds no whole frame (checks it is empty)."""
    from duvm.wire.pagedecode import NEED_DATA

    def next_frame():
        assert decoder.buffered == 0, "the reference loop was left a plain reply"
        return NEED_DATA

    return next_frame
