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
value or a reason), each by a `frozen.builder` (the class's object without the frozen
dataclass's per-field ``object.__setattr__``: a third to a seventh of the cost). A document
this path does not take goes to the reference reader over the parsed object
(`docfields.read_parsed`), which reads it or raises the `SnapshotError` naming the place; so
every refusal, and its words, is the reference reader's. Besides refusals, that path reads
JSON that msgspec refuses and `json.loads` reads (a lone surrogate such as ``"\\udcff"``, a
byte-order mark, UTF-16), a number beyond a float's range (``1e400``) in a key the reader
uses (refused either way), and early files' system numbers (bare numbers, or null with a
``reasons`` object). One input reads on the typed path that the reference refuses: bytes
with an integer of over 4300 digits in a key the reader skips (msgspec skips it;
`json.loads` refuses it).

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

import sys
from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from gputaskman.base import schema
from gputaskman.base.frozen import builder
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
from gputaskman.document.docfields import check_snapshot, read_parsed
from gputaskman.document.dochealth import adapter_parts, mig_ref_of
from gputaskman.document.docowner import memory_of, owner_of
from gputaskman.document.docshape import (
    DOC_DECODER,
    TABLE_DECODER,
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
    TableProcessShape,
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
    REASONS,
    NotASnapshot,
    SnapshotError,
    is_number,
    parse_json,
)
from gputaskman.intel.apps import AppModel
from gputaskman.intel.llm import LlmView, ViewPart
from gputaskman.sampling import duvmpool

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
_LONG = 2**63  # an int within ±_LONG is one a float holds
_FLOAT_MAX = sys.float_info.max


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


def read_table_document(body: bytes | bytearray | memoryview) -> Document:
    """The part of the document in `body` that the fleet table shows (`docshape`'s
    `TableDocShape`): the adapters whole; of each process its identity, VRAM, model, its
    breakdown's totals and its command line (the table's filter reads it); nothing else (no
    problems, notes, system section or other process details: the table's MODELS cell names
    only models a process holds). A body this cannot
    read is read by `read_document`, whole, or refused in its words. Only the table reads
    such a document: a host's view reads the whole one."""
    try:
        s = TABLE_DECODER.decode(body)
        if s.schema != schema.NAME or s.schema_version != schema.VERSION or not is_number(s.taken):
            raise _Refused
        backend = s.backend
        return _Document(
            s.taken,
            backend,
            tuple(_adapter(a, backend) for a in s.adapters),
            tuple(map(_table_process, s.processes)),
            (),  # problems
            (),  # notes
            None,  # driver_version
            None if s.unavailable is None else _problem(s.unavailable),
            None,  # selected_gpu
            None,  # system
            None,  # taken_iso
            None,  # attributed_bytes
            None,  # attributed_complete
        )
    except _OFF_PATH:
        return read_document(body)


def _table_process(s: TableProcessShape) -> ProcessDoc:
    cmdline = None if s.cmdline is None else tuple(s.cmdline)
    breakdown = None
    if s.breakdown is not None:
        b = s.breakdown
        breakdown = _LlmView(
            None,
            None,
            "",
            "",
            "",
            None,
            None,
            None,
            None,
            None,
            None,
            (),
            value_of(_maybe(b.reported_total)),
            value_of(_maybe(b.estimated_total)),
            (),
            None,  # format
            None,  # kv_cache_dtype
            None,  # figures
        )
    proc = _ProcGpu(
        _num(s.pid),
        None,  # create_time
        s.name,
        s.gpu,  # adapter
        (),  # contexts
        _reading(s.vram_bytes),  # dedicated
        _maybe(s.vram_inferred_bytes),  # inferred
        {},  # engines
        _ProcDetail(cmdline, (), (), None, False, None, None, (), None, None, None),
        _model(s.model),
        breakdown,
        None,  # app_model
        None,  # paged
        None,  # footprint
        s.host,
        None,  # parent_pid
        False,  # unique
        None,  # memory
        None,  # owner
        None,  # mig
    )
    return _ProcessDoc(proc, None, None)


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
        t = type(v)
        # `is_number`'s two common cases inline (run for every reading): an int within
        # ±2**63, a finite float (NaN and infinities fail both comparisons)
        if (t is int and -_LONG <= v < _LONG) or (t is float and -_FLOAT_MAX <= v <= _FLOAT_MAX):
            return checked_reading(v, s.kind, s.source, None, s.detail)
        if v is not None and is_number(v):
            return checked_reading(v, s.kind, s.source, None, s.detail)
    elif v is None:
        reason = REASONS.get(why)
        if reason is not None:
            return checked_reading(None, s.kind, s.source, reason, s.detail)
        return checked_reading(None, s.kind, s.source, Reason.UNAVAILABLE, _recorded(s.detail, why))
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
        return _Problem(s.where, reason, s.detail, s.adapter)
    return _Problem(s.where, Reason.UNAVAILABLE, _recorded(s.detail, s.reason), s.adapter)


# ---------------------------------------------------------------------------- processes
# The objects are built by `frozen.builder`s, positionally in each class's field order (the
# comments name a field where the key differs): keyword arguments cost twice the build.


def _model(s: ModelShape | None) -> ModelRef | None:
    if s is None:
        return None
    api = s.api
    return _ModelRef(
        s.name,
        s.evidence,
        bool(s.confirmed),
        s.path,
        s.store,
        s.status,
        _texts(s.sources),
        bool(s.pending),
        None if api is None else api.runtime,  # api_runtime
        None if api is None else api.endpoint,  # api_endpoint
        () if api is None else _texts(api.errors),  # api_errors
        s.header_error,
    )


def _breakdown(s: BreakdownShape | None) -> LlmView | None:
    if s is None:
        return None
    parts = tuple(
        _ViewPart(
            name,
            _reading(p.reading),
            () if p.alternatives is None else tuple(map(_reading, p.alternatives)),
            _or(p.marker, ""),
        )
        for name, p in s.parts.items()
    )
    return _LlmView(
        s.model,
        s.path,
        _or(s.evidence, ""),
        _or(s.status, ""),
        _or(s.owner_marker, ""),
        s.runtime,
        s.architecture,
        s.file_type,
        _num(s.parameter_count),
        _num(s.n_ctx),
        s.n_ctx_source,
        parts,
        value_of(_maybe(s.reported_total)),
        value_of(_maybe(s.estimated_total)),
        _texts(s.notes),
        s.format,
        s.kv_cache_dtype,
        None
        if s.runtime_figures is None
        else tuple((n, _reading(r)) for n, r in s.runtime_figures.items()),
    )


def _app(s: AppShape | None) -> AppModel | None:
    if s is None:
        return None
    return _AppModel(
        s.app,
        s.selected,
        None,  # settings_path, not written: the app's own files stay on the machine
        s.last_event,
        s.last_event_model,
        s.last_event_time,
        None,  # log_path
        _texts(s.reasons),
    )


def _process(s: ProcessShape) -> ProcessDoc:
    scan = s.scan_reason
    evidence = s.model_evidence
    detail = _ProcDetail(
        None if s.cmdline is None else tuple(s.cmdline),
        _texts(s.runtimes),
        _texts(s.model_files),
        s.category,
        bool(s.scanned),
        None if scan is None else REASONS.get(scan, Reason.UNAVAILABLE),  # reason
        s.exe,
        () if evidence is None else tuple((e.evidence, e.path) for e in evidence),
        s.scan_detail,  # reason_detail
        s.user,
        _num(s.ppid),
    )
    engines = s.engines
    proc = _ProcGpu(
        _num(s.pid),
        _num(s.started_at),  # create_time
        s.name,
        s.gpu,  # adapter
        _texts(s.contexts),
        _reading(s.vram_bytes),  # dedicated
        _maybe(s.vram_inferred_bytes),  # inferred
        {} if engines is None else {k: _reading(v) for k, v in engines.items()},
        detail,
        _model(s.model),
        _breakdown(s.breakdown),
        _app(s.app_model),
        _maybe(s.paged_bytes),  # paged
        _maybe(s.footprint_bytes),  # footprint
        s.host,
        _num(s.parent_pid),
        bool(s.inferred_unique),  # unique
        memory_of(s, _reading),
        owner_of(s.owner),
        mig_ref_of(s.mig, _num),
    )
    return _ProcessDoc(proc, _maybe(s.ram_bytes), _maybe(s.cpu_percent))


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
        _DaemonPool(
            d.socket,
            _num(d.pid),
            _runtime(d.size_bytes),
            _runtime(d.replicas),
            _runtime(d.pages_written),
            _runtime(d.degraded_slabs),
            _runtime(d.pages_lost),
            _or(d.health, "unknown"),
            _texts(d.reasons),
            tuple(
                _PeerPages(
                    _or(p.peer, "?"),
                    p.connected,
                    _runtime(p.pages),
                    _runtime(p.reserved_pages),
                    _runtime(p.slabs),
                )
                for p in d.peers or ()
            ),
            d.swap_device,
        )
        for d in s.daemons
    )
    lending = tuple(
        _Lending(
            m.socket,
            _runtime(m.capacity_bytes),
            _runtime(m.used_bytes),
            _runtime(m.reserved_bytes),
            tuple(
                _Borrower(
                    _or(b.client_id, "?"),
                    _runtime(b.stored_bytes),
                    _runtime(b.reserved_bytes),
                    value_of(_maybe(b.connections)),
                )
                for b in m.borrowers or ()
            ),
            value_of(_maybe(m.borrowers_listed_of)),  # borrowers_total
        )
        for m in s.lending
    )
    errors = s.errors
    return _PoolInfo(
        daemons,
        lending,
        {} if errors is None else {k: _or(v, "") for k, v in errors.items()},
        _or(s.looked, duvmpool.DEFAULT_GLOB),
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
            _SwapDeviceDoc(
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
    return _SwapDoc(
        _set(s.total_bytes),
        _set(s.free_bytes),
        _set(s.used_bytes),
        devices,
        devices_reason,
        _texts(s.problems),
    )


def _system(s: SystemShape) -> SystemDoc:
    return _SystemDoc(
        _num(s.taken),
        _host_numbers(s.memory),
        _swap(s.swap),
        _host_numbers(s.cpu),
        s.processes_reason,
        _pool(s.duvm),
    )


# ---------------------------------------------------------------------------- document


def _adapter(s: AdapterShape, backend: str) -> AdapterDoc:
    m = s.metrics
    extra = s.extra_metrics
    return _AdapterDoc(
        _num(s.index),
        s.vendor,
        s.name,
        s.uuid,
        s.pci_bus_id,
        _or(s.backend, backend),  # files before per-adapter backends
        None if m is None else _DeviceMetrics(*map(_reading, msgspec.structs.astuple(m))),
        {} if extra is None else {k: _reading(v) for k, v in extra.items()},
        _num(s.attributed_bytes),
        s.attributed_complete,
        *adapter_parts(s, _reading, _num),  # health, mig
    )


def _document(s: DocShape) -> Document:
    if s.schema != schema.NAME or s.schema_version != schema.VERSION or not is_number(s.taken):
        raise _Refused
    backend = s.backend
    problems = () if s.problems is None else tuple(map(_problem, s.problems))
    unavailable = None if s.unavailable is None else _problem(s.unavailable)
    # the same object as in `problems`, as the collector builds it
    unavailable = next((p for p in problems if p == unavailable), unavailable)
    return _Document(
        s.taken,
        backend,
        tuple(_adapter(a, backend) for a in s.adapters),
        tuple(map(_process, s.processes)),
        problems,
        _texts(s.notes),
        s.driver_version,
        unavailable,
        _num(s.selected_gpu),
        None if s.system is None else _system(s.system),
        s.taken_iso,
        _num(s.attributed_bytes),
        s.attributed_complete,
    )


_Problem = builder(Problem)
_ModelRef = builder(ModelRef)
_ViewPart = builder(ViewPart)
_LlmView = builder(LlmView)
_AppModel = builder(AppModel)
_ProcDetail = builder(ProcDetail)
_ProcGpu = builder(ProcGpu)
_ProcessDoc = builder(ProcessDoc)
_DaemonPool = builder(duvmpool.DaemonPool)
_PeerPages = builder(duvmpool.PeerPages)
_Lending = builder(duvmpool.Lending)
_Borrower = builder(duvmpool.Borrower)
_PoolInfo = builder(duvmpool.PoolInfo)
_SwapDeviceDoc = builder(SwapDeviceDoc)
_SwapDoc = builder(SwapDoc)
_SystemDoc = builder(SystemDoc)
_AdapterDoc = builder(AdapterDoc)
_DeviceMetrics = builder(DeviceMetrics)
_Document = builder(Document)
