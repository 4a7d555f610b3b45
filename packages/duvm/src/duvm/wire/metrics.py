"""Prometheus metrics of the memserver and the daemon (`--metrics HOST:PORT`).

Theory of operation
-------------------
Nothing here runs unless `--metrics` is given. Then `prometheus_client.start_http_server`
serves `/metrics` from its own thread, and a custom `Collector` builds the metric families at
scrape time, so gauges and counters cost the hot path nothing: they are read from the state the
servers keep anyway (`PageStore`, `MemServer.counters`, `NBDServer.stats`,
`BlockStore.counters()` and `health()`).

That state belongs to the asyncio loop, which mutates it between awaits, so a scrape never
reads it from the HTTP thread: `_on_loop` hands a snapshot function to the loop
(`call_soon_threadsafe`) and waits for its result (at most `SNAPSHOT_TIMEOUT_S`; a loop that
does not answer yields a scrape with only the latency histograms and
`duvm_scrape_snapshot_ok 0`, never invented values).

Request latencies are the one thing observed on the hot path. `prometheus_client.Histogram`
takes a lock and walks its buckets in Python per observation (about 1-2 us); `LatencyHistogram`
is a bisect over integer nanosecond bounds and two increments, with no lock: every
observation happens on the loop thread, and a scrape copies the counts (a list copy is atomic
under the GIL; the sum may lag the counts by the observations of one loop iteration). Its
cost per request is measured by `benchmarks/duvm_metrics_overhead.py`.

What the metrics mean:

* memserver latency is service time inside the server (decode to reply queued), per frame,
  labelled by request kind; network time is not in it.
* daemon latency is NBD request time (request decoded to reply queued), which includes the
  round trips to the memservers.
* A value the process does not know (no RemoteStore behind the daemon, a field an older
  store lacks) is not exported, never exported as 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from duvm.base.units import parse_listen
from duvm.wire import nbdconst as C
from duvm.wire import pageproto as pp
from duvm.wire.pageproto import PAGE_SIZE  # the one definition: the wire's page
from duvm.wire.poolstats import daemon_snapshot

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 2.0
# Upper bounds in seconds: 10 us .. 2.5 s, fine where the fault path lives (tens of us).
LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


def _cumulative(
    bounds_ns: list[int], counts: list[int], sum_ns: int
) -> tuple[list[tuple[str, float]], float]:
    """Prometheus buckets (cumulative, ending with +Inf) and the sum in seconds."""
    counts = list(counts)  # one atomic copy: the loop thread may be counting meanwhile
    out, acc = [], 0
    for bound, n in zip(bounds_ns, counts, strict=False):
        acc += n
        out.append((repr(bound / 1e9), float(acc)))
    out.append(("+Inf", float(acc + counts[-1])))
    return out, sum_ns / 1e9


def _bounds_ns(bounds_s: Iterable[float]) -> list[int]:
    return [round(b * 1e9) for b in bounds_s]


class LatencyHistogram:
    """One histogram of durations in nanoseconds; observe from one thread."""

    __slots__ = ("_bounds_ns", "counts", "sum_ns")

    def __init__(self, bounds_s: Iterable[float] = LATENCY_BOUNDS_S) -> None:
        self._bounds_ns = _bounds_ns(bounds_s)
        self.counts = [0] * (len(self._bounds_ns) + 1)  # last: above every bound (+Inf)
        self.sum_ns = 0

    def observe_ns(self, ns: int) -> None:
        self.counts[bisect_left(self._bounds_ns, ns)] += 1  # first bound >= ns: "le" semantics
        self.sum_ns += ns

    def buckets(self) -> tuple[list[tuple[str, float]], float]:
        return _cumulative(self._bounds_ns, self.counts, self.sum_ns)


class LatencyByKind:
    """One histogram per request kind (an int code), named for the label. `observe_ns` is
    the hot-path call: one method call, one dict lookup, one bisect (measured in
    benchmarks/duvm_metrics_overhead.py); codes not in `kinds` are ignored."""

    __slots__ = ("_bounds", "_counts", "_sums", "names")

    def __init__(self, kinds: dict[int, str], bounds_s: Iterable[float] = LATENCY_BOUNDS_S) -> None:
        self.names = kinds
        self._bounds = _bounds_ns(bounds_s)
        self._counts = {code: [0] * (len(self._bounds) + 1) for code in kinds}
        self._sums = dict.fromkeys(kinds, 0)

    def observe_ns(self, code: int, ns: int) -> None:
        c = self._counts.get(code)
        if c is not None:
            c[bisect_left(self._bounds, ns)] += 1
            self._sums[code] += ns

    def count(self, code: int) -> int:
        return sum(self._counts[code])

    def family(self, name: str, doc: str, label: str = "op") -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=[label], unit="seconds")
        for code, counts in self._counts.items():
            buckets, total = _cumulative(self._bounds, counts, self._sums[code])
            fam.add_metric([self.names[code]], buckets, total)
        return fam


def _on_loop(
    loop: asyncio.AbstractEventLoop | None,
    fn: Callable[[], Any],
    loop_thread: threading.Thread | None = None,
) -> Any:
    """Run `fn` on the loop thread and return its result; None if the loop does not answer.
    Without a loop (tests building a collector by hand) `fn` runs here."""
    if loop is None or threading.current_thread() is loop_thread:
        return fn()
    if loop.is_closed():
        return None
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def call() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # delivered to the scrape thread, logged there
            fut.set_exception(e)

    try:
        loop.call_soon_threadsafe(call)
        return fut.result(SNAPSHOT_TIMEOUT_S)
    except RuntimeError:  # loop closed between the check and the call
        return None
    except concurrent.futures.TimeoutError:
        log.warning("metrics: the event loop did not answer within %.1f s", SNAPSHOT_TIMEOUT_S)
        return None
    except Exception:
        log.exception("metrics: snapshot failed")
        return None


def _gauge(name: str, doc: str, value: float | None, unit: str = "") -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=value, unit=unit)


def _counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield CounterMetricFamily(name, doc, value=value)


# --- memserver -------------------------------------------------------------------------------

MEMSERVER_KINDS = {
    int(pp.MsgType.STORE): "store",
    int(pp.MsgType.LOAD): "load",
    int(pp.MsgType.FREE): "free",
}


class MemserverCollector(Collector):
    """Metric families of one `MemServer` (duvm.memserver.server), read on its loop at scrape
    time."""

    def __init__(
        self, server: Any, loop: asyncio.AbstractEventLoop | None, latency: LatencyByKind
    ) -> None:
        self.server, self.loop, self.latency = server, loop, latency
        self.thread = threading.current_thread()  # built on the loop's thread

    def _snapshot(self) -> dict[str, Any]:
        st = self.server.store
        return {
            "capacity": st.capacity_pages,
            "used": st.arena.used_slots,
            "reserved": st.reserved_total,
            "locked": st.arena.locked,
            "connections": st.connections,
            "counters": dict(st.counters),
            "server_counters": dict(getattr(self.server, "counters", {})),
            "namespaces": [
                (ns.client_id, len(ns.pages), ns.reserved, ns.connections)
                for ns in st.namespaces.values()
            ],
        }

    def collect(self) -> Iterator[Metric]:
        snap = _on_loop(self.loop, self._snapshot, self.thread)
        yield GaugeMetricFamily(
            "duvm_scrape_snapshot_ok",
            "1 if the server state was read for this scrape, 0 if its event loop did not answer",
            value=0 if snap is None else 1,
        )
        yield self.latency.family(
            "duvm_memserver_request",
            "Service time of page requests inside the memserver, per frame",
        )
        if snap is None:
            return
        p = PAGE_SIZE
        yield from _gauge(
            "duvm_memserver_capacity_bytes", "Preallocated arena size", snap["capacity"] * p
        )
        yield from _gauge(
            "duvm_memserver_used_bytes", "Arena bytes holding pages", snap["used"] * p
        )
        yield from _gauge(
            "duvm_memserver_reserved_bytes", "Arena bytes promised to clients", snap["reserved"] * p
        )
        yield from _gauge(
            "duvm_memserver_arena_locked",
            "1 if the arena is locked in RAM",
            1 if snap["locked"] else 0,
        )
        yield from _gauge(
            "duvm_memserver_connections", "Open client connections", snap["connections"]
        )
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
        for cid, n_stored, n_reserved, n_conns in snap["namespaces"]:
            stored.add_metric([cid], n_stored)
            reserved.add_metric([cid], n_reserved)
            conns.add_metric([cid], n_conns)
        yield from (stored, reserved, conns)
        c = snap["counters"]
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
        yield from _counter(
            "duvm_memserver_refused",
            "Requests refused (no room, no reservation, unknown page)",
            c.get("refused"),
        )
        sec = snap["server_counters"]
        if sec:
            events = CounterMetricFamily(
                "duvm_memserver_security_events",
                "Authentication and connection-limit events",
                labels=["event"],
            )
            for k, v in sorted(sec.items()):
                if isinstance(v, int):
                    events.add_metric([k], v)
            yield events


# --- daemon ----------------------------------------------------------------------------------

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
    """Metric families of the daemon's `NBDServer` and its store."""

    def __init__(
        self, server: Any, loop: asyncio.AbstractEventLoop | None, latency: LatencyByKind
    ) -> None:
        self.server, self.loop, self.latency = server, loop, latency
        self.thread = threading.current_thread()  # built on the loop's thread

    def collect(self) -> Iterator[Metric]:
        snap = _on_loop(self.loop, lambda: daemon_snapshot(self.server), self.thread)
        yield GaugeMetricFamily(
            "duvm_scrape_snapshot_ok",
            "1 if the daemon state was read for this scrape, 0 if its event loop did not answer",
            value=0 if snap is None else 1,
        )
        yield self.latency.family(
            "duvm_daemon_nbd_request",
            "NBD request time in the daemon "
            "(decoded to reply queued), memserver round trips included",
        )
        if snap is None:
            return
        nbd = snap["nbd"]
        yield GaugeMetricFamily(
            "duvm_daemon_export_bytes", "Size of the NBD export", value=snap["export_bytes"]
        )
        yield GaugeMetricFamily(
            "duvm_daemon_nbd_connections", "Open NBD connections", value=snap["nbd_connections"]
        )
        yield from _counter(
            "duvm_daemon_nbd_requests", "NBD requests received", nbd.get("requests")
        )
        yield from _counter(
            "duvm_daemon_nbd_errors", "NBD requests answered with an error", nbd.get("errors")
        )
        yield from _counter(
            "duvm_daemon_nbd_protocol_errors",
            "NBD connections dropped for breaking the protocol",
            nbd.get("protocol_errors"),
        )
        counters = snap["counters"]  # a counter the store does not keep is left out
        for key, name, doc in _DAEMON_COUNTERS:
            yield from _counter(name, doc, counters.get(key))
        h = snap["health"]
        if h is None:  # --memory: no pool, so nothing below is known
            return
        yield from _gauge(
            "duvm_daemon_degraded_slabs",
            "Slabs with fewer live replicas than wanted",
            h.get("degraded_slabs"),
        )
        yield from _gauge("duvm_daemon_slabs", "Slabs of the export", h.get("slabs"))
        yield from _gauge("duvm_daemon_replicas", "Replicas wanted per slab", h.get("replicas"))
        yield from _gauge(
            "duvm_daemon_repairs_in_progress",
            "Slabs being copied now",
            len(h["repairing"]) if "repairing" in h else None,
        )
        yield from _gauge(
            "duvm_daemon_pages_written", "Export pages holding data", h.get("pages_written")
        )
        peers = h.get("peers", [])
        fams = {
            "up": GaugeMetricFamily(
                "duvm_daemon_peer_up", "1 if connected to the memserver", labels=["peer"]
            ),
            "circuit": GaugeMetricFamily(
                "duvm_daemon_peer_circuit_open",
                "1 while the breaker keeps requests away",
                labels=["peer"],
            ),
            "pages": GaugeMetricFamily(
                "duvm_daemon_peer_pages",
                "This node's written pages held by the memserver (per replica)",
                labels=["peer"],
            ),
            "reserved": GaugeMetricFamily(
                "duvm_daemon_peer_reserved_pages",
                "Pages reserved on the memserver",
                labels=["peer"],
            ),
            "slabs": GaugeMetricFamily(
                "duvm_daemon_peer_slabs", "Slabs with a replica on the memserver", labels=["peer"]
            ),
            "trips": CounterMetricFamily(
                "duvm_daemon_peer_breaker_trips", "Times the breaker opened", labels=["peer"]
            ),
            "transport": GaugeMetricFamily(
                "duvm_daemon_peer_transport",
                "1 for the transport the memserver's pages move by now (tcp or rdma)",
                labels=["peer", "transport"],
            ),
        }
        for p in peers:
            lbl = [str(p.get("peer"))]
            for key, fam_key in (
                ("pages", "pages"),
                ("reserved_pages", "reserved"),
                ("slabs", "slabs"),
                ("breaker_trips", "trips"),
            ):
                if p.get(key) is not None:
                    fams[fam_key].add_metric(lbl, p[key])
            for key, fam_key in (("connected", "up"), ("circuit_open", "circuit")):
                if p.get(key) is not None:
                    fams[fam_key].add_metric(lbl, 1 if p[key] else 0)
            if p.get("transport_in_use") is not None:
                fams["transport"].add_metric([*lbl, str(p["transport_in_use"])], 1)
        yield from fams.values()


# --- the HTTP endpoint -----------------------------------------------------------------------


def serve(collector: Collector, listen: str) -> tuple[str, int]:
    """Start the exposition server on `listen` in a daemon thread; the bound address.
    Only `collector` is exported (no process/GC metrics of the default registry)."""
    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    bound = httpd.server_address
    return str(bound[0]), int(bound[1])


def start_for_loop(
    collector_cls: type,
    target: Any,
    kinds: dict[int, str],
    listen: str,
) -> tuple[LatencyByKind, tuple[str, int]]:
    """Build the latency histograms and collector for `target` on the running loop, serve
    them; return the histograms (for the hot path) and the bound address."""
    loop = asyncio.get_running_loop()
    latency = LatencyByKind(kinds)
    return latency, serve(collector_cls(target, loop, latency), listen)
