"""The replicated write's compiled fast path (`duvm.store._fanout.WriteFanOut`) against the
reference (`duvm.store.remote_write.WriteFanOut`): differential.

Each path gets its own real `SlabTable`, `Replication` and `RemoteWrites` over the same scripted
memory clients, and the same writes drawn by Hypothesis: any page and length (within one slab
or across two), replicas connected or not, by TCP (the STORE goes straight into the client's
send queue) or by RDMA (through its `store_cb`, which may decline at the last moment), a
batch limit below the write, a repair copying the slab, the export not open, and each
replica's answer (stored, unreachable, refused for space, a bug) in any order, with the
checksum callback run before or after them, and `on_change` (the readahead's hook) failing.
Every return value, every STORE handed to a client (keys and bytes), every completion (its
outcome, or that the general path continues it), the page table's state and checksums, the
in-flight counters, the writes registered for racing reads and the counters must be the same.
Without the compiled module these tests skip, except where DUVM_REQUIRE_COMPILED=1 (CI) makes
that a failure.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from crc32c import crc32c
from duvm.base import accel
from duvm.store import remote_write
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.remote_write import RemoteWrites
from duvm.store.replication import Replication
from duvm.store.slab_table import SlabTable
from duvm.wire.pageproto import ErrorCode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
PAGES, SLAB_PAGES = 64, 16
BUILT = accel.state("duvm.store._fanout")
compiled = importlib.import_module("duvm.store._fanout") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
pytestmark = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")


class _Loop:
    def __init__(self, log: list) -> None:
        self.log = log
        self.soon: list = []

    def call_soon(self, fn: Any) -> None:
        self.log.append(("call_soon",))
        self.soon.append(fn)


class _Queue:
    """A memory client's send queue: its `store_cb` records the STORE and keeps the
    completion for the test to call."""

    def __init__(self, client: _Client) -> None:
        self.client = client

    def store_cb(self, keys: tuple[int, ...], data: memoryview, cb: Any) -> None:
        c = self.client
        c.log.append(("queue.store_cb", c.peer, keys, _digest(data)))
        c.waiting.append(cb)


@dataclass(eq=False)
class _Client:
    """A memory client as the fan-out sees it: connected or not, by TCP (`rdma` None: its
    `queue`) or RDMA, its batch limit, and a `store_cb` that records the STORE and keeps the
    completion for the test to call."""

    peer: str
    log: list
    loop: _Loop
    hello: object | None = True
    rdma: object | None = None
    max_batch: int = 64
    declines: bool = False  # store_cb finds the connection gone at the last moment
    waiting: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.queue = _Queue(self)

    def store_cb(self, keys: tuple[int, ...], data: memoryview, cb: Any) -> bool:
        self.log.append(("store_cb", self.peer, keys, _digest(data)))
        if self.declines:
            return False
        self.waiting.append(cb)
        return True


def _digest(b: memoryview | bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:16]  # every byte compared, a short line printed


def _outcome(x: object) -> object:
    if x is None:
        return None
    if isinstance(x, BaseException):
        return (type(x).__name__, str(x))
    x.close()  # a coroutine: the general path would continue it
    return "continues"


ANSWERS = st.sampled_from(["stored"] * 6 + ["unreachable", "no_space", "bug"])


def _answer(kind: str) -> BaseException | None:
    return {
        "stored": None,
        "unreachable": MemserverUnreachable("gone"),
        "no_space": PageServerError(ErrorCode.NO_SPACE, "full"),
        "bug": RuntimeError("a bug"),
    }[kind]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    nclients = draw(st.integers(2, 3))
    placement = [
        draw(st.lists(st.integers(0, nclients - 1), min_size=1, max_size=nclients, unique=True))
        for _ in range(PAGES // SLAB_PAGES)
    ]
    writes = []
    for _ in range(draw(st.integers(1, 6))):
        first = draw(st.integers(0, PAGES - 1))
        count = draw(st.sampled_from([1, 1, 1, 2, 3, 8, 20]))
        count = min(count, PAGES - first)
        writes.append(
            {
                "first": first,
                "count": count,
                "fill": draw(st.binary(min_size=8, max_size=8)),
                "hello": [draw(st.integers(0, 9)) > 0 for _ in range(nclients)],
                "rdma": [draw(st.integers(0, 3)) == 0 for _ in range(nclients)],
                "declines": [draw(st.integers(0, 9)) == 0 for _ in range(nclients)],
                "max_batch": [draw(st.sampled_from([64] * 7 + [2])) for _ in range(nclients)],
                "repairing": draw(st.integers(0, 9)) == 0,
                "closed": draw(st.integers(0, 19)) == 0,
                "answers": draw(st.lists(ANSWERS, min_size=3, max_size=3)),
                "order": draw(st.permutations(range(nclients))),
                "crcs_first": draw(st.booleans()),
                "on_change_fails": draw(st.integers(0, 9)) == 0,
            }
        )
    return {"nclients": nclients, "placement": placement, "writes": writes}


def _run(fan_out_type: type, sc: dict) -> list:
    log: list = []
    loop = _Loop(log)
    clients = [_Client(f"m{i}", log, loop) for i in range(sc["nclients"])]
    table = SlabTable(PAGES, SLAB_PAGES, clients)  # type: ignore[arg-type]
    rep = Replication(table, clients, 2, random.Random(0))  # type: ignore[arg-type]
    rep.begin(sc["placement"], [0] * len(clients))
    writes = RemoteWrites(rep, 0.0)
    fan = fan_out_type(writes)
    for i, w in enumerate(sc["writes"]):
        for c, hello, rdma, declines, mb in zip(
            clients, w["hello"], w["rdma"], w["declines"], w["max_batch"], strict=True
        ):
            c.hello, c.declines, c.max_batch = (True if hello else None), declines, mb
            c.rdma = "link" if rdma else None
        rep.repairs = {w["first"] // SLAB_PAGES: object()} if w["repairing"] else {}
        rep.open = not w["closed"]

        def on_change(first: int, count: int, fails: bool = w["on_change_fails"]) -> None:
            log.append(("on_change", first, count))
            if fails:
                raise RuntimeError("on_change failed")

        table.on_change = on_change

        def done(tag: object, cont: object) -> None:
            log.append(("done", tag, _outcome(cont)))

        try:
            data = memoryview(w["fill"] * (w["count"] * PS // 8))
            taken = fan.start_write(w["first"] * PS, data, done, i)
        except Exception as e:
            taken = (type(e).__name__, str(e))
        log.append(("taken", taken))
        log.append(
            ("pending_writes", [(f, n, _digest(d)) for f, n, d in table.pending_writes.values()])
        )
        if w["crcs_first"]:
            for fn in loop.soon:
                fn()
            loop.soon.clear()
        for k in w["order"]:
            for cb in clients[k].waiting:
                cb(_answer(w["answers"][k]))
            clients[k].waiting.clear()
        for fn in loop.soon:
            fn()
        loop.soon.clear()
        log.append(
            (
                "after",
                bytes(table.state),
                list(table.crc),
                list(table.inflight),
                len(table.pending_writes),
                writes.counters.snapshot(),
            )
        )
    return log


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_compiled_fan_out_does_what_the_reference_does(sc: dict) -> None:
    assert compiled is not None
    assert _run(compiled.WriteFanOut, sc) == _run(remote_write.WriteFanOut, sc)


def test_both_paths_store_on_every_replica_and_acknowledge_once_all_stored() -> None:
    """The common write itself, on each path, so a rule broken on both alike still fails."""
    assert compiled is not None
    sc = {
        "nclients": 2,
        "placement": [[0, 1]] * (PAGES // SLAB_PAGES),
        "writes": [
            {
                "first": 3,
                "count": 2,
                "fill": b"\x5a" * 8,
                "hello": [True, True],
                "rdma": [False, True],
                "declines": [False, False],
                "max_batch": [64, 64],
                "repairing": False,
                "closed": False,
                "answers": ["stored", "stored", "stored"],
                "order": [1, 0],
                "crcs_first": True,
                "on_change_fails": False,
            }
        ],
    }
    for fan_out_type in (compiled.WriteFanOut, remote_write.WriteFanOut):
        log = _run(fan_out_type, sc)
        stores = [e for e in log if e[0] in ("store_cb", "queue.store_cb")]
        assert stores == [  # by TCP into m0's send queue, by RDMA through m1's store_cb
            ("queue.store_cb", "m0", (3, 4), _digest(b"\x5a" * (2 * PS))),
            ("store_cb", "m1", (3, 4), _digest(b"\x5a" * (2 * PS))),
        ]
        assert ("taken", True) in log and (
            "pending_writes",
            [(3, 2, _digest(b"\x5a" * (2 * PS)))],
        ) in log
        assert [e for e in log if e[0] == "done"] == [("done", 0, None)]
        state, crc, inflight, pending, counters = log[-1][1:]
        assert state[3:5] == b"\x01\x01" and state.count(0) == PAGES - 2
        assert crc[3:5] == [crc32c(b"\x5a" * PS)] * 2
        assert inflight == [0] * (PAGES // SLAB_PAGES) and pending == 0
        assert counters["stores"] == 1 and counters["pages_stored"] == 2


def test_a_store_takes_the_chosen_fan_out(monkeypatch) -> None:
    """`RemoteWrites` builds its fast path through `fan_out_type`: the reference when
    DUVM_PURE_PYTHON is set, else the compiled twin."""
    rep = Replication(SlabTable(PAGES, SLAB_PAGES, []), [], 1, random.Random(0))
    monkeypatch.setenv(accel.ENV, "1")
    assert type(RemoteWrites(rep, 0.0).fan_out) is remote_write.WriteFanOut
    monkeypatch.delenv(accel.ENV)
    assert type(RemoteWrites(rep, 0.0).fan_out) is compiled.WriteFanOut
