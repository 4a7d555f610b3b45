"""Prometheus exposition shared by the memserver and the daemon (`--metrics HOST:PORT`): the
request latency histograms, reading a process's state on its event loop at scrape time, and
the HTTP endpoint. Each process's collector lives with it (`duvm.memserver.metrics`,
`duvm.node.daemon.metrics`).

Theory of operation
-------------------
Nothing here runs unless `--metrics` is given. Then `prometheus_client.start_http_server`
serves `/metrics` from its own thread, and a custom `Collector` builds the metric families at
scrape time, so gauges and counters cost the hot path nothing: they are read from the state the
servers keep anyway, through the typed views they declare (`MemServer.usage()`,
`duvm.node.daemon.status.DaemonStatus`).

That state belongs to the asyncio loop, which mutates it between awaits, so a scrape never
reads it from the HTTP thread: `on_loop` hands a snapshot function to the loop
(`call_soon_threadsafe`) and waits for its result (at most `SNAPSHOT_TIMEOUT_S`; a loop that
does not answer yields a scrape with only the latency histograms and
`duvm_scrape_snapshot_ok 0`, never invented values).

Request latencies are the one thing observed on the hot path. `prometheus_client.Histogram`
takes a lock and walks its buckets in Python per observation (about 1-2 us); `LatencyHistogram`
is a bisect over integer nanosecond bounds and two increments, with no lock: every
observation happens on the loop thread, and a scrape copies the counts (a list copy is atomic
under the GIL; the sum may lag the counts by the observations of one loop iteration). Its
cost per request is measured by `benchmarks/duvm_metrics_overhead.py`.

A value the process does not know is not exported, never exported as 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from duvm.base.units import parse_listen

log = logging.getLogger(__name__)

T = TypeVar("T")

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


def on_loop(
    loop: asyncio.AbstractEventLoop | None,
    fn: Callable[[], T],
    loop_thread: threading.Thread | None = None,
) -> T | None:
    """Run `fn` on the loop thread and return its result; None if the loop does not answer.
    Without a loop (tests building a collector by hand) `fn` runs here."""
    if loop is None or threading.current_thread() is loop_thread:
        return fn()
    if loop.is_closed():
        return None
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

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


def gauge(name: str, doc: str, value: float | None, unit: str = "") -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=value, unit=unit)


def counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield CounterMetricFamily(name, doc, value=value)


def snapshot_ok(ok: bool, what: str) -> Metric:
    """`duvm_scrape_snapshot_ok`: whether `what` was read for this scrape."""
    return GaugeMetricFamily(
        "duvm_scrape_snapshot_ok",
        f"1 if the {what} state was read for this scrape, 0 if its event loop did not answer",
        value=1 if ok else 0,
    )


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
    make_collector: Callable[[asyncio.AbstractEventLoop, LatencyByKind], Collector],
    kinds: dict[int, str],
    listen: str,
) -> tuple[LatencyByKind, tuple[str, int]]:
    """Build the latency histograms and, with `make_collector`, the collector on the running
    loop; serve them. Returns the histograms (for the hot path) and the bound address."""
    loop = asyncio.get_running_loop()
    latency = LatencyByKind(kinds)
    return latency, serve(make_collector(loop, latency), listen)
