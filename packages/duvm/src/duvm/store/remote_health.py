"""The health of a `RemoteStore`: its watchdog, its periodic log summary and its report.

- The watchdog aborts connections whose requests made no progress for `op_timeout` seconds (a
  cut link or a frozen memserver), so a write is not held hostage by one replica: the aborted
  replica is dropped and the survivors acknowledge. It probes peers whose connection dropped,
  one at a time and off the I/O path, and treats a peer whose breaker is open as failed: its
  slabs become degraded at once, so repair starts even if no write happens to notice.
- Failover messages are logged once per kind (`QuietLog`); the watchdog flushes the counted
  repeats every `summary_every` seconds, with one line while slabs are degraded or lost.
- `health()` is the JSON-ready report behind `duvm status` and the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from duvm.base.quietlog import QuietLog
from duvm.store.memclient import MemClient
from duvm.store.repair import Repairer, SlabRepair
from duvm.store.slab_table import SlabTable
from duvm.store.storage import DATA, LOST

log = logging.getLogger(__name__)

DEFAULT_SUMMARY_EVERY = 30.0  # seconds between failover summaries in the log
DEFAULT_OP_TIMEOUT = 5.0  # seconds without progress before a memserver connection is dropped


class RemoteHealth:
    """The health part of `RemoteStore` (a mixin: these are the parts of the store it uses)."""

    table: SlabTable
    clients: list[MemClient]
    replicas: int
    repairs: dict[int, SlabRepair]
    repairer: Repairer | None
    reserved: list[int]
    stats: dict[str, int]
    events: QuietLog
    op_timeout: float
    summary_every: float
    _probes: set[asyncio.Task]
    _was_degraded: bool
    drop_replica: Callable[[int, int, str], bool]

    def degraded_slabs(self) -> list[int]:
        """Slabs with fewer live replicas than wanted."""
        return self.table.degraded_slabs(self.replicas)

    def pages_per_peer(self) -> list[int]:
        """Written pages held by each peer (a page counts once per replica)."""
        return self.table.pages_per_peer()

    async def _watchdog(self) -> None:
        period = max(0.05, self.op_timeout / 4)
        probes = self._probes
        next_summary = time.monotonic() + self.summary_every
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now >= next_summary:
                next_summary = now + self.summary_every
                self.log_summary()
            for i, c in enumerate(self.clients):
                stalled = c.stalled_for(now)
                if stalled > self.op_timeout:
                    self.stats["stalls_aborted"] += 1
                    c.abort(f"no reply for {stalled:.1f} s")
                if c.connected:
                    continue
                if c.circuit_open:
                    for slab, members in enumerate(self.table.sets):
                        if i in members:
                            self.drop_replica(slab, i, "its memserver is unreachable")
                elif not probes:  # one reconnect attempt at a time, off the I/O path
                    t = asyncio.ensure_future(c.probe())
                    probes.add(t)
                    t.add_done_callback(probes.discard)

    def log_summary(self) -> None:
        """The counted repeats since the last summary, and one line while degraded or lost."""
        self.events.flush()
        degraded = len(self.degraded_slabs())
        lost = self.table.state.count(LOST)
        if degraded or lost:
            self._was_degraded = True
            log.warning(
                "degraded: %d of %d slabs below %d replicas, %d repairing, %d pages "
                "lost (reads of them fail with EIO)",
                degraded,
                self.table.nslabs,
                self.replicas,
                len(self.repairs),
                lost,
            )
        elif self._was_degraded:
            self._was_degraded = False
            log.warning("every slab has %d replicas again", self.replicas)

    def health(self) -> dict:
        """Replication state for `duvm status` and metrics (JSON-ready), with each peer's
        written pages."""
        t = self.table
        degraded = self.degraded_slabs()
        per_peer = [0] * len(self.clients)
        for m in t.sets:
            for i in m:
                per_peer[i] += 1
        pages = t.pages_per_peer()
        rep = self.repairer
        return {
            "replicas": self.replicas,
            "slabs": t.nslabs,
            "slab_pages": t.slab_pages,
            "degraded_slabs": len(degraded),
            "degraded": degraded[:32],
            "repairing": [
                {
                    "slab": s,
                    "target": self.clients[r.target].peer,
                    "copied_pages": r.copied,
                    "total_pages": r.total,
                }
                for s, r in self.repairs.items()
            ],
            "repair": rep.stats if rep is not None else None,
            "pages_written": t.state.count(DATA),
            "pages_lost_now": t.state.count(LOST),
            **self.stats,
            "peers": [
                {
                    "peer": c.peer,
                    "connected": c.connected,
                    "circuit_open": c.circuit_open,
                    "consecutive_failures": c.failures,
                    "breaker_trips": c.breaker_trips,
                    "namespace_losses": c.namespace_losses,
                    "slabs": per_peer[i],
                    "reserved_pages": self.reserved[i],
                    "pages": pages[i],
                }
                for i, c in enumerate(self.clients)
            ],
        }
