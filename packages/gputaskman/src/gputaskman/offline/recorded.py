"""Rebuild model objects from a saved ``--json`` object, so replay can feed the TUI.

Theory of operation
-------------------
`snapshot_from_json` is the inverse of `report.to_json_dict`: reading objects become
`Reading`s with the same value, kind, source, reason and detail; adapters, metrics,
processes and problems come back as the frozen dataclasses of `model`. Derived fields in
the JSON (``attributed_bytes``, ``shown_vram``, ``process_list``) are not read: the model
derives them again from the same readings, so nothing recorded is re-summed differently.

The weights/KV view (``breakdown``) and an app's model (``app_model``) stay the recorded
objects (the report passes a recorded mapping through unchanged). The ``system`` object
is kept as recorded inside a `RecordedSystem`, which offers the
duck-typed surface the report and the TUI use (`to_json_dict`, `process_readings`,
`render_lines`): per-process RAM/CPU readings come from the recorded process rows, and the
system panel is rendered by rebuilding host.py's `SystemInfo` from the recorded numbers.
So ``report.to_json_dict(*snapshot_from_json(doc), selected_gpu=doc["selected_gpu"])``
gives ``doc`` back; tests check that round trip on real record files.

Any structural problem raises `recordfile.SnapshotError`, which readers report as a
malformed line; a reason string this version does not know is kept as ``unavailable``
with the recorded text in ``detail`` rather than rejecting the whole line.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    Kind,
    ModelRef,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.core import host, text_report
from gputaskman.offline.recordfile import SnapshotError, is_number

RECORDED_SOURCE = "recorded"


def _reason(text: object) -> tuple[Reason, str | None]:
    if not isinstance(text, str):
        raise SnapshotError(f"reason {text!r} is not a string")
    try:
        return Reason(text), None
    except ValueError:
        return Reason.UNAVAILABLE, f"recorded reason: {text}"


def reading_from_json(obj: object, where: str) -> Reading:
    if not isinstance(obj, Mapping):
        raise SnapshotError(f"{where}: not a reading object")
    try:
        kind = Kind(obj["kind"])
        value = obj["value"]
        source = obj["source"]
        detail = obj.get("detail")
        if value is not None and not is_number(value):
            raise SnapshotError(f"{where}: value {value!r} is not a number")
        if not isinstance(source, str) or (detail is not None and not isinstance(detail, str)):
            raise SnapshotError(f"{where}: source/detail not text")
        if obj.get("reason") is None:
            return Reading(value, kind, source, None, detail)
        reason, extra = _reason(obj["reason"])
        if extra:
            detail = extra if detail is None else f"{detail} ({extra})"
        return Reading(value, kind, source, reason, detail)
    except (KeyError, ValueError, TypeError) as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"{where}: bad reading ({exc})") from None


def _opt_reading(obj: object, where: str) -> Reading | None:
    return None if obj is None else reading_from_json(obj, where)


def problem_from_json(obj: object, where: str) -> Problem:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("where"), str):
        raise SnapshotError(f"{where}: not a problem object")
    reason, extra = _reason(obj.get("reason"))
    detail = obj.get("detail")
    if extra:
        detail = extra if detail is None else f"{detail} ({extra})"
    return Problem(obj["where"], reason, detail, obj.get("adapter"))


def _str_tuple(v: object, where: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SnapshotError(f"{where}: not a list of strings")
    return tuple(v)


def _process_from_json(row: object, i: int) -> tuple[ProcGpu, dict[str, Reading]]:
    where = f"processes[{i}]"
    if not isinstance(row, Mapping):
        raise SnapshotError(f"{where}: not an object")
    pid = row.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        raise SnapshotError(f"{where}: pid {pid!r} is not an integer")
    started = row.get("started_at")
    create_time = float(started) if is_number(started) else None
    engines = row.get("engines") or {}
    if not isinstance(engines, Mapping):
        raise SnapshotError(f"{where}.engines: not an object")
    cmdline = row.get("cmdline")
    evidence = []
    for ev in row.get("model_evidence") or []:
        if not isinstance(ev, Mapping) or not isinstance(ev.get("evidence"), str):
            raise SnapshotError(f"{where}.model_evidence: bad entry")
        evidence.append((ev["evidence"], ev.get("path")))
    scan_reason = row.get("scan_reason")
    detail = ProcDetail(
        cmdline=None if cmdline is None else _str_tuple(cmdline, f"{where}.cmdline"),
        runtimes=_str_tuple(row.get("runtimes", []), f"{where}.runtimes"),
        model_files=_str_tuple(row.get("model_files", []), f"{where}.model_files"),
        category=row.get("category"),
        scanned=bool(row.get("scanned", False)),
        reason=None if scan_reason is None else _reason(scan_reason)[0],
        exe=row.get("exe"),
        model_evidence=tuple(evidence),
        reason_detail=row.get("scan_detail"),
    )
    model = _model_from_json(row.get("model"), f"{where}.model")
    breakdown = row.get("breakdown")
    if breakdown is not None and not isinstance(breakdown, Mapping):
        raise SnapshotError(f"{where}.breakdown: not an object")
    app = row.get("app_model")
    if app is not None and not isinstance(app, Mapping):
        raise SnapshotError(f"{where}.app_model: not an object")
    # platform fields (Windows, WSL, macOS); absent in files written before them
    host_os = row.get("host")
    if host_os is not None and not isinstance(host_os, str):
        raise SnapshotError(f"{where}.host: not a string")
    parent = row.get("parent_pid")
    if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool)):
        raise SnapshotError(f"{where}.parent_pid: {parent!r} is not an integer")
    proc = ProcGpu(
        pid=pid,
        create_time=create_time,
        name=row.get("name"),
        adapter=row.get("gpu"),
        contexts=_str_tuple(row.get("contexts", []), f"{where}.contexts"),
        dedicated=reading_from_json(row.get("vram_bytes"), f"{where}.vram_bytes"),
        inferred=_opt_reading(row.get("vram_inferred_bytes"), f"{where}.vram_inferred_bytes"),
        engines={k: reading_from_json(v, f"{where}.engines.{k}") for k, v in engines.items()},
        detail=detail,
        model=model,
        # kept as recorded: report.breakdown_json passes a mapping through unchanged
        breakdown=None if breakdown is None else dict(breakdown),
        app_model=None if app is None else RecordedApp(app),
        paged=_opt_reading(row.get("paged_bytes"), f"{where}.paged_bytes"),
        footprint=_opt_reading(row.get("footprint_bytes"), f"{where}.footprint_bytes"),
        host=host_os,
        parent_pid=parent,
        unique=bool(row.get("inferred_unique", False)),
    )
    host_readings = {
        k: reading_from_json(row[k], f"{where}.{k}")
        for k in ("ram_bytes", "cpu_percent")
        if row.get(k) is not None
    }
    return proc, host_readings


def _model_from_json(m: object, where: str) -> ModelRef | None:
    if m is None:
        return None
    if not isinstance(m, Mapping) or not isinstance(m.get("name"), str):
        raise SnapshotError(f"{where}: bad object")
    api_obj = m.get("api")
    api: Mapping[str, Any] = api_obj if isinstance(api_obj, Mapping) else {}
    return ModelRef(
        name=m["name"],
        evidence=str(m.get("evidence")),
        confirmed=bool(m.get("confirmed")),
        path=m.get("path"),
        store=m.get("store"),
        status=m.get("status"),
        sources=_str_tuple(m.get("sources", []), f"{where}.sources"),
        pending=bool(m.get("pending", False)),
        api_runtime=api.get("runtime"),
        api_endpoint=api.get("endpoint"),
        api_errors=_str_tuple(api.get("errors", []), f"{where}.api.errors"),
        header_error=m.get("header_error"),
    )


class RecordedApp:
    """An app adapter's recorded object (``app_model``): its keys as attributes, for the
    TUI, and `to_json` giving the recorded object back."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self._doc = dict(doc)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._doc[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_json(self) -> dict[str, Any]:
        return dict(self._doc)


class RecordedSystem:
    """The recorded ``system`` object, with the surface `report` and the TUI use."""

    def __init__(
        self,
        doc: Mapping[str, Any] | None,
        per_process: Mapping[tuple[int, float | None], Mapping[str, Reading]],
    ) -> None:
        self.doc = doc
        self._per_process = per_process

    def to_json_dict(self) -> Any:
        return None if self.doc is None else dict(self.doc)

    def process_readings(self, pid: int, create_time: float | None) -> Mapping[str, Reading]:
        return self._per_process.get((pid, create_time), {})

    def render_lines(self) -> list[str]:
        if self.doc is None:
            return ["not recorded"]
        try:
            return text_report.system_lines(system_info_from_json(self.doc))
        except (KeyError, TypeError, ValueError, AttributeError):
            # a shape this version does not know: show it as recorded, not guessed at
            return [f"{k}: {v}" for k, v in self.doc.items() if k != "reasons"]


def _host_reading(section: Mapping[str, Any], name: str) -> Reading:
    """One system number: a reading object (current files) or a plain number with its
    reason in ``reasons`` (files written before the system section used reading objects)."""
    v = section.get(name)
    if isinstance(v, Mapping):
        return reading_from_json(v, f"system.{name}")
    if is_number(v):
        return Reading.measured(v, RECORDED_SOURCE)
    why = (section.get("reasons") or {}).get(name)
    if isinstance(why, str):
        text, _, detail = why.partition(": ")
        reason, extra = _reason(text)
        return Reading.missing(reason, RECORDED_SOURCE, detail or extra)
    return Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded")


def _plain(v: object) -> int | None:
    """A swap device's number, recorded as a reading object or a plain number."""
    if isinstance(v, Mapping):
        v = v.get("value")
    return int(v) if is_number(v) else None


def system_info_from_json(doc: Mapping[str, Any]) -> host.SystemInfo:
    """host.py's `SystemInfo` from its recorded ``system`` object (numbers and reasons)."""
    mem, swap, cpu = doc["memory"], doc["swap"], doc["cpu"]
    devices = swap.get("devices")
    return host.SystemInfo(
        taken=float(doc.get("taken") or 0.0),
        memory=host.MemoryInfo(*(_host_reading(mem, n) for n in host.MemoryInfo.__slots__)),
        swap=host.SwapInfo(
            total_bytes=_host_reading(swap, "total_bytes"),
            free_bytes=_host_reading(swap, "free_bytes"),
            used_bytes=_host_reading(swap, "used_bytes"),
            devices=None
            if devices is None
            else tuple(
                host.SwapDevice(
                    str(d["filename"]),
                    str(d["type"]),
                    _plain(d.get("size_bytes")),
                    _plain(d.get("used_bytes")),
                    _plain(d.get("priority")),
                    bool(d.get("deleted", False)),
                )
                for d in devices
            ),
            devices_reason=swap.get("devices_reason") or (swap.get("reasons") or {}).get("devices"),
        ),
        cpu=host.CpuInfo(*(_host_reading(cpu, n) for n in host.CpuInfo.__slots__)),
        processes=MappingProxyType({}),
    )


def snapshot_from_json(doc: Mapping[str, Any]) -> tuple[Snapshot, RecordedSystem]:
    """The `Snapshot` and system a ``--json`` object describes (see the module docstring)."""
    try:
        return _snapshot_from_json(doc)
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"bad snapshot structure ({type(exc).__name__}: {exc})") from None


def _snapshot_from_json(doc: Mapping[str, Any]) -> tuple[Snapshot, RecordedSystem]:
    adapters: list[Adapter] = []
    metrics: dict[str, DeviceMetrics] = {}
    extra: dict[str, dict[str, Reading]] = {}
    for i, a in enumerate(doc["adapters"]):
        where = f"adapters[{i}]"
        if not isinstance(a, Mapping) or not isinstance(a.get("pci_bus_id"), str):
            raise SnapshotError(f"{where}: not an adapter object with a pci_bus_id")
        adapter = Adapter(
            index=int(a["index"]),
            vendor=str(a.get("vendor")),
            name=a.get("name"),
            uuid=a.get("uuid"),
            pci_bus_id=a["pci_bus_id"],
            backend=str(a.get("backend", doc["backend"])),
        )
        adapters.append(adapter)
        em = a.get("extra_metrics") or {}
        if not isinstance(em, Mapping):
            raise SnapshotError(f"{where}.extra_metrics: not an object")
        if em:
            extra[adapter.pci_bus_id] = {
                str(k): reading_from_json(v, f"{where}.extra_metrics.{k}") for k, v in em.items()
            }
        m = a.get("metrics")
        if m is not None:
            metrics[adapter.pci_bus_id] = DeviceMetrics(
                *(reading_from_json(m[n], f"{where}.metrics.{n}") for n in DeviceMetrics.__slots__)
            )
    procs: list[ProcGpu] = []
    per_process: dict[tuple[int, float | None], dict[str, Reading]] = {}
    for i, row in enumerate(doc["processes"]):
        p, readings = _process_from_json(row, i)
        procs.append(p)
        per_process[p.key] = readings
    problems = [problem_from_json(p, f"problems[{i}]") for i, p in enumerate(doc["problems"])]
    backend_problem = None
    if doc.get("unavailable") is not None:
        backend_problem = problem_from_json(doc["unavailable"], "unavailable")
        # the same object as in `problems`, as the collector builds it
        backend_problem = next((p for p in problems if p == backend_problem), backend_problem)
    notes = _str_tuple(doc.get("notes", []), "notes")
    system_doc = doc.get("system")
    if system_doc is not None and not isinstance(system_doc, Mapping):
        raise SnapshotError("system: not an object")
    snap = Snapshot(
        taken=float(doc["taken"]),
        backend=str(doc["backend"]),
        adapters=tuple(adapters),
        metrics=metrics,
        processes=tuple(procs),
        problems=tuple(problems),
        notes=notes,
        driver_version=doc.get("driver_version"),
        backend_problem=backend_problem,
        extra_metrics=extra,
    )
    return snap, RecordedSystem(system_doc, per_process)
