"""The replicated read's compiled fast path (`duvm.store._readpath.ReadFastPath`) against the
reference (`duvm.store.remote_read.ReadFastPath`): differential.

Each path gets its own real `SlabTable`, `Replication`, `RemoteReads` and `Readahead` over the
same scripted memory clients, and the same reads drawn by Hypothesis: any page and length
(within one slab or across two), over pages written, never written or lost, the preferred
replica connected or not, a batch limit below the read, the export not open, sequential runs
that start the readahead, and each LOAD's answer (the stored bytes, corrupted bytes, bytes of a
write still in flight, unreachable, NOT_FOUND, a bug, or no answer at all) in any order, with
the readahead's due fetches run between them. Every return value, every LOAD handed to a
client, every completion (its outcome, the bytes a read answers with, or that the general
path continues it), the readahead's windows and every counter must be the same. Without the
compiled module these tests skip, except where DUVM_REQUIRE_COMPILED=1 (CI) makes that a
failure.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from duvm.base import accel
from duvm.store import remote_read
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.remote_read import RemoteReads
from duvm.store.replication import Replication
from duvm.store.slab_table import SlabTable
from duvm.wire.pageproto import ErrorCode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
PAGES, SLAB_PAGES = 96, 32
BUILT = accel.state("duvm.store._readpath")
compiled = importlib.import_module("duvm.store._readpath") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")


def _page(p: int, version: int = 0) -> bytes:
    return bytes([(p * 7 + version) & 0xFF]) * PS


def _digest(b: memoryview | bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]  # every byte compared, a short line printed


@dataclass(eq=False)
class _Client:
    """A memory client as the read path sees it: connected or not, its batch limit, and a
    `load_cb` that records the LOAD and keeps the buffer and completion for the test."""

    peer: str
    log: list
    hello: object | None = True
    max_batch: int = 64
    waiting: list = field(default_factory=list)

    def load_cb(self, keys: tuple[int, ...], out: memoryview, cb: Any) -> bool:
        self.log.append(("load_cb", self.peer, keys[0], len(keys)))
        if self.hello is None:
            return False
        self.waiting.append((keys, out, cb))
        return True


ANSWERS = st.sampled_from(
    ["good"] * 8 + ["corrupt", "in_flight", "unreachable", "not_found", "bug", "silent"]
)


def _answer(kind: str, keys: tuple[int, ...], out: memoryview, pending: bytes | None) -> Any:
    """Fill `out` as the memserver would for `kind`; the exception the LOAD fails with."""
    if kind in ("good", "corrupt", "in_flight"):
        out[:] = b"".join(_page(k) for k in keys)
        if kind == "corrupt":
            out[len(out) - 1] ^= 0xFF
        elif kind == "in_flight" and pending is not None:
            out[:PS] = pending
        return None
    return {
        "unreachable": MemserverUnreachable("gone"),
        "not_found": PageServerError(ErrorCode.NOT_FOUND, "no such page"),
        "bug": RuntimeError("a bug"),
    }[kind]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    nclients = draw(st.integers(1, 2))
    placement = [
        draw(st.lists(st.integers(0, nclients - 1), min_size=1, max_size=nclients, unique=True))
        for _ in range(PAGES // SLAB_PAGES)
    ]
    written = draw(st.lists(st.tuples(st.integers(0, PAGES - 1), st.integers(1, 40)), max_size=4))
    lost = draw(st.lists(st.integers(0, PAGES - 1), max_size=2))
    reads = []
    nxt = draw(st.integers(0, PAGES - 1))
    for _ in range(draw(st.integers(1, 8))):
        # mostly sequential (the readahead's case), sometimes anywhere
        first = nxt if draw(st.integers(0, 3)) else draw(st.integers(0, PAGES - 1))
        count = min(draw(st.sampled_from([1, 1, 1, 2, 3, 4, 8, 20])), PAGES - first)
        nxt = (first + count) % PAGES
        reads.append(
            {
                "first": first,
                "count": count,
                "hello": draw(st.integers(0, 9)) > 0,
                "max_batch": draw(st.sampled_from([64] * 6 + [2, 3])),
                "closed": draw(st.integers(0, 19)) == 0,
                "pending_write": draw(st.integers(0, 9)) == 0,
                "answers": draw(st.lists(ANSWERS, min_size=4, max_size=4)),
                "answer_now": draw(st.booleans()),
                "run_due_first": draw(st.booleans()),
            }
        )
    return {
        "nclients": nclients,
        "placement": placement,
        "written": written,
        "lost": lost,
        "reads": reads,
    }


def _outcome(x: object) -> object:
    if x is None:
        return None
    if isinstance(x, BaseException):
        return (type(x).__name__, str(x))
    if isinstance(x, memoryview):  # answered from a readahead window: its bytes
        return ("view", _digest(x))
    x.close()  # a coroutine: the general path would continue it
    return "continues"


async def _run_async(path_type: type, sc: dict) -> list:
    log: list = []
    clients = [_Client(f"m{i}", log) for i in range(sc["nclients"])]
    table = SlabTable(PAGES, SLAB_PAGES, clients)  # type: ignore[arg-type]
    rep = Replication(table, clients, 2, random.Random(0))  # type: ignore[arg-type]
    rep.begin(sc["placement"], [0] * len(clients))
    reads = RemoteReads(rep, 0.0)
    fast = path_type(reads)
    for first, count in sc["written"]:
        count = min(count, PAGES - first)
        data = b"".join(_page(p) for p in range(first, first + count))
        table.mark_stored(first, count, memoryview(data), None)
    for p in sc["lost"]:
        table.mark_lost(p, 1)

    async def answer(r: dict, pending: bytes | None) -> None:
        """Answer every LOAD waiting (readahead windows too), in client order, each with the
        next answer of this read's list; then let the due fetches run."""
        if r["run_due_first"]:
            await asyncio.sleep(0)
        k = 0
        for c in clients:
            waiting, c.waiting = c.waiting, []
            for keys, out, cb in waiting:
                kind = r["answers"][k % len(r["answers"])]
                k += 1
                if kind == "silent":
                    c.waiting.append((keys, out, cb))  # answered by a later read's turn
                    continue
                cb(_answer(kind, keys, out, pending))
        await asyncio.sleep(0)

    for i, r in enumerate(sc["reads"]):
        for c in clients:
            c.hello, c.max_batch = (True if r["hello"] else None), r["max_batch"]
        rep.open = not r["closed"]
        pending = None
        token = None
        if r["pending_write"]:  # a replicated write of the read's first page in flight
            pending = _page(r["first"], 1)
            token = table.write_started(r["first"], 1, memoryview(pending))
        out = memoryview(bytearray(b"\xee" * (r["count"] * PS)))

        def done(tag: object, cont: object, out: memoryview = out) -> None:
            log.append(("done", tag, _outcome(cont), _digest(out)))

        try:
            taken = fast.start_read(r["first"] * PS, out, done, i)
        except Exception as e:
            taken = (type(e).__name__, str(e))
        log.append(("taken", i, taken))
        if r["answer_now"]:
            await answer(r, pending)
        if token is not None:
            table.write_ended(token)
        log.append(
            (
                "after",
                i,
                [(w.first, w.count, w.ready, len(w.waiters)) for w in reads.readahead.windows],
                reads.readahead.next_page,
                reads.counters.snapshot(),
                reads.readahead.counters.snapshot(),
                bytes(table.state),
                [len(c.waiting) for c in clients],
            )
        )
    last = {"answers": ["good"], "run_due_first": False}
    for _ in range(3):  # whatever is still waiting, answered with its bytes
        await answer(last, None)
    log.append(("end", [len(c.waiting) for c in clients], reads.counters.snapshot()))
    return log


def _run(path_type: type, sc: dict) -> list:
    return asyncio.run(_run_async(path_type, sc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_compiled_read_path_does_what_the_reference_does(sc: dict) -> None:
    assert compiled is not None
    assert _run(compiled.ReadFastPath, sc) == _run(remote_read.ReadFastPath, sc)


def _one(first: int, count: int, answers: list[str], **kw: Any) -> dict:
    read = {
        "first": first,
        "count": count,
        "hello": True,
        "max_batch": 64,
        "closed": False,
        "pending_write": False,
        "answers": answers,
        "answer_now": True,
        "run_due_first": False,
    }
    read.update(kw)
    return {
        "nclients": 2,
        "placement": [[0, 1]] * (PAGES // SLAB_PAGES),
        "written": [(0, 40)],
        "lost": [],
        "reads": [read],
    }


def test_both_paths_load_from_the_preferred_replica_and_check_every_page() -> None:
    """The common read itself, on each path, so a rule broken on both alike still fails."""
    assert compiled is not None
    for path_type in (compiled.ReadFastPath, remote_read.ReadFastPath):
        log = _run(path_type, _one(3, 2, ["good"]))
        assert [e for e in log if e[0] == "load_cb"] == [("load_cb", "m0", 3, 2)]
        assert ("taken", 0, True) in log
        want = _digest(_page(3) + _page(4))
        assert [e for e in log if e[0] == "done"] == [("done", 0, None, want)]
        counters = next(e for e in log if e[0] == "after")[4]
        assert counters["loads"] == 1 and counters["pages_loaded"] == 2

        # a page that fails its checksum: the general path judges the replicas
        log = _run(path_type, _one(3, 2, ["corrupt"]))
        assert [e[2] for e in log if e[0] == "done"] == ["continues"]

        # never written: the coroutine path answers zeros, nothing is loaded
        log = _run(path_type, _one(60, 1, ["good"]))
        assert ("taken", 0, False) in log and not [e for e in log if e[0] == "load_cb"]


def test_reads_take_the_chosen_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RemoteReads` builds its fast path through `read_path_type`: the reference when
    DUVM_PURE_PYTHON is set, else the compiled twin."""
    rep = Replication(SlabTable(PAGES, SLAB_PAGES, []), [], 1, random.Random(0))
    monkeypatch.setenv(accel.ENV, "1")
    assert type(RemoteReads(rep, 0.0).fast) is remote_read.ReadFastPath
    monkeypatch.delenv(accel.ENV)
    assert type(RemoteReads(rep, 0.0).fast) is compiled.ReadFastPath
