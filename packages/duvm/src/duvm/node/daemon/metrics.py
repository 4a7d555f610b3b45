"""The daemon's Prometheus metrics (`duvm daemon --metrics`): the NBD server's counters, the
store's counters and replication health per peer, read at scrape time as one `DaemonStatus`
(`duvm.node.daemon.status`) on its loop, and the NBD request time per command (`NBD_KINDS`).
The histograms, the loop hand-off and the endpoint are `duvm.base.metrics`'.

Daemon latency is NBD request time (request decoded to reply queued), which includes the round
trips to the memservers. A value the daemon does not know (no replicas behind it, a counter no
layer keeps) is not exported, never exported as 0.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from duvm.base.metrics import LatencyByKind, counter, gauge, on_loop, snapshot_ok, start_for_loop
from duvm.node.daemon.nbdserver import NBDServer
from duvm.node.daemon.status import daemon_status
from duvm.wire import nbdconst as C

NBD_KINDS = {
    C.CMD_READ: "read",
    C.CMD_WRITE: "write",
    C.CMD_FLUSH: "flush",
    C.CMD_TRIM: "trim",
    C.CMD_WRITE_ZEROES: "write_zeroes",
}


_DAEMON_COUNTERS = (
    ("failovers", "duvm_daemon_failovers", "Reads served by another replica after one failed"),
    ("replicas_dropped", "duvm_daemon_replicas_dropped", "Replicas dropped from slabs"),
    ("checksum_failures", "duvm_daemon_checksum_failures", "Pages that failed their checksum"),
    ("pages_lost", "duvm_daemon_pages_lost", "Pages marked lost (reads return EIO)"),
    ("read_errors", "duvm_daemon_read_errors", "Reads that failed with an error"),
    ("write_errors", "duvm_daemon_write_errors", "Writes that failed with an error"),
    ("stalls_aborted", "duvm_daemon_stalls_aborted", "Memserver connections aborted as stalled"),
    ("tag_failures", "duvm_daemon_tag_failures", "Encrypted pages that failed authentication"),
    ("repairs_done", "duvm_daemon_repairs", "Slab repairs completed"),
    ("repair_failures", "duvm_daemon_repair_failures", "Slab repairs that failed"),
    ("repair_pages_copied", "duvm_daemon_repair_pages_copied", "Pages copied by repairs"),
)


class DaemonCollector(Collector):
    """Metric families of the daemon's `NBDServer` and its store, from its `DaemonStatus`."""

    def __init__(
        self, server: NBDServer, loop: asyncio.AbstractEventLoop | None, latency: LatencyByKind
    ) -> None:
        self.server, self.loop, self.latency = server, loop, latency
        self.thread = threading.current_thread()  # built on the loop's thread

    def collect(self) -> Iterator[Metric]:
        snap = on_loop(
            self.loop, lambda: daemon_status(self.server.store, self.server), self.thread
        )
        yield snapshot_ok(snap is not None, "daemon")
        yield self.latency.family(
            "duvm_daemon_nbd_request",
            "NBD request time in the daemon "
            "(decoded to reply queued), memserver round trips included",
        )
        if snap is None:
            return
        yield GaugeMetricFamily(
            "duvm_daemon_export_bytes", "Size of the NBD export", value=snap.size_bytes
        )
        yield from gauge(
            "duvm_daemon_nbd_connections", "Open NBD connections", snap.open_connections
        )
        nbd = snap.nbd
        if nbd is not None:
            yield CounterMetricFamily(
                "duvm_daemon_nbd_requests", "NBD requests received", value=nbd["requests"]
            )
            yield CounterMetricFamily(
                "duvm_daemon_nbd_errors", "NBD requests answered with an error", value=nbd["errors"]
            )
            yield CounterMetricFamily(
                "duvm_daemon_nbd_protocol_errors",
                "NBD connections dropped for breaking the protocol",
                value=nbd["protocol_errors"],
            )
        counters = snap.counters  # a counter the store does not keep is left out
        for key, name, doc in _DAEMON_COUNTERS:
            yield from counter(name, doc, counters.get(key))
        h = snap.replication
        if h is None:  # --memory: no pool, so nothing below is known
            return
        yield from gauge(
            "duvm_daemon_degraded_slabs",
            "Slabs with fewer live replicas than wanted",
            h["degraded_slabs"],
        )
        yield from gauge("duvm_daemon_slabs", "Slabs of the export", h["slabs"])
        yield from gauge("duvm_daemon_replicas", "Replicas wanted per slab", h["replicas"])
        yield from gauge(
            "duvm_daemon_repairs_in_progress", "Slabs being copied now", len(h["repairing"])
        )
        yield from gauge(
            "duvm_daemon_pages_written", "Export pages holding data", h["pages_written"]
        )
        up = GaugeMetricFamily(
            "duvm_daemon_peer_up", "1 if connected to the memserver", labels=["peer"]
        )
        circuit = GaugeMetricFamily(
            "duvm_daemon_peer_circuit_open",
            "1 while the breaker keeps requests away",
            labels=["peer"],
        )
        pages = GaugeMetricFamily(
            "duvm_daemon_peer_pages",
            "This node's written pages held by the memserver (per replica)",
            labels=["peer"],
        )
        reserved = GaugeMetricFamily(
            "duvm_daemon_peer_reserved_pages", "Pages reserved on the memserver", labels=["peer"]
        )
        slabs = GaugeMetricFamily(
            "duvm_daemon_peer_slabs", "Slabs with a replica on the memserver", labels=["peer"]
        )
        trips = CounterMetricFamily(
            "duvm_daemon_peer_breaker_trips", "Times the breaker opened", labels=["peer"]
        )
        transport = GaugeMetricFamily(
            "duvm_daemon_peer_transport",
            "1 for the transport the memserver's pages move by now (tcp or rdma)",
            labels=["peer", "transport"],
        )
        for p in h["peers"]:
            lbl = [p["peer"]]
            pages.add_metric(lbl, p["pages"])
            reserved.add_metric(lbl, p["reserved_pages"])
            slabs.add_metric(lbl, p["slabs"])
            trips.add_metric(lbl, p["breaker_trips"])
            up.add_metric(lbl, 1 if p["connected"] else 0)
            circuit.add_metric(lbl, 1 if p["circuit_open"] else 0)
            if p["transport_in_use"] is not None:  # unconnected: no transport in use
                transport.add_metric([*lbl, p["transport_in_use"]], 1)
        yield from (up, circuit, pages, reserved, slabs, trips, transport)


def start(server: NBDServer, listen: str) -> tuple[str, int]:
    """Serve `server`'s metrics on `listen` (on the running loop) and start observing its
    request times; the bound address. OSError when `listen` cannot be bound."""
    latency, bound = start_for_loop(
        lambda loop, lat: DaemonCollector(server, loop, lat), NBD_KINDS, listen
    )
    server.time_requests(latency)
    return bound
