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
from dataclasses import dataclass

from duvm.store.counters import Counters
from duvm.store.repair import Repairer
from duvm.store.replication import Replication
from duvm.store.storage import DATA, LOST, ReplicationHealth

log = logging.getLogger(__name__)

DEFAULT_SUMMARY_EVERY = 30.0  # seconds between failover summaries in the log
DEFAULT_OP_TIMEOUT = 5.0  # seconds without progress before a memserver connection is dropped


@dataclass(slots=True)
class HealthCounters(Counters):
    stalls_aborted: int = 0


class RemoteHealth:
    """The watchdog, log summary and health report of a `RemoteStore` over `replication`."""

    def __init__(
        self,
        replication: Replication,
        *,
        op_timeout: float = DEFAULT_OP_TIMEOUT,
        summary_every: float = DEFAULT_SUMMARY_EVERY,
    ) -> None:
        self.replication = replication
        self.op_timeout = op_timeout
        self.summary_every = summary_every
        self.repairer: Repairer | None = None  # set when the store repairs
        self.counters = HealthCounters()
        self.probes: set[asyncio.Task] = set()  # background reconnect attempts
        self._was_degraded = False

    async def watchdog(self) -> None:
        """Runs until cancelled: stalled connections aborted, dropped peers probed."""
        r = self.replication
        period = max(0.05, self.op_timeout / 4)
        probes = self.probes
        next_summary = time.monotonic() + self.summary_every
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now >= next_summary:
                next_summary = now + self.summary_every
                self.log_summary()
            for i, c in enumerate(r.clients):
                stalled = c.stalled_for(now)
                if stalled > self.op_timeout:
                    self.counters.stalls_aborted += 1
                    c.abort(f"no reply for {stalled:.1f} s")
                if c.connected:
                    continue
                if c.circuit_open:
                    for slab, members in enumerate(r.table.sets):
                        if i in members:
                            r.drop_replica(slab, i, "its memserver is unreachable")
                elif not probes:  # one reconnect attempt at a time, off the I/O path
                    t = asyncio.ensure_future(c.probe())
                    probes.add(t)
                    t.add_done_callback(probes.discard)

    def log_summary(self) -> None:
        """The counted repeats since the last summary, and one line while degraded or lost."""
        r = self.replication
        r.events.flush()
        degraded = len(r.degraded_slabs())
        lost = r.table.state.count(LOST)
        if degraded or lost:
            self._was_degraded = True
            log.warning(
                "degraded: %d of %d slabs below %d replicas, %d repairing, %d pages "
                "lost (reads of them fail with EIO)",
                degraded,
                r.table.nslabs,
                r.want,
                len(r.repairs),
                lost,
            )
        elif self._was_degraded:
            self._was_degraded = False
            log.warning("every slab has %d replicas again", r.want)

    def health(self) -> ReplicationHealth:
        """Replication state for `duvm status` and metrics (JSON-ready), with each peer's
        written pages. The counters are not here: `BlockStore.counters()` has them."""
        r = self.replication
        t = r.table
        degraded = r.degraded_slabs()
        per_peer = [0] * len(r.clients)
        for m in t.sets:
            for i in m:
                per_peer[i] += 1
        pages = t.pages_per_peer()
        return {
            "replicas": r.want,
            "slabs": t.nslabs,
            "slab_pages": t.slab_pages,
            "degraded_slabs": len(degraded),
            "degraded": degraded[:32],
            "repairing": [
                {
                    "slab": s,
                    "target": r.clients[copy.target].peer,
                    "copied_pages": copy.copied,
                    "total_pages": copy.total,
                }
                for s, copy in r.repairs.items()
            ],
            "pages_written": t.state.count(DATA),
            "pages_lost_now": t.state.count(LOST),
            "peers": [
                {
                    "peer": c.peer,
                    "connected": c.connected,
                    "circuit_open": c.circuit_open,
                    "consecutive_failures": c.failures,
                    "breaker_trips": c.breaker_trips,
                    "namespace_losses": c.namespace_losses,
                    "transport": c.transport,  # asked for: tcp, rdma or auto
                    "transport_in_use": c.transport_in_use,  # rdma or tcp; None unconnected
                    "rdma_device": c.rdma_device,
                    "rdma_error": c.rdma_error,
                    "slabs": per_peer[i],
                    "reserved_pages": r.reserved[i],
                    "pages": pages[i],
                }
                for i, c in enumerate(r.clients)
            ],
        }
