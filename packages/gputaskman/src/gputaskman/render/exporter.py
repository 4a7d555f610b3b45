"""Prometheus metric families from one `Snapshot` (+ host sample): what `gputaskman serve`
exports.

Theory of operation
-------------------
`SnapshotCollector.collect()` reads the latest cached sample (a callable returning it; the
sampling thread in `serve.server` refreshes it) and turns it into metric families. A scrape never
samples anything.

The provenance rule carries over to metric names: a value measured by a driver or the OS is
exported under the base name (``gputaskman_process_vram_bytes``); an inferred, estimated or
runtime-reported value under a name carrying its kind
(``gputaskman_process_vram_estimated_bytes``, ``..._runtime_bytes``), so a dashboard or a
``sum()`` never mixes them. Every sample also carries a ``provenance`` label with the kind.
Unknown values (a `Reading` with a reason) are not exported at all: absent, never 0.

Labels: GPUs by ``gpu`` (index), ``pci_bus_id``, ``uuid`` and ``gpu_name``; processes by
``pid`` and ``name`` (the process name, not its command line) plus the GPU labels (empty for
a process with no GPU context, such as a CPU-only runtime). A process of another OS (the
Windows host seen from WSL) has ``pid="windows:1234"``, as in the table, so it never shares a
series with a local process of the same number, and it gets no RAM/CPU series (this
machine's host sample knows nothing of it). What can change while a process lives is not a
label of its numbers, so a series keeps its identity: the model is in
``gputaskman_process_model_info`` (``model_name``, ``evidence``, ``confirmed``; joined by
PromQL on ``instance``, ``pid`` and ``gpu``), and every process row has one
``gputaskman_process_info`` (``contexts``, ``parent_pid``, ``inferred_unique``), so a row
whose every number is unknown still exists. ``gputaskman_backend_info`` names the backend
and the driver version; ``gputaskman_sample_problems`` counts problems by ``where``,
``reason`` and the GPU they concern (``gpu``, ``pci_bus_id``; empty when none), so a failed
process list of one GPU marks that GPU's attributed sum a lower bound, as
``gputaskman_gpu_attributed_complete`` says.

A process's engine shares are ``gputaskman_process_<engine>_utilization_percent`` (the
document's ``gpu_percent`` is ``gputaskman_process_gpu_utilization_percent``).

Per-process memory beside VRAM, as ``--json`` has it (``paged_bytes``, ``footprint_bytes``):
``gputaskman_process_paged_bytes`` is non-local / compressed graphics memory (Windows PDH
``Non Local Usage``, macOS compressed graphics ledger) and ``gputaskman_process_footprint_bytes``
the macOS physical footprint (CPU and GPU memory together: unified memory, not VRAM). Neither
is part of ``gputaskman_process_vram_bytes`` or of any attributed sum, and a backend that does
not measure them (NVML, DRM) exports no series at all, never 0.

What of a process is out of RAM or held in it (swapped, locked, pinned bytes), who owns it,
and the totals by owner: `exporter_owners`. The host sample's RAM, swap, CPU and duvm pool:
`exporter_system`. The families, the naming rule and the shared labels: `exporter_families`.

A GPU's health readings, its health verdict and its MIG instances, and a row's MIG instance:
`exporter_health` (``gputaskman_gpu_health_*``, ``gputaskman_gpu_unhealthy``,
``gputaskman_gpu_mig_mode``, ``gputaskman_mig_*``, ``gputaskman_process_mig_info``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import Adapter, ProcGpu, Snapshot
from gputaskman.render import exporter_health
from gputaskman.render.exporter_families import GPU_LABELS, PROC_LABELS, Families, info_series
from gputaskman.render.exporter_owners import owner_totals_families, process_memory_and_owner
from gputaskman.render.exporter_system import system_families
from gputaskman.render.report_models import breakdown_totals, breakdown_view
from gputaskman.sampling.host import SystemInfo

PROC_INFO_LABELS = ("contexts", "parent_pid", "inferred_unique")
MODEL_INFO_LABELS = ("model_name", "evidence", "confirmed")
PROBLEM_LABELS = ("where", "reason", "gpu", "pci_bus_id")
# DeviceMetrics field -> (metric base name, unit suffix, scale, help)
DEVICE_FIELDS: dict[str, tuple[str, str, float, str]] = {
    "memory_total_bytes": ("gputaskman_gpu_memory_total", "bytes", 1, "GPU memory size"),
    "memory_used_bytes": ("gputaskman_gpu_memory_used", "bytes", 1, "GPU memory in use"),
    "memory_reserved_bytes": (
        "gputaskman_gpu_memory_reserved",
        "bytes",
        1,
        "GPU memory reserved by the driver",
    ),
    "util_gpu_percent": ("gputaskman_gpu_utilization", "percent", 1, "GPU engine busy"),
    "util_memory_percent": (
        "gputaskman_gpu_memory_utilization",
        "percent",
        1,
        "Memory controller busy",
    ),
    "encoder_percent": ("gputaskman_gpu_encoder_utilization", "percent", 1, "Encoder busy"),
    "decoder_percent": ("gputaskman_gpu_decoder_utilization", "percent", 1, "Decoder busy"),
    "temperature_c": ("gputaskman_gpu_temperature", "celsius", 1, "GPU temperature"),
    "power_w": ("gputaskman_gpu_power", "watts", 1, "Power draw"),
    "power_limit_w": ("gputaskman_gpu_power_limit", "watts", 1, "Power limit"),
    "clock_graphics_mhz": ("gputaskman_gpu_clock_graphics", "hertz", 1e6, "Graphics clock"),
    "clock_sm_mhz": ("gputaskman_gpu_clock_sm", "hertz", 1e6, "SM clock"),
    "clock_memory_mhz": ("gputaskman_gpu_clock_memory", "hertz", 1e6, "Memory clock"),
}


@dataclass(frozen=True)
class Cached:
    """One sample as the sampling thread left it."""

    snapshot: Snapshot
    system: SystemInfo | None
    sampled_at: float  # time.time() when the sample finished
    duration_s: float


def _gpu_values(a: Adapter | None) -> tuple[str, ...]:
    if a is None:
        return ("", "", "", "")
    return (str(a.index), a.pci_bus_id, a.uuid or "", a.name or "")


def _proc_values(p: ProcGpu, a: Adapter | None) -> tuple[str, ...]:
    pid = str(p.pid) if p.host is None else f"{p.host}:{p.pid}"  # another OS's PID
    return (pid, p.name or "", *_gpu_values(a))


def engine_metric(engine: str) -> str:
    """The series of a process's engine share: the document's ``gpu_percent`` is
    ``gputaskman_process_gpu_utilization`` (plus the kind and ``_percent``)."""
    return f"gputaskman_process_{engine.removesuffix('_percent')}_utilization"


def snapshot_families(c: Cached, now: float | None = None) -> Iterator[Metric]:
    """Every metric family for one cached sample."""
    snap, system = c.snapshot, c.system
    now = time.time() if now is None else now
    yield GaugeMetricFamily(
        "gputaskman_backend_up", "1 if the GPU backend answered", value=1 if snap.available else 0
    )
    yield GaugeMetricFamily(
        "gputaskman_sample_timestamp_seconds",
        "When the cached sample was taken (Unix time; the document's taken)",
        value=snap.taken,
    )
    yield GaugeMetricFamily(
        "gputaskman_sample_age_seconds",
        "Age of the cached sample at scrape time",
        value=max(0.0, now - c.sampled_at),
    )
    yield GaugeMetricFamily(
        "gputaskman_sample_duration_seconds", "Time the last sample took", value=c.duration_s
    )
    backend = GaugeMetricFamily(
        "gputaskman_backend_info",
        "The GPU backend and the driver version it reports (empty: unknown)",
        labels=["backend", "driver_version"],
    )
    backend.add_metric([snap.backend, snap.driver_version or ""], 1)
    yield backend
    counts: dict[tuple[str, str, str, str], int] = {}
    # the backend problem is usually also in `problems`: count each problem once
    for pr in dict.fromkeys(
        snap.problems + ((snap.backend_problem,) if snap.backend_problem else ())
    ):
        a = snap.adapter(pr.adapter) if pr.adapter else None
        gpu = "" if a is None else str(a.index)
        key = (pr.where, str(pr.reason), gpu, pr.adapter or "")
        counts[key] = counts.get(key, 0) + 1
    fam_problems = GaugeMetricFamily(
        "gputaskman_sample_problems",
        "Problems that reduced what the latest sample shows, by the GPU they concern",
        labels=list(PROBLEM_LABELS),
    )
    for key, n in sorted(counts.items()):
        fam_problems.add_metric(list(key), n)
    yield fam_problems

    f = Families()
    for a in snap.adapters:
        gv = _gpu_values(a)
        info = f.fams.get("gputaskman_gpu_info")
        if info is None:
            info = f.fams["gputaskman_gpu_info"] = GaugeMetricFamily(
                "gputaskman_gpu_info",
                "One per GPU (labels identify it)",
                labels=[*GPU_LABELS, "vendor", "backend"],
            )
        info.add_metric([*gv, a.vendor, a.backend], 1)
        m = snap.metrics.get(a.pci_bus_id)
        if m is not None:
            readings = fields_of(m)
            for fld, (base, unit, scale, doc) in DEVICE_FIELDS.items():
                f.reading(base, unit, doc, GPU_LABELS, gv, readings[fld], scale)
        for key, r in (snap.extra_metrics.get(a.pci_bus_id) or {}).items():
            base, _, unit = key.rpartition("_")
            f.reading(f"gputaskman_gpu_{base}", unit, f"Backend-specific: {key}", GPU_LABELS, gv, r)
        exporter_health.gpu_families(f, snap, a.pci_bus_id, GPU_LABELS, gv)  # health, MIG
        attributed = snap.attributed_on(a.pci_bus_id)
        if attributed is not None:  # a sum of measured values only
            f.add(
                "gputaskman_gpu_attributed_bytes",
                "Sum of measured per-process VRAM",
                GPU_LABELS,
                gv,
                attributed,
            )
            f.add(
                "gputaskman_gpu_attributed_complete",
                "1 if every process's VRAM was measured (else the sum is a lower bound)",
                GPU_LABELS,
                gv,
                1 if snap.attributed_complete_on(a.pci_bus_id) else 0,
            )

    from gputaskman.render.report import proc_host_lookup

    lookup = proc_host_lookup(system)
    seen: set[tuple[str, ...]] = set()
    for p in snap.processes:
        a = snap.adapter(p.adapter) if p.adapter else None
        pv = _proc_values(p, a)
        if pv not in seen:  # one row per process and GPU (a duplicate adds no series)
            seen.add(pv)
            facts = (
                ",".join(p.contexts),
                "" if p.parent_pid is None else str(p.parent_pid),
                "true" if p.unique else "false",
            )
            info_series(
                f,
                "gputaskman_process_info",
                "One per process row (a process on two GPUs has two): the row's facts",
                PROC_LABELS + PROC_INFO_LABELS,
                pv + facts,
            )
            if p.model is not None:
                m = p.model
                info_series(
                    f,
                    "gputaskman_process_model_info",
                    "The model a process holds, with "
                    "its strongest evidence (confirmed: two kinds agree)",
                    PROC_LABELS + MODEL_INFO_LABELS,
                    (*pv, m.name, m.evidence, "true" if m.confirmed else "false"),
                )
        f.reading(
            "gputaskman_process_vram", "bytes", "Process GPU memory", PROC_LABELS, pv, p.dedicated
        )
        f.reading(
            "gputaskman_process_vram", "bytes", "Process GPU memory", PROC_LABELS, pv, p.inferred
        )
        f.reading(
            "gputaskman_process_paged",
            "bytes",
            "Process non-local / compressed "
            "graphics memory (Windows Non Local Usage, macOS); not VRAM, never summed",
            PROC_LABELS,
            pv,
            p.paged,
        )
        f.reading(
            "gputaskman_process_footprint",
            "bytes",
            "Process physical footprint "
            "(macOS unified memory, CPU and GPU); not VRAM, never summed",
            PROC_LABELS,
            pv,
            p.footprint,
        )
        for engine, r in sorted(p.engines.items()):
            f.reading(
                engine_metric(engine),
                "percent",
                f"Process share of the {engine.removesuffix('_percent')} engine",
                PROC_LABELS,
                pv,
                r,
            )
        # a row of another OS must not pick up the readings of a local process that
        # happens to have the same PID
        host = lookup(p.pid, p.create_time) if p.host is None else {}
        f.reading(
            "gputaskman_process_ram",
            "bytes",
            "Process resident RAM (OS)",
            PROC_LABELS,
            pv,
            host.get("ram_bytes"),
        )
        f.reading(
            "gputaskman_process_cpu",
            "percent",
            "Process CPU, percent of one core (OS)",
            PROC_LABELS,
            pv,
            host.get("cpu_percent"),
        )
        process_memory_and_owner(f, p, pv)
        exporter_health.process_families(f, p, PROC_LABELS, pv)  # its MIG instance
        view = breakdown_view(p.breakdown)
        if view is not None:
            for part in view.parts:
                f.reading(
                    "gputaskman_process_llm_part",
                    "bytes",
                    "Model memory part (weights, kv_cache, compute, other)",
                    (*PROC_LABELS, "part"),
                    (*pv, part.name),
                    part.reading,
                )
            for total in breakdown_totals(view):
                f.reading(
                    "gputaskman_process_vram", "bytes", "Process GPU memory", PROC_LABELS, pv, total
                )
            # a runtime's own figures (runtime kind, never summed)
            for name, r in view.figures or ():
                base, _, unit = name.rpartition("_")
                f.reading(
                    "gputaskman_process_llm_figure",
                    unit,
                    "A serving runtime's own figure for its model (runtime_figures in --json)",
                    (*PROC_LABELS, "figure"),
                    (*pv, base),
                    r,
                )
    owner_totals_families(f, snap)
    yield from f.fams.values()
    if system is not None:
        yield from system_families(system)


class SnapshotCollector(Collector):
    """A prometheus_client collector over the latest cached sample (None: not sampled yet)."""

    def __init__(self, latest: Callable[[], Cached | None]) -> None:
        self.latest = latest

    def collect(self) -> Iterator[Metric]:
        c = self.latest()
        if c is None:
            yield GaugeMetricFamily(
                "gputaskman_sample_ready", "1 once the first sample exists", value=0
            )
            return
        yield GaugeMetricFamily(
            "gputaskman_sample_ready", "1 once the first sample exists", value=1
        )
        yield from snapshot_families(c)
