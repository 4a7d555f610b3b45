"""What gputaskman's NVML health and MIG readings cost per refresh, on the mocked NVML.

Usage::

    uv run python benchmarks/gtm_nvml_health_cost.py [--repeat 2000]

Each new per-refresh step of `backends.nvml` is timed alone, ``time.perf_counter`` around one
call, ``--repeat`` times, on the mocked library of ``packages/gputaskman/tests/
test_nvml_mocked.py`` (it answers at once from Python dicts; field values come back in the
real ``c_nvmlFieldValue_t`` array), and the median printed in microseconds. So the figures are
gputaskman's own work around each NVML call (the calls, their error mapping, the readings,
the rates, the MIG rows), NOT the driver's time: no GPU was lent to measure that, and
``tools/nvml_check.py --cost`` measures it on a machine that has one. Also printed: how many
NVML calls each step makes per GPU per refresh.

Steps: ``counters`` (one ``nvmlDeviceGetFieldValues`` for 15 fields, the clock event reasons,
the fan) for a GPU that has them and for one that has none (asked once, then remembered);
``drain`` (``nvmlEventSetWait(set, 0)`` with nothing pending, and with one XID event, which
adds one ``nvmlDeviceGetPciInfo``); ``xid`` (the readings from the counts, no call); MIG for a
GPU without MIG (remembered), with MIG disabled (one ``nvmlDeviceGetMigMode``) and with 7
instances of 2 processes each; the whole ``NvmlBackend.sample()`` of one GPU with and without
health and MIG; and the JSON writer's and text report's health and MIG parts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packages" / "gputaskman" / "tests"))

import pynvml  # noqa: E402
import test_nvml_mocked as nv  # noqa: E402
from gputaskman.backends.nvml import NvmlBackend  # noqa: E402
from gputaskman.backends.nvml_health import NvmlHealth  # noqa: E402
from gputaskman.backends.nvml_mig import NvmlMig  # noqa: E402
from gputaskman.render import report_health  # noqa: E402
from gputaskman.sampling.collector import Collector, NullScanner  # noqa: E402

FIELDS = {3: 0, 4: 0, 5: 0, 6: 0, 142: 0, 143: 0, 144: 0, 145: 0, 197: 10, 198: 10, 138: 1}


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


class Counting(nv.MockedNvml):
    """The mocked library, counting the NVML functions called."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name not in ("nvmlMemory_v2",):
            object.__getattribute__(self, "called").append(name)
        return object.__getattribute__(self, name)


def calls_of(lib: Counting, fn: Callable[[], Any]) -> int:
    lib.called = []
    fn()
    return len(lib.called)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2000)
    n = ap.parse_args().repeat
    full = nv.device(nv.BUS_A, fields=dict(FIELDS), clock_reasons=1, fan=40)
    bare = nv.device(nv.BUS_A)
    rows = [("step", "µs median", "NVML calls")]

    lib = Counting([full])
    lib.called = []
    h = NvmlHealth(lib)
    h.counters(0, "a")
    rows.append(
        (
            "counters, GPU with every counter",
            median_us(lambda: h.counters(0, "a"), n),
            calls_of(lib, lambda: h.counters(0, "a")),
        )
    )
    libb = Counting([bare])
    libb.called = []
    hb = NvmlHealth(libb)
    hb.counters(0, "a")
    rows.append(
        (
            "counters, GPU with none (remembered)",
            median_us(lambda: hb.counters(0, "a"), n),
            calls_of(libb, lambda: hb.counters(0, "a")),
        )
    )
    h.watch(0, "a")
    h.begin()
    rows.append(("drain, nothing pending", median_us(h.drain, n), calls_of(lib, h.drain)))

    def one_event() -> None:
        lib.pending_events = [nv.SimpleNamespace(device=0, eventType=8, eventData=79)]
        h.drain()

    rows.append(("drain, one XID event", median_us(one_event, n), calls_of(lib, one_event)))
    rows.append(
        ("xid readings", median_us(lambda: h.xid("a"), n), calls_of(lib, lambda: h.xid("a")))
    )

    def no_engines(*_: Any) -> dict:
        return {}

    for label, dev in (
        ("MIG, GPU without MIG (remembered)", bare),
        ("MIG, disabled", nv.device(nv.BUS_A, mig_mode=[0, 0])),
        (
            "MIG, 7 instances x 2 processes",
            nv.device(
                nv.BUS_A,
                mig_mode=[1, 1],
                mig=[
                    nv.mig_device(
                        i, 0, 10 << 30, 1 << 30, [nv.proc(10 * i, 1), nv.proc(10 * i + 1, 1)]
                    )
                    for i in range(7)
                ],
            ),
        ),
    ):
        libm = Counting([dev])
        libm.called = []
        m = NvmlMig(libm)
        m.read(0, "a", [], no_engines)
        rows.append(
            (
                label,
                median_us(lambda m=m: m.read(0, "a", [], no_engines), n),
                calls_of(libm, lambda m=m: m.read(0, "a", [], no_engines)),
            )
        )

    for label, dev in (
        ("sample(), one GPU, none of it", bare),
        ("sample(), one GPU, all of it", full),
    ):
        libs = Counting([dev])
        libs.called = []
        backend = NvmlBackend(libs)
        backend.sample()
        rows.append((label, median_us(backend.sample, n), calls_of(libs, backend.sample)))
    big = nv.device(
        nv.BUS_A,
        mig_mode=[1, 1],
        mig=[nv.mig_device(1, 0, 40 << 30, 1 << 30, [nv.proc(7, 1)])],
        fields=dict(FIELDS),
        clock_reasons=0x40,
        fan=50,
    )
    c = Collector(source=NvmlBackend(nv.MockedNvml([big])), scanner=NullScanner())
    c.sample()
    snap = c.sample()
    bus = snap.adapters[0].pci_bus_id
    rows.append(
        (
            "JSON health + MIG of one GPU",
            median_us(lambda: report_health.adapter_json(snap, bus), n),
            0,
        )
    )
    rows.append(
        (
            "text health + MIG lines of one GPU",
            median_us(
                lambda: report_health.health_lines(snap, bus) + report_health.mig_lines(snap, bus),
                n,
            ),
            0,
        )
    )
    print(f"pynvml {pynvml.__name__}, mocked NVML, {n} repeats, medians (our code, not the driver)")
    for step, us, calls in rows:
        print(f"{step:42} {us if isinstance(us, str) else f'{us:8.1f}':>10} {calls!s:>6}")


if __name__ == "__main__":
    main()
