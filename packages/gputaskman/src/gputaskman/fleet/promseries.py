"""One host's snapshot rebuilt from the series its ``gputaskman serve`` exported and
Prometheus stored (`render.exporter` writes them): the fleet's rows and a host's view, when
the fleet is read from Prometheus instead of from each host.

Theory of operation
-------------------
`host_sample` takes every ``gputaskman_*`` series of one host from one instant query and
builds the model's `Snapshot` and the host sample beside it (a `recorded.RecordedSystem`, the
host sample a document holds), which `promdoc.host_document` turns into a snapshot document
with the writer every other document comes from (`report.to_json_dict`) and reads back with
the one reader (`reader.read_document`). So the fleet view, ``--json`` and ``fleet record``
see the same typed objects and the same JSON as when they poll hosts directly.

What the series carry, and so what comes back:

* GPUs from ``gputaskman_gpu_info`` (index, address, UUID, name, vendor, backend), and their
  device readings from the names `exporter.DEVICE_FIELDS` gives each kind (a measured value
  under the base name, any other kind under a name that carries it): the kind survives the
  trip. Clocks come back from hertz to MHz.
* Processes from ``gputaskman_process_*`` by their labels (PID, name, GPU): each row from
  ``gputaskman_process_info`` (its contexts, the parent row that counts its bytes and
  whether its inferred memory admits one explanation), so a row whose every number is
  unknown (a CPU-only runtime) is still there; measured and inferred VRAM, paged and
  footprint memory, engine shares (``..._<engine>_utilization_percent``, and the doubled
  ``..._gpu_percent_utilization_percent`` older serves wrote), the model from
  ``gputaskman_process_model_info`` (name, evidence, confirmed), and the host's RAM and CPU
  of each process (``gputaskman_process_ram_bytes``, ``gputaskman_process_cpu_percent``), each
  with its kind as its name carries it; its swapped / locked / pinned bytes and its owner
  (``gputaskman_process_owner_info``: `promowner`), from which the totals by owner follow.
* A GPU's health readings (its verdict made again from them), MIG mode and instances, and a
  row's MIG instance (`promhealth`).
* The system panel (the document's ``system`` object) from ``gputaskman_system_*``: RAM total,
  available, used and cached, swap total and used, CPU busy percent (each named by its kind,
  as `exporter_system.SYSTEM_MEMORY` and `exporter_system.SYSTEM_SWAP` list them), and each
  swap device's size and used bytes (``gputaskman_system_swap_device_*``, by file name and
  type, in name order: the exporter does not keep /proc/swaps's; without a device series the
  list is ``null``, "no series in Prometheus", since no swap and unknown look alike). A host that
  exported none of these has no ``system`` object (``null``), as when its serve had none
  (`promsystem`).
* The sample's time (``gputaskman_sample_timestamp_seconds``), the backend's state
  (``gputaskman_backend_up``), its name and driver version (``gputaskman_backend_info``) and
  the sample's problems (``gputaskman_sample_problems``) with the GPU each concerns, so a
  failed process list makes that GPU's attributed sum a lower bound here too. A GPU whose
  ``gputaskman_gpu_attributed_complete`` is 0 stays a lower bound even when no series says
  why (an older serve's problems carry no GPU): a problem ``processes.unexplained`` says
  so. A problem's detail text is not exported: it reads "detail not exported to
  Prometheus".

A reading without a series is unknown with a reason (``unavailable``, "no series in
Prometheus"), never 0: `serve` exports no series for an unknown value, and Prometheus cannot
say which of the two it was. A value no host can have (negative bytes or percent, memory used
over the total, all CPUs over 100 percent busy, NaN or infinity) is unknown too, with the
value in its reason, and a problem saying so. Command lines, process details (the scan:
``unavailable``, "not exported to Prometheus"), start times and the weights / KV cache /
compute split are not exported; nor are RAM free, buffers and shared, swap free,
the CPU count and load averages, a swap device's priority, the host sample's own time and the
duvm pool: those readings are unknown ("not exported to Prometheus"), the time is ``null``
and there is no ``duvm`` object. Whether a swap file was deleted while in use is not exported
either, and the document's field for it cannot say unknown: it reads ``false``. The
document's notes say that it was built from series, from which server and query.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    Kind,
    ModelRef,
    Owner,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
    checked_reading,
)
from gputaskman.fleet.promapi import Sample
from gputaskman.fleet.promhealth import TABLE_PATTERN, HealthSeries
from gputaskman.fleet.promowner import MEMORY_SERIES, OWNER_INFO, memory_from, owner_from
from gputaskman.fleet.promreadings import KINDS, NO_SERIES, NOT_EXPORTED, SOURCE, absent
from gputaskman.fleet.promsystem import SWAP_DEVICE_SERIES, SYSTEM_SERIES, system_doc
from gputaskman.offline.recorded import RecordedSystem
from gputaskman.render.exporter import DEVICE_FIELDS
from gputaskman.render.exporter_families import metric_name

PROBLEM_DETAIL = "detail not exported to Prometheus"
WHERE = "prometheus"
TIMESTAMP = "gputaskman_sample_timestamp_seconds"
REASONS = {r.value: r for r in Reason}
# a series name -> (DeviceMetrics field, its kind, what its value is divided by)
DEVICE_SERIES: dict[str, tuple[str, Kind, float]] = {
    metric_name(base, unit, kind): (fld, kind, scale)
    for fld, (base, unit, scale, _doc) in DEVICE_FIELDS.items()
    for kind in Kind
}
_MEASURED_NAME = {
    fld: metric_name(base, unit, Kind.MEASURED)
    for fld, (base, unit, _scale, _doc) in DEVICE_FIELDS.items()
}
_PROC_MEMORY = {"vram": "dedicated", "paged": "paged", "footprint": "footprint", **MEMORY_SERIES}
# a process's host readings: the series' word -> (the document's key, the series' unit)
_PROC_HOST = {"ram": ("ram_bytes", "bytes"), "cpu": ("cpu_percent", "percent")}
_PROC_NAME = re.compile(
    r"gputaskman_process_(\w+?)(?:_(inferred|estimated|runtime))?_(bytes|percent)"
)
# what the fleet table is made of (`view.fleet_rows`): the series a refresh reads of each
# changed host when only the table is shown
TABLE_SERIES = (
    "gputaskman_gpu_info",
    TIMESTAMP,
    "gputaskman_backend_up",
    "gputaskman_sample_problems",
    "gputaskman_gpu_attributed_complete",
    "gputaskman_process_info",
    "gputaskman_process_model_info",
    *(
        name
        for name, (fld, _kind, _scale) in DEVICE_SERIES.items()
        if fld in ("memory_used_bytes", "memory_total_bytes", "util_gpu_percent")
    ),
    metric_name("gputaskman_process_vram", "bytes", Kind.MEASURED),
    metric_name("gputaskman_process_vram", "bytes", Kind.INFERRED),
    "gputaskman_process_ram_bytes",  # an older serve's only name for a row of unknown VRAM
    TABLE_PATTERN,  # the GPU's health readings: the table flags an unhealthy GPU
)
TABLE_REGEX = "|".join(TABLE_SERIES)  # names (and one name prefix + .+): nothing escaped
TABLE_NOTE = (
    "built from the fleet table's series in Prometheus ({url}, {query}): open the host to "
    "read all it exported"
)
NOTE = (
    "built from Prometheus's series ({url}, {query}): the numbers its serve exported, "
    "not the host's own document (no command lines, process details or memory split)"
)


@dataclass(slots=True)
class _Proc:
    pid: int
    host: str | None
    name: str | None
    adapter: str | None
    contexts: tuple[str, ...] = ()
    parent_pid: int | None = None
    unique: bool = False
    readings: dict[str, Reading] = field(default_factory=dict)
    engines: dict[str, Reading] = field(default_factory=dict)
    model: ModelRef | None = None
    host_readings: dict[str, Reading] = field(default_factory=dict)  # ram_bytes, cpu_percent
    swapped_to: str | None = None
    owner: Owner | None = None


def _kind(labels: Mapping[str, str], fallback: Kind) -> Kind:
    return KINDS.get(labels.get("provenance", ""), fallback)


_FLOAT_MAX = sys.float_info.max
_SOURCES: dict[str, str] = {}  # series name -> a reading's source (a bounded memo)
_PARSED: dict[str, tuple[str, Kind, str] | None] = {}  # process series name -> its parts


def _source(name: str) -> str:
    source = f"{SOURCE}:{name}"
    if len(_SOURCES) < 4096:
        _SOURCES[name] = source
    return source


def _parsed(name: str) -> tuple[str, Kind, str] | None:
    """A process series' name as (what, kind, unit), or None when it is no reading."""
    if name in _PARSED:
        return _PARSED[name]
    m = _PROC_NAME.fullmatch(name)
    got = None
    if m is not None:
        what, kind_word, unit = m.groups()
        got = (what, KINDS.get(kind_word or "measured", Kind.MEASURED), unit)
    if len(_PARSED) < 4096:
        _PARSED[name] = got
    return got


class _Builder:
    """One host's readings, checked as they are read (see the module docstring)."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def reading(
        self, name: str, value: float, kind: Kind, scale: float = 1, adapter: str | None = None
    ) -> Reading:
        # NaN fails both comparisons; every reading of every changed host comes through here
        if not 0 <= value <= _FLOAT_MAX:
            return self.impossible(name, value, kind, adapter)
        if scale != 1:
            value /= scale
        source = _SOURCES.get(name) or _source(name)
        return checked_reading(
            int(value) if value.is_integer() else value, kind, source, None, None
        )

    def impossible(
        self, name: str, value: float, kind: Kind, adapter: str | None, why: str = ""
    ) -> Reading:
        detail = f"impossible value {value:g} in Prometheus{why}"
        self.problems.append(Problem(WHERE, Reason.QUERY_FAILED, f"{name}: {detail}", adapter))
        return Reading.missing(Reason.QUERY_FAILED, f"{SOURCE}:{name}", detail, kind)


# a reading without a series: immutable, so one object per field serves every host
_ABSENT = {fld: absent(name) for fld, name in _MEASURED_NAME.items()}


def _pid(text: str) -> tuple[int, str | None] | None:
    host, _, pid = text.rpartition(":")  # another OS's process: "windows:1234"
    return (int(pid), host or None) if pid.isdigit() else None


def host_sample(samples: Iterable[Sample], *, note: str) -> tuple[Snapshot, RecordedSystem]:
    """The `Snapshot` one host's series describe and its host sample: the system object
    (None when the host exported none of its series) and each process's RAM and CPU, as a
    document's host sample is (`recorded.RecordedSystem`); see the module docstring."""
    b, hm = _Builder(), HealthSeries()
    system: dict[str, dict[str, Reading]] = {}
    swap_devices: dict[tuple[str, str], dict[str, Reading]] = {}
    adapters: dict[str, Adapter] = {}
    devices: dict[str, dict[str, Reading]] = {}
    extra: dict[str, dict[str, Reading]] = {}
    procs: dict[tuple[str, str, str], _Proc] = {}
    taken: float | None = None
    backend_up: float | None = None
    backend_info: Mapping[str, str] = {}
    problems: list[tuple[str, str, str, float]] = []
    incomplete: set[str] = set()  # GPUs whose serve said the attributed sum is a lower bound
    for s in samples:
        labels = s.metric
        value = s.value[1]
        name = labels.get("__name__", "")
        if hm.take(b, name, labels, value):  # a GPU's health and MIG series (`promhealth`)
            continue
        if name == TIMESTAMP:
            taken = value
        elif name == "gputaskman_backend_up":
            backend_up = value
        elif name == "gputaskman_backend_info":
            backend_info = labels
        elif name == "gputaskman_sample_problems":
            where, reason = labels.get("where", ""), labels.get("reason", "")
            problems.append((where, reason, labels.get("pci_bus_id", ""), value))
        elif name == "gputaskman_gpu_attributed_complete":
            if value == 0:
                incomplete.add(labels.get("pci_bus_id", ""))
        elif name == "gputaskman_gpu_info":
            pci = labels.get("pci_bus_id", "")
            index = labels.get("gpu", "")
            if pci and index.isdigit():
                adapters[pci] = Adapter(
                    int(index),
                    labels.get("vendor") or "unknown",
                    labels.get("gpu_name") or None,
                    labels.get("uuid") or None,
                    pci,
                    labels.get("backend") or SOURCE,
                )
        elif name.startswith("gputaskman_gpu_"):
            pci = labels.get("pci_bus_id", "")
            known = DEVICE_SERIES.get(name)
            if known is not None:
                fld, kind, scale = known
                devices.setdefault(pci, {})[fld] = b.reading(name, value, kind, scale, pci)
            elif name not in (
                "gputaskman_gpu_attributed_bytes",
                "gputaskman_gpu_attributed_complete",
            ):
                kind = _kind(labels, Kind.MEASURED)
                key = name.removeprefix("gputaskman_gpu_").replace(f"_{kind.value}_", "_")
                extra.setdefault(pci, {})[key] = b.reading(name, value, kind, 1, pci)
        elif name.startswith("gputaskman_process_"):
            _process_series(b, procs, name, labels, value)
        elif name in SYSTEM_SERIES:
            section, key, kind = SYSTEM_SERIES[name]
            system.setdefault(section, {})[key] = b.reading(name, value, kind)
        elif name in SWAP_DEVICE_SERIES:
            dev = (labels.get("device", ""), labels.get("type", ""))
            swap_devices.setdefault(dev, {})[SWAP_DEVICE_SERIES[name]] = b.reading(
                name, value, Kind.MEASURED
            )
    metrics = {pci: _device_metrics(b, pci, rs) for pci, rs in devices.items() if pci in adapters}
    for pci in adapters:
        metrics.setdefault(pci, _device_metrics(b, pci, {}))
    backend = backend_info.get("backend") or (
        next(iter(adapters.values())).backend if adapters else SOURCE
    )
    listed = [
        Problem(
            where or WHERE,
            REASONS.get(reason, Reason.QUERY_FAILED),
            PROBLEM_DETAIL if reason in REASONS else reason,
            pci or None,
        )
        for where, reason, pci, n in problems
        for _ in range(min(int(n), 100) if math.isfinite(n) and n > 0 else 0)
    ]
    backend_problem = None
    if backend_up is not None and backend_up == 0:
        # the backend's own problem when the serve listed it (it counts each once)
        backend_problem = next(
            (p for p in listed if p.where.startswith("backend")),
            Problem("backend", Reason.UNAVAILABLE, "gputaskman_backend_up is 0"),
        )
    processes = tuple(hm.placed(key, _proc_gpu(p)) for key, p in procs.items())
    host = RecordedSystem(system_doc(b, system, swap_devices), _host_readings(procs))
    snapshot = Snapshot(
        taken=taken if taken is not None and math.isfinite(taken) and taken > 0 else 0.0,
        backend=backend,
        adapters=tuple(sorted(adapters.values(), key=lambda a: a.index)),
        metrics=metrics,
        processes=processes,
        problems=(*listed, *b.problems),
        notes=(note,),
        driver_version=backend_info.get("driver_version") or None,
        backend_problem=backend_problem,
        extra_metrics=extra,
        health=hm.health_of(adapters),
        mig=hm.mig_of(adapters),
    )
    return _unexplained(snapshot, incomplete & set(adapters)), host


UNEXPLAINED = (
    "gputaskman_gpu_attributed_complete is 0, and no series says why (an older serve's "
    "problems name no GPU): the sum is a lower bound"
)


def _unexplained(snapshot: Snapshot, incomplete: set[str]) -> Snapshot:
    """`snapshot` with a problem on each GPU in `incomplete` (its serve said its attributed
    sum is a lower bound) whose series do not already say so."""
    more = tuple(
        Problem("processes.unexplained", Reason.UNAVAILABLE, UNEXPLAINED, pci)
        for pci in sorted(incomplete)
        if snapshot.attributed_complete_on(pci)
    )
    return dataclasses.replace(snapshot, problems=snapshot.problems + more) if more else snapshot


def _host_readings(procs: Mapping[tuple[str, str, str], _Proc]) -> dict[tuple, dict[str, Reading]]:
    """Each of this host's processes' RAM and CPU readings (a process on two GPUs has the
    same ones in both rows), unknown without a series; by (PID, start time) as a host
    sample's lookup takes them (no start time is exported)."""
    out: dict[tuple, dict[str, Reading]] = {}
    for p in procs.values():
        if p.host is not None:
            continue  # another OS's process: this machine's host sample knows nothing of it
        got = out.setdefault((p.pid, None), {})
        for key, r in p.host_readings.items():
            if key not in got or (got[key].value is None and r.value is not None):
                got[key] = r
    for got in out.values():
        for what, (key, unit) in _PROC_HOST.items():
            if key not in got:
                got[key] = absent(f"gputaskman_process_{what}_{unit}")
    return out


def _device_metrics(b: _Builder, pci: str, rs: dict[str, Reading]) -> DeviceMetrics:
    used, total = rs.get("memory_used_bytes"), rs.get("memory_total_bytes")
    if (
        used is not None
        and total is not None
        and used.value is not None
        and total.value is not None
        and used.value > total.value
    ):
        rs["memory_used_bytes"] = b.impossible(
            used.source.removeprefix(f"{SOURCE}:"),
            float(used.value),
            used.kind,
            pci,
            f": over the total of {total.value:g}",
        )
    return DeviceMetrics(*[rs.get(fld) or _ABSENT[fld] for fld in DEVICE_FIELDS])


def _process_series(
    b: _Builder,
    procs: dict[tuple[str, str, str], _Proc],
    name: str,
    labels: Mapping[str, str],
    value: float,
) -> None:
    pid = _pid(labels.get("pid", ""))
    if pid is None:
        return
    pci = labels.get("pci_bus_id", "")
    key = (labels.get("pid", ""), labels.get("name", ""), pci)
    p = procs.get(key)
    if p is None:
        p = procs[key] = _Proc(pid[0], pid[1], labels.get("name") or None, pci or None)
    if name == "gputaskman_process_info":
        contexts = labels.get("contexts", "")
        p.contexts = tuple(c for c in contexts.split(",") if c)
        parent = labels.get("parent_pid", "")
        p.parent_pid = int(parent) if parent.isdigit() else None
        p.unique = labels.get("inferred_unique") == "true"
        return
    if name == "gputaskman_process_model_info":
        model = labels.get("model_name")
        if model:
            confirmed = labels.get("confirmed") == "true"
            p.model = ModelRef(
                model,
                labels.get("evidence") or "unknown",
                confirmed,
                status="confirmed" if confirmed else None,
            )
        return
    if name == OWNER_INFO:
        p.owner = owner_from(labels)
        return
    parsed = _parsed(name)
    if parsed is None:
        return
    what, kind, unit = parsed
    host = _PROC_HOST.get(what)
    if host is not None:
        key, host_unit = host
        if unit == host_unit:
            p.host_readings[key] = b.reading(name, value, kind, 1, pci or None)
    elif unit == "percent" and what.endswith("_utilization"):
        # the document's name: "gpu_percent" (an older serve wrote "gpu_percent_utilization")
        engine = what.removesuffix("_utilization").removesuffix("_percent") + "_percent"
        p.engines[engine] = b.reading(name, value, kind, 1, pci or None)
    elif unit == "bytes" and what in _PROC_MEMORY:
        slot = _PROC_MEMORY[what]
        if what == "vram" and kind is Kind.INFERRED:
            slot = "inferred"
        elif what == "vram" and kind is not Kind.MEASURED:
            return  # a model's estimated or runtime total: not the process's VRAM reading
        elif what == "swapped":
            p.swapped_to = labels.get("swapped_to") or None
        p.readings[slot] = b.reading(name, value, kind, 1, pci or None)


# what the host's scan found (command line, runtimes, user, ...) is not exported
_NO_DETAIL = ProcDetail(scanned=False, reason=Reason.UNAVAILABLE, reason_detail=NOT_EXPORTED)


def _proc_gpu(p: _Proc) -> ProcGpu:
    dedicated = p.readings.get("dedicated") or Reading.missing(
        Reason.UNAVAILABLE, f"{SOURCE}:gputaskman_process_vram_bytes", NO_SERIES
    )
    return ProcGpu(
        pid=p.pid,
        create_time=None,
        name=p.name,
        adapter=p.adapter,
        contexts=p.contexts,
        dedicated=dedicated,
        inferred=p.readings.get("inferred"),
        engines=dict(sorted(p.engines.items())),
        detail=_NO_DETAIL,
        model=p.model,
        paged=p.readings.get("paged"),
        footprint=p.readings.get("footprint"),
        host=p.host,
        parent_pid=p.parent_pid,
        unique=p.unique,
        memory=memory_from(p.readings, p.swapped_to),
        owner=p.owner,
    )


def by_instance(samples: Sequence[Sample], label: str = "instance") -> dict[str, list[Sample]]:
    """The samples of each host, keyed by `label`'s value (samples without it are left
    out)."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        key = s.metric.get(label)
        if key:
            out.setdefault(key, []).append(s)
    return out
