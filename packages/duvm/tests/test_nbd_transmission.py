"""The NBD connection's transmission phase: the compiled twin (`duvm.node.daemon._transmission`)
against the reference (`duvm.node.daemon.nbd_transmission`), differential, and the reference's own
rules.

Both get the same operations drawn by Hypothesis on a real event loop, with the real decoder
and buffer pool, a recording transport and a scripted store: request streams cut anywhere
(READ, WRITE with and without FUA, TRIM, WRITE_ZEROES, FLUSH, DISC, out of range, unaligned,
unknown commands, a bad magic), the store's fast path declining, answering at once, later,
with an error, a store bug, its own buffer or a coroutine that finishes the request, the
coroutine path succeeding and failing, replies delivered in a batch (`after_replies`), flow
control (few requests or bytes allowed in flight, the transport's write buffer full or busy),
end of input, abort and the connection lost. Every byte written and how it was split into
writes, every pause and resume, every store call, the counters and the latency records must
be the same. Without the compiled module the differential test skips, except where
DUVM_REQUIRE_COMPILED=1 (CI) makes that a failure; the reference's rules run everywhere.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import importlib
import os
import struct
from typing import Any

import pytest
from duvm.base import accel
from duvm.node.daemon import nbd_transmission
from duvm.node.daemon.nbdserver import ServerStats, transmission_flags
from duvm.store.storage import Batching, Capabilities, StorageError
from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import ExportInfo, buffer_pool, transmission_decoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
PAGES = 64  # the export: 64 pages
BUILT = accel.state("duvm.node.daemon._transmission")
compiled = (
    importlib.import_module("duvm.node.daemon._transmission") if BUILT == "compiled" else None
)
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
needs_compiled = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")
# An aborted FUA request's Task is cancelled before it starts: the store coroutine it wraps is
# never started, which Python reports when it is collected.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")

# What the scripted store does with a request, by the page it starts at (page % 7).
DECLINE, NOW, LATER, FAIL, BUG, OWN, CONTINUE = range(7)


def _digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]


class _Transport:
    def __init__(self, log: list) -> None:
        self.log, self.wire, self.buffered, self.paused = log, bytearray(), 0, False

    def writelines(self, bufs: list) -> None:
        data = b"".join(bytes(b) for b in bufs)
        self.wire += data
        self.log.append(("write", [len(b) for b in bufs], _digest(data)))

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def pause_reading(self) -> None:
        self.paused = True
        self.log.append(("pause",))

    def resume_reading(self) -> None:
        self.paused = False
        self.log.append(("resume",))

    def close(self) -> None:
        self.log.append(("close",))

    def abort(self) -> None:
        self.log.append(("abort",))


class _Recorder:
    """Latency and trace records, as duvm.base.metrics and nbdtrace take them."""

    def __init__(self, log: list) -> None:
        self.log = log

    def observe_ns(self, cmd: int, ns: int) -> None:
        self.log.append(("observe", cmd, ns >= 0))

    def record(self, cmd: int, offset: int, length: int, t0: int, t1: int, err: int) -> None:
        self.log.append(("trace", cmd, offset, length, t1 >= t0, err))


class _Store:
    """A scripted store: what it does with a request depends on the page it starts at."""

    def __init__(self, log: list, fast: bool) -> None:
        self.log, self.fast_path, self.batching = log, fast, Batching()
        self.held: list[tuple[Any, Any, int, memoryview | None]] = []  # (done, tag, page, view)
        self.own = memoryview(bytearray(b"O" * PS * 16))  # longer than any read

    def fast_entries(self) -> tuple[Any, Any]:
        return self.start_read, self.start_write

    def _start(self, op: str, offset: int, view: memoryview, done: Any, tag: Any) -> bool:
        page = offset // PS
        how = page % 7
        self.log.append(("start", op, offset, len(view), how))
        if how == DECLINE:
            return False
        if how == BUG:
            raise RuntimeError("a store bug")
        if how == NOW:
            if op == "read":
                view[:] = bytes([page & 0xFF]) * len(view)
            done(tag, None)
            return True
        self.held.append((done, tag, page, view if op == "read" else None))
        return True

    def start_read(self, offset: int, out: memoryview, done: Any, tag: Any) -> bool:
        return self._start("read", offset, out, done, tag)

    def start_write(self, offset: int, data: memoryview, done: Any, tag: Any) -> bool:
        self.log.append(("data", _digest(bytes(data))))
        return self._start("write", offset, data, done, tag)

    def complete(self, i: int) -> None:
        """Finish one held fast-path request, as its memserver's reply would."""
        done, tag, page, view = self.held.pop(i % len(self.held))
        how = page % 7
        if how == LATER:
            if view is not None:
                view[:] = bytes([(page * 3) & 0xFF]) * len(view)
            done(tag, None)
        elif how == FAIL:
            done(tag, StorageError(errno.ENOSPC, "full") if page % 2 else ValueError("odd"))
        elif how == OWN:
            done(tag, self.own[: len(view)] if view is not None else None)
        else:  # CONTINUE: a coroutine finishes it (a failover, a retry)
            done(tag, self._finish(page, view))

    async def _finish(self, page: int, view: memoryview | None) -> None:
        await asyncio.sleep(0)
        self.log.append(("continued", page))
        if view is not None:
            view[:] = bytes([(page * 5) & 0xFF]) * len(view)
        if page % 3 == 0:
            raise StorageError(errno.EIO, "second replica lost too")

    async def _coro(self, op: str, offset: int, length: int) -> None:
        self.log.append(("coro", op, offset, length))
        await asyncio.sleep(0)
        if (offset // PS) % 5 == 4:
            raise StorageError(errno.EIO, f"{op} failed")
        if (offset // PS) % 11 == 10:
            raise KeyError("a store bug on the coroutine path")

    async def read(self, offset: int, out: memoryview) -> None:
        await self._coro("read", offset, len(out))
        out[:] = bytes([(offset // PS) & 0xFF]) * len(out)

    async def write(self, offset: int, data: memoryview) -> None:
        await self._coro("write", offset, len(data))

    async def trim(self, offset: int, length: int) -> None:
        await self._coro("trim", offset, length)

    async def write_zeroes(self, offset: int, length: int) -> None:
        await self._coro("write_zeroes", offset, length)

    async def flush(self) -> None:
        await self._coro("flush", 0, 0)


class _Server:
    def __init__(self, store: _Store, max_reqs: int, max_bytes: int, timed: bool, log: list):
        self.store, self.stats, self.pool = store, ServerStats(), buffer_pool()
        self.max_in_flight, self.max_in_flight_bytes = max_reqs, max_bytes
        self.latency = _Recorder(log) if timed else None
        self.trace = _Recorder(log) if timed else None


EXPORT = ExportInfo(
    name="",
    size=PAGES * PS,
    flags=transmission_flags(
        Capabilities(can_write=True, can_flush=True, can_trim=True, can_zero=True)
    ),
)

REQ = st.tuples(
    st.sampled_from(
        [C.CMD_READ] * 4 + [C.CMD_WRITE] * 4 + [C.CMD_TRIM, C.CMD_WRITE_ZEROES, C.CMD_FLUSH, 9]
    ),
    st.sampled_from([0, 0, C.CMD_FLAG_FUA, C.CMD_FLAG_FUA, 0x40]),  # none, FUA, an unknown flag
    st.integers(0, PAGES + 2),  # start page, a few beyond the end
    st.sampled_from([0, 1, 1, 1, 2, 3, 9]),  # pages
    st.booleans(),  # unaligned by 512 bytes
)
OPS = st.one_of(
    st.tuples(st.just("send"), st.lists(REQ, min_size=1, max_size=6), st.integers(1, 9000)),
    st.tuples(
        st.sampled_from(["complete", "complete", "complete", "run", "run", "deliver"]),
        st.integers(0, 30),
        st.just(0),
    ),
    st.tuples(
        st.sampled_from(["write_paused", "write_resumed", "buffered", "drained"]),
        st.just(0),
        st.just(0),
    ),
    st.tuples(
        st.sampled_from(["disc", "finish", "abort", "lost", "garbage"]), st.just(0), st.just(0)
    ),
)


def _encode(reqs: list, cookie0: int) -> tuple[bytes, dict[int, tuple[int, int, int]]]:
    out, sent = bytearray(), {}
    for i, (cmd, flags, page, pages, unaligned) in enumerate(reqs):
        cookie = ((cookie0 + i) * 0x9E3779B97F4A7C15) & (2**64 - 1)  # every bit of the field
        length = pages * PS + (512 if unaligned else 0)
        offset = page * PS
        if cmd == C.CMD_FLUSH:
            offset = length = 0
        out += struct.pack(">IHHQQI", C.REQUEST_MAGIC, flags, cmd, cookie, offset, length)
        if cmd == C.CMD_WRITE:
            out += bytes([cookie & 0xFF]) * length
        sent[cookie] = (cmd, length, offset)
    return bytes(out), sent


async def _run_async(tx_type: type, ops: list, fast: bool, limits: tuple[int, int], timed: bool):
    log: list = []
    store = _Store(log, fast)
    server = _Server(store, limits[0], limits[1], timed, log)
    t = _Transport(log)
    tx = tx_type(server, t, transmission_decoder(EXPORT, server.pool), "peer")
    sent: dict[int, tuple[int, int, int]] = {}
    pending = b""
    ended = broken = False
    for op, a, b in ops:
        if op == "send" and not ended:
            data, new = _encode(a, len(sent) + 1)
            sent.update(new)
            pending += data
        elif op == "disc" and not ended:
            pending += struct.pack(">IHHQQI", C.REQUEST_MAGIC, 0, C.CMD_DISC, 0, 0, 0)
            ended = True
        elif op == "garbage" and not ended:
            pending += b"\x00" * 28  # not a request magic: a protocol error
            ended = broken = True
        elif op == "complete" and store.held:
            store.complete(a)
        elif op == "run":
            for _ in range(1 + a % 3):
                await asyncio.sleep(0)
        elif op == "deliver":  # replies from a memserver, delivered in one batch
            after = store.batching.delivering()
            while store.held and a:
                store.complete(a)
                a //= 2
            store.batching.delivered()
            for fn in after:
                fn()
        elif op == "write_paused":
            tx.write_paused(True)
        elif op == "write_resumed":
            tx.write_paused(False)
        elif op == "buffered":
            t.buffered = 1 << 20
        elif op == "drained":
            t.buffered = 0
        elif op == "finish":
            tx.finish()
            ended = True
        elif op == "abort":
            tx.abort("the test aborts")
            ended = broken = True
        elif op == "lost":
            tx.lost()
            ended = broken = True
        pending = _deliver(tx, t, pending, b or 4096, broken)
        log.append((op, server.stats.as_dict(), t.paused))
    # The client's socket drains, and everything still in flight finishes.
    if not broken:
        tx.write_paused(False)
    for _ in range(200):
        pending = _deliver(tx, t, pending, 4096, broken)
        if store.held:
            store.complete(0)
        await asyncio.sleep(0)
    log.append(("end", server.stats.as_dict()))
    return log, bytes(t.wire), sent, broken, ended


def _deliver(tx: Any, t: _Transport, pending: bytes, piece: int, broken: bool) -> bytes:
    """The transport delivers what the client sent, in pieces, while reading is not paused."""
    while pending and not t.paused and not broken:
        buf = tx.get_buffer()
        n = min(len(buf), len(pending), piece)
        buf[:n] = pending[:n]
        pending = pending[n:]
        tx.received(n)
    return pending


def _run(tx_type: type, ops: list, fast: bool, limits: tuple[int, int], timed: bool):
    return asyncio.run(_run_async(tx_type, ops, fast, limits, timed))


def _read_fill(page: int, fast: bool) -> bytes:
    """The byte the scripted store fills a successful READ starting at `page` with."""
    how = page % 7 if fast else DECLINE
    if how == OWN:
        return b"O"
    factor = {NOW: 1, LATER: 3, CONTINUE: 5}.get(how, 1)  # DECLINE: the coroutine path's
    return bytes([(page * factor) & 0xFF])


def _replies(wire: bytes, sent: dict[int, tuple[int, int, int]]) -> dict[int, tuple[int, bytes]]:
    """The replies on the wire: cookie -> (NBD error, read payload)."""
    out: dict[int, tuple[int, bytes]] = {}
    i = 0
    while i < len(wire):
        magic, err, cookie = C.SIMPLE_REPLY.unpack_from(wire, i)
        assert magic == C.SIMPLE_REPLY_MAGIC
        i += 16
        cmd, length, _ = sent[cookie]
        payload = b""
        if cmd == C.CMD_READ and not err:
            payload = wire[i : i + length]
            i += length
        assert cookie not in out, f"cookie {cookie} answered twice"
        out[cookie] = (err, payload)
    return out


SETTINGS = settings(
    max_examples=int(os.environ.get("DUVM_DIFF_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LIMITS = st.sampled_from([(512, 64 << 20), (2, 64 << 20), (512, 3 * PS), (1, PS)])


@needs_compiled
@SETTINGS
@given(ops=st.lists(OPS, max_size=30), fast=st.booleans(), limits=LIMITS, timed=st.booleans())
def test_compiled_transmission_matches_the_reference(ops, fast, limits, timed):
    ref = _run(nbd_transmission.Transmission, ops, fast, limits, timed)
    twin = _run(compiled.Transmission, ops, fast, limits, timed)
    assert twin[0] == ref[0]
    assert twin[1] == ref[1]


@SETTINGS
@given(ops=st.lists(OPS, max_size=30), fast=st.booleans(), limits=LIMITS)
def test_every_request_is_answered_once_with_the_stores_result(ops, fast, limits):
    """The reference's own rules: every request sent before the end is answered exactly once
    (unless the connection broke), a READ with the bytes its store produced; an invalid
    request with its error, without reaching the store."""
    log, wire, sent, broken, _ = _run(nbd_transmission.Transmission, ops, fast, limits, True)
    replies = _replies(wire, sent)
    assert set(replies) <= set(sent)
    if not broken and not any(op == "finish" for op, _, _ in ops):
        assert set(replies) == set(sent)  # (finish: requests not yet read are never read)
    for cookie, (err, payload) in replies.items():
        cmd, length, offset = sent[cookie]
        if cmd == 9:
            assert err == C.EINVAL
        if cmd == C.CMD_READ and not err:
            assert payload == _read_fill(offset // PS, fast) * length
    starts = [e for e in log if e[0] in ("start", "coro")]
    for e in starts:
        assert e[2] + e[3] <= PAGES * PS and e[2] % PS == 0  # only valid ranges reach it
    assert log[-1][1]["requests"] >= len(replies)


def test_a_reads_payload_follows_its_header_and_its_buffer_is_reused_only_once_sent():
    """Catches a pooled read buffer given back before the transport has sent it: the next
    read would overwrite bytes still queued for the client."""
    ops = [
        ("buffered", 0, 0),
        ("send", [(C.CMD_READ, 0, 1, 1, False)], 4096),  # NOW: answered at once
        ("send", [(C.CMD_READ, 0, 8, 1, False)], 4096),  # NOW again, page 8
        ("drained", 0, 0),
        ("send", [(C.CMD_READ, 0, 15, 1, False)], 4096),
    ]
    for tx_type in _types():
        _, wire, sent, _, _ = _run(tx_type, ops, True, (512, 64 << 20), False)
        replies = _replies(wire, sent)
        assert [replies[c] for c in sent] == [
            (0, b"\x01" * PS),
            (0, b"\x08" * PS),
            (0, b"\x0f" * PS),
        ]


def _types() -> list[type]:
    return [nbd_transmission.Transmission] + ([compiled.Transmission] if compiled else [])


@pytest.mark.parametrize("tx_type", _types(), ids=lambda t: t.__module__)
def test_flow_control_pauses_reading_at_the_limit_and_resumes_as_replies_drain(tx_type):
    """Catches a connection that reads on past its in-flight limit (memory unbounded under a
    stalled store) or never resumes (a hung client)."""
    sends = [("send", [(C.CMD_READ, 0, 2, 1, False)], 4096) for _ in range(4)]  # LATER
    ops = [*sends, ("complete", 0, 0), ("complete", 0, 0), ("run", 0, 0)]
    log, wire, sent, _, _ = _run(tx_type, ops, True, (2, 64 << 20), False)
    events = [e[0] for e in log if e[0] in ("pause", "resume", "start")]
    assert events[:3] == ["start", "start", "pause"]  # two in flight, then reading stops
    assert "resume" in events
    assert set(_replies(wire, sent)) == set(sent) and len(sent) == 4
