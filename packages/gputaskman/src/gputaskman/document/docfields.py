"""The snapshot reader over a parsed JSON object (`Fields`): the reference reader, which
decides every refusal and its message, and reads what the typed decoder (`reader`) does not
take (see `reader.read_document`). `check_snapshot` checks a parsed line's top-level shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputaskman.base import schema
from gputaskman.base.readings import (
    DeviceMetrics,
    Kind,
    MigInstance,
    MigState,
    ModelRef,
    Owner,
    ProcDetail,
    ProcGpu,
    ProcMemory,
    Reading,
    Reason,
)
from gputaskman.document.doctypes import (
    RECORDED_SOURCE,
    AdapterDoc,
    Document,
    ProcessDoc,
    SwapDeviceDoc,
    SwapDoc,
    SystemDoc,
    value_of,
)
from gputaskman.document.jsonfields import (
    Fields,
    NotASnapshot,
    SnapshotError,
    is_number,
    problem_from_json,
    reason_from_json,
)
from gputaskman.intel.apps import AppModel
from gputaskman.intel.llm import LlmView, ViewPart
from gputaskman.sampling import duvmpool


def check_snapshot(doc: object) -> dict[str, Any]:
    """The document when it has the top-level shape of a schema-1 ``--json`` object, else
    `NotASnapshot` (a `SnapshotError`) saying what is wrong. Cheap: record files check
    every line with it and leave the rest to `read_document` when a line is used."""
    if not isinstance(doc, dict):
        raise NotASnapshot(f"not a JSON object but {type(doc).__name__}")
    if doc.get("schema") != schema.NAME:
        raise NotASnapshot(f"not a {schema.NAME} object (schema {doc.get('schema')!r})")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise NotASnapshot(f"schema_version {version!r} is not an integer")
    if version != schema.VERSION:
        raise NotASnapshot(
            f"schema_version {version} is not supported (this gputaskman reads {schema.VERSION})"
        )
    if not is_number(doc.get("taken")):
        raise NotASnapshot(f"taken {doc.get('taken')!r} is not a finite number")
    if not isinstance(doc.get("backend"), str):
        raise NotASnapshot("backend is missing or not a string")
    for key in ("adapters", "processes"):
        if not isinstance(doc.get(key), list):
            raise NotASnapshot(f"{key} is missing or not a list")
    return doc


# ---------------------------------------------------------------------------- processes


def _model(o: Fields | None) -> ModelRef | None:
    if o is None:
        return None
    api = o.obj("api")
    return ModelRef(
        name=o.need_text("name"),
        evidence=o.need_text("evidence"),
        confirmed=bool(o.flag("confirmed")),
        path=o.text("path"),
        store=o.text("store"),
        status=o.text("status"),
        sources=o.texts("sources"),
        pending=bool(o.flag("pending")),
        api_runtime=None if api is None else api.text("runtime"),
        api_endpoint=None if api is None else api.text("endpoint"),
        api_errors=() if api is None else api.texts("errors"),
        header_error=o.text("header_error"),
    )


def _part(name: str, o: Fields) -> ViewPart:
    return ViewPart(
        name,
        o.need_reading("reading"),
        o.readings_in("alternatives"),
        o.text_or("marker", ""),
    )


def _breakdown(o: Fields | None) -> LlmView | None:
    if o is None:
        return None
    parts = o.need_obj("parts")
    return LlmView(
        model=o.text("model"),
        path=o.text("path"),
        evidence=o.text_or("evidence", ""),
        status=o.text_or("status", ""),
        owner_marker=o.text_or("owner_marker", ""),
        runtime=o.text("runtime"),
        architecture=o.text("architecture"),
        file_type=o.text("file_type"),
        parameter_count=o.integer("parameter_count"),
        n_ctx=o.integer("n_ctx"),
        n_ctx_source=o.text("n_ctx_source"),
        parts=tuple(_part(str(k), parts.need_obj(str(k))) for k in parts.m),
        reported_total=value_of(o.reading("reported_total")),
        estimated_total=value_of(o.reading("estimated_total")),
        notes=o.texts("notes"),
        format=o.text("format"),
        kv_cache_dtype=o.text("kv_cache_dtype"),
        figures=None
        if o.obj("runtime_figures") is None
        else tuple(o.readings("runtime_figures").items()),
    )


def _app(o: Fields | None) -> AppModel | None:
    if o is None:
        return None
    return AppModel(
        app=o.need_text("app"),
        selected=o.text("selected"),
        settings_path=None,  # not written: the app's own files stay on the machine
        last_event=o.text("last_event"),
        last_event_model=o.text("last_event_model"),
        last_event_time=o.text("last_event_time"),
        log_path=None,
        reasons=o.texts("reasons"),
    )


def _evidence(o: Fields) -> tuple[str, str | None]:
    return (o.need_text("evidence"), o.text("path"))


def _process(o: Fields) -> ProcessDoc:
    scan = o.m.get("scan_reason")
    detail = ProcDetail(
        cmdline=o.texts("cmdline") if o.m.get("cmdline") is not None else None,
        runtimes=o.texts("runtimes"),
        model_files=o.texts("model_files"),
        category=o.text("category"),
        scanned=bool(o.flag("scanned")),
        reason=None if scan is None else reason_from_json(scan, o.where("scan_reason"))[0],
        exe=o.text("exe"),
        model_evidence=tuple(_evidence(e) for e in o.objs("model_evidence")),
        reason_detail=o.text("scan_detail"),
        user=o.text("user"),
        ppid=o.integer("ppid"),
    )
    proc = ProcGpu(
        pid=o.need_integer("pid"),
        create_time=o.number("started_at"),
        name=o.text("name"),
        adapter=o.text("gpu"),
        contexts=o.texts("contexts"),
        dedicated=o.need_reading("vram_bytes"),
        inferred=o.reading("vram_inferred_bytes"),
        engines=o.readings("engines"),
        detail=detail,
        model=_model(o.obj("model")),
        breakdown=_breakdown(o.obj("breakdown")),
        app_model=_app(o.obj("app_model")),
        paged=o.reading("paged_bytes"),
        footprint=o.reading("footprint_bytes"),
        host=o.text("host"),
        parent_pid=o.integer("parent_pid"),
        unique=bool(o.flag("inferred_unique")),
        memory=_memory(o),
        owner=_owner(o.obj("owner")),
        mig=_mig_ref(o.obj("mig")),
    )
    return ProcessDoc(proc, o.reading("ram_bytes"), o.reading("cpu_percent"))


def _mig_ref(o: Fields | None) -> tuple[int, int] | None:
    if o is None:
        return None
    return (o.need_integer("gpu_instance_id"), o.need_integer("compute_instance_id"))


_NOT_RECORDED = Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded")


def _memory(o: Fields) -> ProcMemory | None:
    got = [o.reading(k) for k in ("swapped_bytes", "locked_bytes", "pinned_bytes")]
    if got == [None, None, None]:
        return None
    swapped, locked, pinned = (_NOT_RECORDED if r is None else r for r in got)
    return ProcMemory(swapped, locked, pinned, o.text("swapped_to"))


def _owner(o: Fields | None) -> Owner | None:
    if o is None:
        return None
    why = o.m.get("reason")
    reason, extra = (None, None) if why is None else reason_from_json(why, o.where("reason"))
    detail = o.text("detail")
    if extra is not None:  # a reason this version does not know: its word kept
        detail = extra if detail is None else f"{detail} ({extra})"
    return Owner(
        cgroup=o.text("cgroup"),
        user=o.text("user"),
        pod_uid=o.text("pod_uid"),
        container_id=o.text("container_id"),
        container_runtime=o.text("container_runtime"),
        qos=o.text("qos"),
        slurm_job=o.text("slurm_job"),
        slurm_step=o.text("slurm_step"),
        unit=o.text("unit"),
        user_unit=bool(o.flag("user_unit")),
        session=o.text("session"),
        pod_name=o.text("pod_name"),
        pod_namespace=o.text("pod_namespace"),
        pod_source=o.text("pod_source"),
        reason=reason,
        detail=detail,
    )


# ---------------------------------------------------------------------------- system


def _host_number(o: Fields, key: str) -> Reading | None:
    """One system number: a reading object, or (early files) a plain number, or null with
    its reason in the section's ``reasons`` object."""
    v = o.m.get(key)
    if type(v) is dict or isinstance(v, Mapping):
        return o.reading(key)
    if is_number(v):
        return Reading.measured(v, RECORDED_SOURCE)
    if v is not None:
        raise SnapshotError(f"{o.where(key)}: expected a reading, got {type(v).__name__}")
    if key not in o.m:
        return None
    reasons = o.obj("reasons")
    why = None if reasons is None else reasons.text(key)
    if why is None:
        raise SnapshotError(f"{o.where(key)}: null without a reason")
    text, _, detail = why.partition(": ")
    reason, extra = reason_from_json(text, o.where(key))
    return Reading.missing(reason, RECORDED_SOURCE, detail or extra)


def _host_numbers(o: Fields | None) -> dict[str, Reading]:
    if o is None:
        return {}
    out = {}
    for key in o.m:
        if key != "reasons" and (r := _host_number(o, str(key))) is not None:
            out[str(key)] = r
    return out


def _swap(o: Fields | None) -> SwapDoc | None:
    if o is None:
        return None
    devices = None
    if o.m.get("devices") is not None:
        devices = tuple(
            SwapDeviceDoc(
                d.text("filename"),
                d.text("type"),
                _host_number(d, "size_bytes"),
                _host_number(d, "used_bytes"),
                _host_number(d, "priority"),
                bool(d.flag("deleted")),
            )
            for d in o.objs("devices")
        )
    devices_reason = o.text("devices_reason")
    reasons = o.obj("reasons")  # early files: the devices' reason was kept there
    if devices_reason is None and reasons is not None:
        devices_reason = reasons.text("devices")
    return SwapDoc(
        total_bytes=_host_number(o, "total_bytes"),
        free_bytes=_host_number(o, "free_bytes"),
        used_bytes=_host_number(o, "used_bytes"),
        devices=devices,
        devices_reason=devices_reason,
        problems=o.texts("problems"),
    )


def _runtime(o: Fields, key: str) -> Reading:
    """A duvm number; one a file does not hold is unknown, never 0."""
    r = o.reading(key)
    if r is None:
        return Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded", Kind.RUNTIME)
    return r


def _count(o: Fields, key: str) -> int | None:
    return value_of(o.reading(key))


def _pool(o: Fields | None) -> duvmpool.PoolInfo | None:
    if o is None:
        return None
    daemons = tuple(
        duvmpool.DaemonPool(
            socket=d.need_text("socket"),
            pid=d.integer("pid"),
            size_bytes=_runtime(d, "size_bytes"),
            replicas=_runtime(d, "replicas"),
            pages_written=_runtime(d, "pages_written"),
            degraded_slabs=_runtime(d, "degraded_slabs"),
            pages_lost=_runtime(d, "pages_lost"),
            health=d.text_or("health", "unknown"),
            reasons=d.texts("reasons"),
            swap_device=d.text("swap_device"),
            peers=tuple(
                duvmpool.PeerPages(
                    p.text_or("peer", "?"),
                    p.flag("connected"),
                    _runtime(p, "pages"),
                    _runtime(p, "reserved_pages"),
                    _runtime(p, "slabs"),
                )
                for p in d.objs("peers")
            ),
        )
        for d in o.objs("daemons", required=True)
    )
    lending = tuple(
        duvmpool.Lending(
            socket=m.need_text("socket"),
            capacity_bytes=_runtime(m, "capacity_bytes"),
            used_bytes=_runtime(m, "used_bytes"),
            reserved_bytes=_runtime(m, "reserved_bytes"),
            borrowers=tuple(
                duvmpool.Borrower(
                    b.text_or("client_id", "?"),
                    _runtime(b, "stored_bytes"),
                    _runtime(b, "reserved_bytes"),
                    _count(b, "connections"),
                )
                for b in m.objs("borrowers")
            ),
            borrowers_total=_count(m, "borrowers_listed_of"),
        )
        for m in o.objs("lending", required=True)
    )
    errors = o.obj("errors")
    return duvmpool.PoolInfo(
        daemons=daemons,
        lending=lending,
        errors={} if errors is None else {str(k): errors.text_or(str(k), "") for k in errors.m},
        looked=o.text_or("looked", duvmpool.DEFAULT_GLOB),
    )


def _system(o: Fields) -> SystemDoc:
    return SystemDoc(
        taken=o.number("taken"),
        memory=_host_numbers(o.obj("memory")),
        swap=_swap(o.obj("swap")),
        cpu=_host_numbers(o.obj("cpu")),
        processes_reason=o.text("processes_reason"),
        duvm=_pool(o.obj("duvm")),
    )


# ---------------------------------------------------------------------------- document


def _metrics(o: Fields | None) -> DeviceMetrics | None:
    if o is None:
        return None
    return DeviceMetrics(*[o.need_reading(n) for n in DeviceMetrics.__slots__])


def _mig(o: Fields | None) -> MigState | None:
    if o is None:
        return None
    instances = tuple(
        MigInstance(
            gpu_instance_id=i.need_integer("gpu_instance_id"),
            compute_instance_id=i.need_integer("compute_instance_id"),
            uuid=i.text("uuid"),
            memory_total_bytes=i.need_reading("memory_total_bytes"),
            memory_used_bytes=i.need_reading("memory_used_bytes"),
        )
        for i in o.objs("instances")
    )
    return MigState(o.need_reading("mode"), instances)


def _adapter(o: Fields, backend: str) -> AdapterDoc:
    return AdapterDoc(
        index=o.need_integer("index"),
        vendor=o.need_text("vendor"),
        name=o.text("name"),
        uuid=o.text("uuid"),
        pci_bus_id=o.text("pci_bus_id"),
        backend=o.text_or("backend", backend),  # files before per-adapter backends
        metrics=_metrics(o.obj("metrics")),
        extra_metrics=o.readings("extra_metrics"),
        attributed_bytes=o.integer("attributed_bytes"),
        attributed_complete=o.flag("attributed_complete"),
        health=o.readings("health"),
        mig=_mig(o.obj("mig")),
    )


def read_parsed(obj: object) -> Document:
    """The `Document` a parsed ``--json`` object describes; `SnapshotError` says why not."""
    o = Fields(check_snapshot(obj))
    backend = o.need_text("backend")
    problems = tuple(problem_from_json(p) for p in o.objs("problems"))
    got = o.obj("unavailable")
    unavailable = None if got is None else problem_from_json(got)
    # the same object as in `problems`, as the collector builds it
    unavailable = next((p for p in problems if p == unavailable), unavailable)
    system = o.obj("system")
    return Document(
        taken=o.m["taken"],  # checked above
        backend=backend,
        adapters=tuple(_adapter(a, backend) for a in o.objs("adapters")),
        processes=tuple(_process(p) for p in o.objs("processes")),
        problems=problems,
        notes=o.texts("notes"),
        driver_version=o.text("driver_version"),
        unavailable=unavailable,
        selected_gpu=o.integer("selected_gpu"),
        system=None if system is None else _system(system),
        taken_iso=o.text("taken_iso"),
        attributed_bytes=o.integer("attributed_bytes"),
        attributed_complete=o.flag("attributed_complete"),
    )
