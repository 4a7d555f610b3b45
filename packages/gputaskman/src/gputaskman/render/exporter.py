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

What of a process is out of RAM or held in it (``/proc/PID/status``, `procfacts`):
``gputaskman_process_swapped_bytes`` (VmSwap, with ``swapped_to="pool"`` when duvm's device
is the node's only active swap device, else ``"swap"``), ``gputaskman_process_locked_bytes``
(VmLck) and ``gputaskman_process_pinned_bytes`` (VmPin). Who owns it:
``gputaskman_process_owner_info`` (`OWNER_INFO_LABELS`: the cgroup path, user, pod UID,
namespace and name where a local source gave them, container ID and runtime, Slurm job and
step, systemd unit, session; empty where the path names none), one per row whose cgroup was
read; and the totals by owner, ``gputaskman_owner_vram_bytes`` (measured VRAM only),
``gputaskman_owner_vram_complete`` and ``gputaskman_owner_processes``, labelled ``by``
(user, pod, job), ``owner``, ``state`` (named, none, unknown: the unknown counted apart).

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
from gputaskman.base.owners import owner_totals
from gputaskman.base.readings import Adapter, Kind, ProcGpu, Reading, Snapshot
from gputaskman.render import exporter_health
from gputaskman.render.report_models import breakdown_totals, breakdown_view
from gputaskman.sampling.host import SystemInfo

GPU_LABELS = ("gpu", "pci_bus_id", "uuid", "gpu_name")
PROC_LABELS = ("pid", "name", *GPU_LABELS)
PROC_INFO_LABELS = ("contexts", "parent_pid", "inferred_unique")
MODEL_INFO_LABELS = ("model_name", "evidence", "confirmed")
PROBLEM_LABELS = ("where", "reason", "gpu", "pci_bus_id")
# `readings.Owner` fields exported as labels of gputaskman_process_owner_info
OWNER_INFO_LABELS = (
    "cgroup",
    "user",
    "pod_uid",
    "pod_namespace",
    "pod_name",
    "qos",
    "container_id",
    "container_runtime",
    "slurm_job",
    "slurm_step",
    "unit",
    "user_unit",
    "session",
)
OWNER_TOTAL_LABELS = ("by", "owner", "state", "pod_namespace", "pod_name")

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


# the host sample's numbers `system_families` exports, by the system object's section: the
# series ``gputaskman_system_<section>_<name>_bytes`` (and ``gputaskman_system_cpu_percent``)
SYSTEM_MEMORY = ("total", "available", "used", "cached")
SYSTEM_SWAP = ("total", "used")


def metric_name(base: str, unit: str, kind: Kind) -> str:
    """``base_unit`` for measured values, ``base_<kind>_unit`` for every other kind."""
    if kind is Kind.MEASURED:
        return f"{base}_{unit}" if unit else base
    return f"{base}_{kind.value}_{unit}" if unit else f"{base}_{kind.value}"


@dataclass(frozen=True)
class Cached:
    """One sample as the sampling thread left it."""

    snapshot: Snapshot
    system: SystemInfo | None
    sampled_at: float  # time.time() when the sample finished
    duration_s: float


class _Families:
    """Gauge families by name, created on first use with the labels they need."""

    def __init__(self) -> None:
        self.fams: dict[str, GaugeMetricFamily] = {}

    def add(
        self,
        name: str,
        doc: str,
        labels: tuple[str, ...],
        values: tuple[str, ...],
        value: float,
        kind: Kind = Kind.MEASURED,
    ) -> None:
        fam = self.fams.get(name)
        if fam is None:
            fam = self.fams[name] = GaugeMetricFamily(name, doc, labels=[*labels, "provenance"])
        fam.add_metric([*values, kind.value], value)

    def reading(
        self,
        base: str,
        unit: str,
        doc: str,
        labels: tuple[str, ...],
        values: tuple[str, ...],
        r: Reading | None,
        scale: float = 1,
    ) -> None:
        """Export `r` under the name of its kind; nothing when unknown."""
        if r is None or r.value is None:
            return
        kind_doc = "" if r.kind is Kind.MEASURED else f" ({r.kind.value}, not measured)"
        self.add(
            metric_name(base, unit, r.kind), doc + kind_doc, labels, values, r.value * scale, r.kind
        )


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


def _info(
    f: _Families, name: str, doc: str, labels: tuple[str, ...], values: tuple[str, ...]
) -> None:
    """One series of value 1 whose labels are the facts (the Prometheus info convention)."""
    fam = f.fams.get(name)
    if fam is None:
        fam = f.fams[name] = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(values), 1)


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

    f = _Families()
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
            _info(
                f,
                "gputaskman_process_info",
                "One per process row (a process on two GPUs has two): the row's facts",
                PROC_LABELS + PROC_INFO_LABELS,
                pv + facts,
            )
            if p.model is not None:
                m = p.model
                _info(
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
        _process_memory_and_owner(f, p, pv)
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
    _owner_totals(f, snap)
    yield from f.fams.values()
    if system is not None:
        yield from system_families(system)


def _process_memory_and_owner(f: _Families, p: ProcGpu, pv: tuple[str, ...]) -> None:
    """A row's swapped / locked / pinned bytes and its owner's info series (`procfacts`)."""
    m = p.memory
    if m is not None:
        f.reading(
            "gputaskman_process_swapped",
            "bytes",
            "Process memory swapped out (VmSwap); swapped_to=pool: duvm's device is the "
            "only active swap device",
            (*PROC_LABELS, "swapped_to"),
            (*pv, m.swapped_to or ""),
            m.swapped,
        )
        f.reading(
            "gputaskman_process_locked",
            "bytes",
            "Process memory locked with mlock (VmLck): never swapped",
            PROC_LABELS,
            pv,
            m.locked,
        )
        f.reading(
            "gputaskman_process_pinned",
            "bytes",
            "Process memory pinned by the kernel (VmPin: devices, RDMA, io_uring): never swapped",
            PROC_LABELS,
            pv,
            m.pinned,
        )
    o = p.owner
    if o is not None and o.cgroup is not None:
        _info(
            f,
            "gputaskman_process_owner_info",
            "Who owns a process row, as its cgroup names it (empty: not named)",
            PROC_LABELS + OWNER_INFO_LABELS,
            (*pv, *(_label(getattr(o, k)) for k in OWNER_INFO_LABELS)),
        )


def _label(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def _owner_totals(f: _Families, snap: Snapshot) -> None:
    """Measured VRAM summed by user, pod and job (`owners.owner_totals`); an owner whose rows
    had no measured VRAM has no bytes series, and ``state="unknown"`` counts apart."""
    for t in owner_totals(snap):
        lv = (t.by, t.owner or "", t.state, t.pod_namespace or "", t.pod_name or "")
        if t.attributed_bytes is not None:
            f.add(
                "gputaskman_owner_vram_bytes",
                "Measured process VRAM summed by owner (by=user|pod|job)",
                OWNER_TOTAL_LABELS,
                lv,
                t.attributed_bytes,
            )
        f.add(
            "gputaskman_owner_vram_complete",
            "1 if every row of the owner had measured VRAM (else its sum is a lower bound)",
            OWNER_TOTAL_LABELS,
            lv,
            1 if t.complete else 0,
        )
        f.add(
            "gputaskman_owner_processes",
            "Process rows with a GPU context, by owner",
            OWNER_TOTAL_LABELS,
            lv,
            len(t.pids),
        )


def system_families(system: SystemInfo) -> Iterator[Metric]:
    """RAM, swap devices, CPU (OS-measured) and the duvm pool (runtime) of the host sample."""
    f = _Families()
    m, s, c = system.memory, system.swap, system.cpu
    memory, swap = fields_of(m), fields_of(s)
    for name in SYSTEM_MEMORY:
        r = memory[f"{name}_bytes"]
        f.reading(f"gputaskman_system_memory_{name}", "bytes", f"System RAM {name}", (), (), r)
    for name in SYSTEM_SWAP:
        r = swap[f"{name}_bytes"]
        f.reading(f"gputaskman_system_swap_{name}", "bytes", f"Swap {name}", (), (), r)
    f.reading("gputaskman_system_cpu", "percent", "CPU busy, all CPUs", (), (), c.percent)
    for d in s.devices or ():
        lv = (d.filename, d.type)
        if d.size_bytes is not None:
            f.add(
                "gputaskman_system_swap_device_size_bytes",
                "Swap device size",
                ("device", "type"),
                lv,
                d.size_bytes,
            )
        if d.used_bytes is not None:
            f.add(
                "gputaskman_system_swap_device_used_bytes",
                "Swap device used",
                ("device", "type"),
                lv,
                d.used_bytes,
            )
    pool = system.duvm
    if pool is not None:
        for d in pool.daemons:
            f.add(
                "gputaskman_duvm_pool_health",
                "duvm pool health from the daemon (1 on the current state)",
                ("socket", "state"),
                (d.socket, d.health),
                1,
                Kind.RUNTIME,
            )
            for p in d.peers:
                f.reading(
                    "gputaskman_duvm_peer_pages",
                    "bytes",
                    "This node's pages held by a duvm peer",
                    ("socket", "peer"),
                    (d.socket, p.peer),
                    p.pages,
                    4096,
                )
        for ln in pool.lending:
            f.reading(
                "gputaskman_duvm_lent",
                "bytes",
                "RAM this node's memserver holds for clients",
                ("socket",),
                (ln.socket,),
                ln.used_bytes,
            )
            f.reading(
                "gputaskman_duvm_lend_capacity",
                "bytes",
                "This node's memserver capacity",
                ("socket",),
                (ln.socket,),
                ln.capacity_bytes,
            )
            for b in ln.borrowers:
                f.reading(
                    "gputaskman_duvm_lent_to",
                    "bytes",
                    "RAM lent to one client",
                    ("socket", "client_id"),
                    (ln.socket, b.client_id),
                    b.stored_bytes,
                )
    yield from f.fams.values()


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
