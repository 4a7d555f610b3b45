"""The snapshot document read back: the one reader of what `report.to_json_dict` writes.

Theory of operation
-------------------
`read_document` turns a ``--json`` object (one line of a record file, or a host's answer;
its bytes or the parsed object) into a `Document` of frozen, typed objects. Every tool that
reads snapshots goes through it (the fleet, replay and its TUI, diff, summary and its
charts), so the format is known in one writer (`report`, with `report_models`) and this
reader; none of them touches the raw dict.

It reads into the model's own types wherever they describe the document exactly: `Reading`
for every reading object, `Problem`, `ProcGpu` (with `ProcDetail` and `ModelRef`) for a
process row, `llm.LlmView` for a weights / KV / compute breakdown, `apps.AppModel` for an
app's model and `duvmpool.PoolInfo` for ``system.duvm``; so replay shows a recorded process
exactly as a live one. Where the document holds something the model does not, it has its own
type (`doctypes`): `AdapterDoc`, `ProcessDoc`, `SystemDoc`. `Document.snapshot` is the
model's `Snapshot` of a document, for replay.

Two readers, one result. The document's shape is declared once, as msgspec Structs
(`docshape`). Bytes are decoded into them in C, every type checked on the way; a parsed
object (a dict) is converted into them (`msgspec.convert`). The objects are then built from
the Structs' attributes here, with the checks types cannot make (a number a float holds, a
value or a reason). A document this path does not take goes to the reference reader over
the parsed object (`docfields.read_parsed`), which reads it or raises the `SnapshotError`
naming the place; so every refusal, and its words, is the reference reader's. Besides
refusals, that path reads JSON that msgspec refuses and `json.loads` reads (a lone
surrogate such as ``"\\udcff"``, a byte-order mark, UTF-16), a number beyond a float's
range (``1e400``) in a key the reader uses (refused either way), and early files' system
numbers (bare numbers, or null with a ``reasons`` object). One input reads on the typed
path that the reference refuses: bytes with an integer of over 4300 digits in a key the
reader skips (msgspec skips it; `json.loads` refuses it).

Compatibility (``schema_version`` 1, additive changes only; `base.schema`'s JSON Schema):

* keys this version does not know are ignored; an optional key that is absent reads as null
  or empty, so files written before a key existed still read;
* a key the schema requires, or a value of the wrong type, raises `SnapshotError` naming
  the place (``processes[3].gpu: expected a string or null, got list``); readers report the
  line as malformed rather than guess; a top level that is not a schema-1 snapshot raises
  `NotASnapshot`, a `SnapshotError`;
* integers read exactly, up to a float's range; NaN and Infinity are refused (unknown is null);
* derived fields (``shown_vram``, ``process_list``, ``available``) are not read: the model
  derives them again from the same readings. The recorded sums (``attributed_bytes``,
  ``attributed_complete``) and ``taken_iso`` are kept as recorded, since diff and summary
  show what was recorded;
* a reason this version does not know reads as ``unavailable`` with the recorded text in
  ``detail``; system numbers of early files (plain numbers, their reasons in a ``reasons``
  object) read as measured readings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from gputaskman.base import schema
from gputaskman.base.readings import (
    DeviceMetrics,
    Kind,
    ModelRef,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    checked_reading,
)
from gputaskman.core import duvmpool
from gputaskman.core.docfields import check_snapshot, read_parsed
from gputaskman.core.docshape import (
    DOC_DECODER,
    AdapterShape,
    AppShape,
    BreakdownShape,
    DocShape,
    ModelShape,
    PoolShape,
    ProblemShape,
    ProcessShape,
    ReadingShape,
    SwapShape,
    SystemShape,
)
from gputaskman.core.doctypes import (
    RECORDED_SOURCE,
    AdapterDoc,
    Document,
    ProcessDoc,
    SwapDeviceDoc,
    SwapDoc,
    SystemDoc,
    value_of,
)
from gputaskman.core.jsonfields import (
    REASONS,
    NotASnapshot,
    SnapshotError,
    is_number,
    parse_json,
)
from gputaskman.intel.apps import AppModel
from gputaskman.intel.llm import LlmView, ViewPart

__all__ = [
    "RECORDED_SOURCE",
    "AdapterDoc",
    "Document",
    "NotASnapshot",
    "ProcessDoc",
    "SnapshotError",
    "SwapDeviceDoc",
    "SwapDoc",
    "SystemDoc",
    "check_snapshot",
    "read_document",
]


class _Refused(Exception):
    """Something the Structs' types allow but a reading does not: the reference reader
    decides (and words the refusal)."""


# what sends a document to the reference reader: msgspec's refusals, `_Refused`, and the
# ValueError msgspec raises on a lone surrogate in a str (UnicodeEncodeError)
_OFF_PATH = (msgspec.MsgspecError, RecursionError, _Refused, ValueError)


def read_document(obj: bytes | bytearray | memoryview | Mapping[str, Any]) -> Document:
    """The `Document` a ``--json`` object describes, given as its JSON bytes or as the parsed
    object (anything else, a str included, is a parsed value: `NotASnapshot`); `SnapshotError`
    says why not. For bytes that are not JSON, the parser's `ValueError` (or `RecursionError`,
    nested too deep) is raised as it is."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return _document(DOC_DECODER.decode(obj))
        except _OFF_PATH:
            pass  # read, or refused with its place, by the reference reader
        return read_parsed(parse_json(bytes(obj) if isinstance(obj, memoryview) else obj))
    try:
        return _document(msgspec.convert(obj, DocShape))
    except _OFF_PATH:
        return read_parsed(obj)


# ---------------------------------------------------------------------------- values


def _num(v: Any) -> Any:
    """A recorded number (or None) that a float holds; else the reference reader decides."""
    if v is None or is_number(v):
        return v
    raise _Refused


def _recorded(detail: str | None, why: str) -> str:
    """The detail of a reason this version does not know: the recorded words kept."""
    extra = f"recorded reason: {why}"
    return extra if detail is None else f"{detail} ({extra})"


def _reading(s: ReadingShape) -> Reading:
    v, why = s.value, s.reason
    if why is None:
        if v is not None and is_number(v):
            return checked_reading(v, s.kind, s.source, None, s.detail)
    elif v is None:
        reason = REASONS.get(why)
        if reason is not None:
            return checked_reading(None, s.kind, s.source, reason, s.detail)
        detail = s.detail
        extra = f"recorded reason: {why}"
        return Reading(
            None,
            s.kind,
            s.source,
            Reason.UNAVAILABLE,
            extra if detail is None else f"{detail} ({extra})",
        )
    raise _Refused  # no value and no reason, both, or a number beyond a float


def _maybe(s: ReadingShape | None) -> Reading | None:
    return None if s is None else _reading(s)


def _readings(m: dict[str, ReadingShape] | None) -> dict[str, Reading]:
    return {} if m is None else {k: _reading(v) for k, v in m.items()}


def _texts(v: list[str] | None) -> tuple[str, ...]:
    return () if v is None else tuple(v)


def _or(v: str | None, default: str) -> str:
    return default if v is None else v


def _problem(s: ProblemShape) -> Problem:
    reason = REASONS.get(s.reason)
    if reason is not None:
        return Problem(s.where, reason, s.detail, s.adapter)
    return Problem(s.where, Reason.UNAVAILABLE, _recorded(s.detail, s.reason), s.adapter)


# ---------------------------------------------------------------------------- processes


def _model(s: ModelShape | None) -> ModelRef | None:
    if s is None:
        return None
    api = s.api
    return ModelRef(
        name=s.name,
        evidence=s.evidence,
        confirmed=bool(s.confirmed),
        path=s.path,
        store=s.store,
        status=s.status,
        sources=_texts(s.sources),
        pending=bool(s.pending),
        api_runtime=None if api is None else api.runtime,
        api_endpoint=None if api is None else api.endpoint,
        api_errors=() if api is None else _texts(api.errors),
        header_error=s.header_error,
    )


def _breakdown(s: BreakdownShape | None) -> LlmView | None:
    if s is None:
        return None
    parts = tuple(
        ViewPart(
            name,
            _reading(p.reading),
            () if p.alternatives is None else tuple(map(_reading, p.alternatives)),
            _or(p.marker, ""),
        )
        for name, p in s.parts.items()
    )
    return LlmView(
        model=s.model,
        path=s.path,
        evidence=_or(s.evidence, ""),
        status=_or(s.status, ""),
        owner_marker=_or(s.owner_marker, ""),
        runtime=s.runtime,
        architecture=s.architecture,
        file_type=s.file_type,
        parameter_count=_num(s.parameter_count),
        n_ctx=_num(s.n_ctx),
        n_ctx_source=s.n_ctx_source,
        parts=parts,
        reported_total=value_of(_maybe(s.reported_total)),
        estimated_total=value_of(_maybe(s.estimated_total)),
        notes=_texts(s.notes),
    )


def _app(s: AppShape | None) -> AppModel | None:
    if s is None:
        return None
    return AppModel(
        app=s.app,
        selected=s.selected,
        settings_path=None,  # not written: the app's own files stay on the machine
        last_event=s.last_event,
        last_event_model=s.last_event_model,
        last_event_time=s.last_event_time,
        log_path=None,
        reasons=_texts(s.reasons),
    )


def _process(s: ProcessShape) -> ProcessDoc:
    scan = s.scan_reason
    detail = ProcDetail(
        cmdline=None if s.cmdline is None else tuple(s.cmdline),
        runtimes=_texts(s.runtimes),
        model_files=_texts(s.model_files),
        category=s.category,
        scanned=bool(s.scanned),
        reason=None if scan is None else REASONS.get(scan, Reason.UNAVAILABLE),
        exe=s.exe,
        model_evidence=()
        if s.model_evidence is None
        else tuple((e.evidence, e.path) for e in s.model_evidence),
        reason_detail=s.scan_detail,
        user=s.user,
        ppid=_num(s.ppid),
    )
    proc = ProcGpu(
        pid=_num(s.pid),
        create_time=_num(s.started_at),
        name=s.name,
        adapter=s.gpu,
        contexts=_texts(s.contexts),
        dedicated=_reading(s.vram_bytes),
        inferred=_maybe(s.vram_inferred_bytes),
        engines=_readings(s.engines),
        detail=detail,
        model=_model(s.model),
        breakdown=_breakdown(s.breakdown),
        app_model=_app(s.app_model),
        paged=_maybe(s.paged_bytes),
        footprint=_maybe(s.footprint_bytes),
        host=s.host,
        parent_pid=_num(s.parent_pid),
        unique=bool(s.inferred_unique),
    )
    return ProcessDoc(proc, _maybe(s.ram_bytes), _maybe(s.cpu_percent))


# ---------------------------------------------------------------------------- system


def _runtime(s: ReadingShape | None) -> Reading:
    """A duvm number; one a file does not hold is unknown, never 0."""
    if s is None:
        return Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded", Kind.RUNTIME)
    return _reading(s)


def _pool(s: PoolShape | None) -> duvmpool.PoolInfo | None:
    if s is None:
        return None
    daemons = tuple(
        duvmpool.DaemonPool(
            socket=d.socket,
            pid=_num(d.pid),
            size_bytes=_runtime(d.size_bytes),
            replicas=_runtime(d.replicas),
            pages_written=_runtime(d.pages_written),
            degraded_slabs=_runtime(d.degraded_slabs),
            pages_lost=_runtime(d.pages_lost),
            health=_or(d.health, "unknown"),
            reasons=_texts(d.reasons),
            peers=tuple(
                duvmpool.PeerPages(
                    _or(p.peer, "?"),
                    p.connected,
                    _runtime(p.pages),
                    _runtime(p.reserved_pages),
                    _runtime(p.slabs),
                )
                for p in d.peers or ()
            ),
        )
        for d in s.daemons
    )
    lending = tuple(
        duvmpool.Lending(
            socket=m.socket,
            capacity_bytes=_runtime(m.capacity_bytes),
            used_bytes=_runtime(m.used_bytes),
            reserved_bytes=_runtime(m.reserved_bytes),
            borrowers=tuple(
                duvmpool.Borrower(
                    _or(b.client_id, "?"),
                    _runtime(b.stored_bytes),
                    _runtime(b.reserved_bytes),
                    value_of(_maybe(b.connections)),
                )
                for b in m.borrowers or ()
            ),
            borrowers_total=value_of(_maybe(m.borrowers_listed_of)),
        )
        for m in s.lending
    )
    errors = s.errors
    return duvmpool.PoolInfo(
        daemons=daemons,
        lending=lending,
        errors={} if errors is None else {k: _or(v, "") for k, v in errors.items()},
        looked=_or(s.looked, duvmpool.DEFAULT_GLOB),
    )


def _host_numbers(m: dict[str, ReadingShape] | None) -> dict[str, Reading]:
    # "reasons" names an early file's object of reasons, never a number
    return {} if m is None else {k: _reading(v) for k, v in m.items() if k != "reasons"}


def _set(s: ReadingShape | UnsetType) -> Reading | None:
    return None if s is UNSET else _reading(s)  # type: ignore[arg-type]


def _swap(s: SwapShape | None) -> SwapDoc | None:
    if s is None:
        return None
    devices = None
    if s.devices is not None:
        devices = tuple(
            SwapDeviceDoc(
                d.filename,
                d.type,
                _set(d.size_bytes),
                _set(d.used_bytes),
                _set(d.priority),
                bool(d.deleted),
            )
            for d in s.devices
        )
    devices_reason = s.devices_reason
    if devices_reason is None and s.reasons is not None:
        devices_reason = s.reasons.get("devices")
    return SwapDoc(
        total_bytes=_set(s.total_bytes),
        free_bytes=_set(s.free_bytes),
        used_bytes=_set(s.used_bytes),
        devices=devices,
        devices_reason=devices_reason,
        problems=_texts(s.problems),
    )


def _system(s: SystemShape) -> SystemDoc:
    return SystemDoc(
        taken=_num(s.taken),
        memory=_host_numbers(s.memory),
        swap=_swap(s.swap),
        cpu=_host_numbers(s.cpu),
        processes_reason=s.processes_reason,
        duvm=_pool(s.duvm),
    )


# ---------------------------------------------------------------------------- document


def _adapter(s: AdapterShape, backend: str) -> AdapterDoc:
    m = s.metrics
    return AdapterDoc(
        index=_num(s.index),
        vendor=s.vendor,
        name=s.name,
        uuid=s.uuid,
        pci_bus_id=s.pci_bus_id,
        backend=_or(s.backend, backend),  # files before per-adapter backends
        metrics=None if m is None else DeviceMetrics(*map(_reading, msgspec.structs.astuple(m))),
        extra_metrics=_readings(s.extra_metrics),
        attributed_bytes=_num(s.attributed_bytes),
        attributed_complete=s.attributed_complete,
    )


def _document(s: DocShape) -> Document:
    if s.schema != schema.NAME or s.schema_version != schema.VERSION or not is_number(s.taken):
        raise _Refused
    backend = s.backend
    problems = () if s.problems is None else tuple(map(_problem, s.problems))
    unavailable = None if s.unavailable is None else _problem(s.unavailable)
    # the same object as in `problems`, as the collector builds it
    unavailable = next((p for p in problems if p == unavailable), unavailable)
    return Document(
        taken=s.taken,
        backend=backend,
        adapters=tuple(_adapter(a, backend) for a in s.adapters),
        processes=tuple(map(_process, s.processes)),
        problems=problems,
        notes=_texts(s.notes),
        driver_version=s.driver_version,
        unavailable=unavailable,
        selected_gpu=_num(s.selected_gpu),
        system=None if s.system is None else _system(s.system),
        taken_iso=s.taken_iso,
        attributed_bytes=_num(s.attributed_bytes),
        attributed_complete=s.attributed_complete,
    )
