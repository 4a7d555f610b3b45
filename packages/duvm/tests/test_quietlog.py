"""The daemon's logging: records leave through a writer thread (a blocked log file never stops
the caller), a full queue drops and counts, and repeated failover events become one line plus
a count. The failover case runs over real memservers on loopback."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import threading
import time

import pytest
from duvm.base import quietlog
from duvm.store.remote_store import RemoteStore

MiB = 1 << 20


class BlockedStream(io.StringIO):
    """A log file whose write waits until released: a tmpfs page being swapped back in."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, s: str) -> int:
        self.entered.set()
        self.release.wait(30)
        return super().write(s)


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_a_blocked_log_file_never_blocks_the_logging_caller(restore_root_logging) -> None:
    """Catches logging straight to the file from the event loop: a daemon whose log write
    waits for a swap-in it alone could serve would hang the node."""
    stream = BlockedStream()
    listener = quietlog.start_background(logging.INFO, "%(message)s", stream, capacity=50)
    log = logging.getLogger("duvm.test")
    log.warning("first")
    assert stream.entered.wait(10)  # the writer thread is now stuck in write()
    done = threading.Event()

    def caller() -> None:
        for i in range(500):  # far more than the queue holds
            log.warning("line %d", i)
        done.set()

    t = threading.Thread(target=caller, daemon=True)
    t.start()
    assert done.wait(10), "logging blocked while the log file's write was stuck"
    stream.release.set()
    listener.stop()
    text = stream.getvalue()
    assert text.startswith("first\n")
    assert "log record(s) dropped" not in text  # nothing was logged after the drops...
    handler = logging.getLogger().handlers[0]
    assert handler.dropped > 400  # ...so they are still counted, not lost silently
    assert 40 <= text.count("line ") <= 51  # what the bounded queue held


def test_lines_aside_never_block_the_caller_and_keep_their_order() -> None:
    """Catches a daemon that prints its "serving" line from the event loop: a restarted
    daemon's stdout is a file on /run whose page was out on the dead device, and the loop
    stopped in that write and never answered its handshake (QEMU guest, 256 MiB RDMA)."""
    out = BlockedStream()
    aside = quietlog.Aside(out)
    t = time.monotonic()
    aside.write("duvm daemon metrics on http://127.0.0.1:1/metrics")
    aside.write("duvm daemon serving export ''")
    assert out.entered.wait(5)
    assert time.monotonic() - t < 1.0  # returned while the write waits
    assert out.getvalue() == ""
    out.release.set()
    deadline = time.monotonic() + 5
    while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.getvalue() == (
        "duvm daemon metrics on http://127.0.0.1:1/metrics\nduvm daemon serving export ''\n"
    )


def test_dropped_records_are_counted_in_the_next_line(restore_root_logging) -> None:
    stream = BlockedStream()
    listener = quietlog.start_background(logging.INFO, "%(message)s", stream, capacity=5)
    log = logging.getLogger("duvm.test")
    log.warning("a")
    assert stream.entered.wait(10)
    for i in range(20):
        log.warning("b%d", i)
    stream.release.set()
    deadline = time.monotonic() + 10
    while not listener.queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    log.warning("after")
    listener.stop()
    lines = stream.getvalue().splitlines()
    assert lines[-1] == "after"
    dropped = [ln for ln in lines if "log record(s) dropped" in ln]
    assert len(dropped) == 1 and int(dropped[0].split()[0]) >= 14


def test_quietlog_logs_the_first_of_a_kind_then_one_count(caplog) -> None:
    now = [100.0]
    q = quietlog.QuietLog(logging.getLogger("duvm.test.q"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "duvm.test.q"):
        assert q.event(("drop", 1), logging.WARNING, "dropped on %s", "peer-a")
        for _ in range(340):
            assert not q.event(("drop", 1), logging.WARNING, "dropped on %s", "peer-a")
        assert q.event(("drop", 2), logging.WARNING, "dropped on %s", "peer-b")
        now[0] += 30
        assert q.flush() == 1  # peer-b had no repeats
        assert q.flush() == 0
        assert q.event(("drop", 1), logging.WARNING, "dropped on %s", "peer-a")  # anew
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "dropped on peer-a",
        "dropped on peer-b",
        "dropped on peer-a (and 340 more like it in 30 s)",
        "dropped on peer-a",
    ]


async def test_a_lost_memserver_logs_one_line_and_a_summary_not_one_per_slab(
    memserver_pool, caplog
) -> None:
    """Catches the per-slab failover log: one memserver loss on a 512 MiB device wrote 341
    near-identical lines to a tmpfs log while the node was short of memory."""
    srvs, addrs = await memserver_pool(2, 8 * MiB)
    store = await RemoteStore.open(
        addrs, 4 * MiB, "t:quiet:1", replicas=2, slab_pages=16, op_timeout=0.4, repair=False, seed=1
    )
    store.monitor.summary_every = 3600  # the test calls the summary itself
    try:
        await store.write(0, memoryview(os.urandom(4 * MiB)))
        with caplog.at_level(logging.WARNING, "duvm"):
            await srvs[1].close()
            deadline = time.monotonic() + 20
            while store.health()["degraded_slabs"] < store.table.nslabs:
                assert time.monotonic() < deadline, "the dead peer's slabs never degraded"
                await asyncio.sleep(0.05)
            drops = [r for r in caplog.records if "dropping copies" in r.getMessage()]
            assert store.table.nslabs == 64 and len(drops) == 1
            store.monitor.log_summary()
        msgs = [r.getMessage() for r in caplog.records]
        assert any("(and 63 more like it" in m for m in msgs), msgs
        assert any(m.startswith("degraded: 64 of 64 slabs below 2 replicas") for m in msgs)
        assert store.counters()["replicas_dropped"] == 64
    finally:
        await store.close()
