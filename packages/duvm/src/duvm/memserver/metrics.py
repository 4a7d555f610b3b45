"""The memserver's Prometheus metrics (`duvm memserver --metrics`): its arena, namespaces,
requests and security events, read at scrape time through `MemServer.usage()` and
`MemServer.counters` on its loop, and the per-frame service time (`MEMSERVER_KINDS`). The
histograms, the loop hand-off and the endpoint are `duvm.base.metrics`'.

Memserver latency is service time inside the server (decode to reply queued), per frame,
labelled by request kind; network time is not in it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from duvm.base.metrics import LatencyByKind, counter, gauge, on_loop, snapshot_ok, start_for_loop
from duvm.memserver.pagestore import StoreUsage
from duvm.memserver.server import MemServer
from duvm.wire import pageproto as pp
from duvm.wire.pageproto import PAGE_SIZE

MEMSERVER_KINDS = {
    int(pp.MsgType.STORE): "store",
    int(pp.MsgType.LOAD): "load",
    int(pp.MsgType.FREE): "free",
}


class MemserverCollector(Collector):
    """Metric families of one `MemServer` (duvm.memserver.server), read on its loop at scrape
    time."""

    def __init__(
        self, server: MemServer, loop: asyncio.AbstractEventLoop | None, latency: LatencyByKind
    ) -> None:
        self.server, self.loop, self.latency = server, loop, latency
        self.thread = threading.current_thread()  # built on the loop's thread

    def _snapshot(self) -> tuple[StoreUsage, dict[str, int]]:
        return self.server.usage(), dict(self.server.counters)

    def collect(self) -> Iterator[Metric]:
        snap = on_loop(self.loop, self._snapshot, self.thread)
        yield snapshot_ok(snap is not None, "server")
        yield self.latency.family(
            "duvm_memserver_request",
            "Service time of page requests inside the memserver, per frame",
        )
        if snap is None:
            return
        use, security = snap
        p = PAGE_SIZE
        yield from gauge(
            "duvm_memserver_capacity_bytes", "Preallocated arena size", use.capacity_pages * p
        )
        yield from gauge(
            "duvm_memserver_used_bytes", "Arena bytes holding pages", use.used_pages * p
        )
        yield from gauge(
            "duvm_memserver_reserved_bytes",
            "Arena bytes promised to clients",
            use.reserved_pages * p,
        )
        yield from gauge(
            "duvm_memserver_arena_locked",
            "1 if the arena is locked in RAM",
            1 if use.arena_locked else 0,
        )
        yield from gauge("duvm_memserver_connections", "Open client connections", use.connections)
        stored = GaugeMetricFamily(
            "duvm_memserver_namespace_stored_pages",
            "Pages stored for a client namespace",
            labels=["client_id"],
        )
        reserved = GaugeMetricFamily(
            "duvm_memserver_namespace_reserved_pages",
            "Pages reserved by a client namespace",
            labels=["client_id"],
        )
        conns = GaugeMetricFamily(
            "duvm_memserver_namespace_connections",
            "Connections attached to a namespace (0: in its lease)",
            labels=["client_id"],
        )
        for ns in use.namespaces:
            stored.add_metric([ns.client_id], ns.stored_pages)
            reserved.add_metric([ns.client_id], ns.reserved_pages)
            conns.add_metric([ns.client_id], ns.connections)
        yield from (stored, reserved, conns)
        c = use.counters
        req = CounterMetricFamily("duvm_memserver_requests", "Page requests served", labels=["op"])
        pages = CounterMetricFamily(
            "duvm_memserver_pages", "Pages moved by requests", labels=["op"]
        )
        for op, done in (("store", "stored"), ("load", "loaded"), ("free", "freed")):
            if f"{op}_requests" in c:
                req.add_metric([op], c[f"{op}_requests"])
            if f"pages_{done}" in c:
                pages.add_metric([op], c[f"pages_{done}"])
        yield from (req, pages)
        yield from counter(
            "duvm_memserver_refused",
            "Requests refused (no room, no reservation, unknown page)",
            c.get("refused"),
        )
        if security:
            events = CounterMetricFamily(
                "duvm_memserver_security_events",
                "Authentication and connection-limit events",
                labels=["event"],
            )
            for k, v in sorted(security.items()):
                events.add_metric([k], v)
            yield events


def start(server: MemServer, listen: str) -> tuple[str, int]:
    """Serve `server`'s metrics on `listen` (on the running loop) and start observing its
    per-frame latency; the bound address. OSError when `listen` cannot be bound."""
    latency, bound = start_for_loop(
        lambda loop, lat: MemserverCollector(server, loop, lat), MEMSERVER_KINDS, listen
    )
    server.time_requests(latency)
    return bound
