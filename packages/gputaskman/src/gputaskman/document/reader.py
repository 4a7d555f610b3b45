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
dataclass's per-field ``object.__setattr__``: a third to a seventh of the cost); a value's
checks are `docvalues`', the system section's reading `docsystem`'s. A document
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

from collections.abc import Mapping
from typing import Any

import msgspec

from gputaskman.base import schema
from gputaskman.base.frozen import builder
from gputaskman.base.readings import (
    DeviceMetrics,
    ModelRef,
    ProcDetail,
    ProcGpu,
    Reason,
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
    ProcessShape,
    TableProcessShape,
)
from gputaskman.document.docsystem import system
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
from gputaskman.document.docvalues import (
    OFF_PATH,
    Refused,
    maybe,
    num,
    problem,
    reading,
    text_or,
    texts,
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


def read_document(obj: bytes | bytearray | memoryview | Mapping[str, Any]) -> Document:
    """The `Document` a ``--json`` object describes, given as its JSON bytes or as the parsed
    object (anything else, a str included, is a parsed value: `NotASnapshot`); `SnapshotError`
    says why not. For bytes that are not JSON, the parser's `ValueError` (or `RecursionError`,
    nested too deep) is raised as it is."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        try:
            return _document(DOC_DECODER.decode(obj))
        except OFF_PATH:
            pass  # read, or refused with its place, by the reference reader
        return read_parsed(parse_json(bytes(obj) if isinstance(obj, memoryview) else obj))
    try:
        return _document(msgspec.convert(obj, DocShape))
    except OFF_PATH:
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
            raise Refused
        backend = s.backend
        return _Document(
            s.taken,
            backend,
            tuple(_adapter(a, backend) for a in s.adapters),
            tuple(map(_table_process, s.processes)),
            (),  # problems
            (),  # notes
            None,  # driver_version
            None if s.unavailable is None else problem(s.unavailable),
            None,  # selected_gpu
            None,  # system
            None,  # taken_iso
            None,  # attributed_bytes
            None,  # attributed_complete
        )
    except OFF_PATH:
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
            value_of(maybe(b.reported_total)),
            value_of(maybe(b.estimated_total)),
            (),
            None,  # format
            None,  # kv_cache_dtype
            None,  # figures
        )
    proc = _ProcGpu(
        num(s.pid),
        None,  # create_time
        s.name,
        s.gpu,  # adapter
        (),  # contexts
        reading(s.vram_bytes),  # dedicated
        maybe(s.vram_inferred_bytes),  # inferred
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
        texts(s.sources),
        bool(s.pending),
        None if api is None else api.runtime,  # api_runtime
        None if api is None else api.endpoint,  # api_endpoint
        () if api is None else texts(api.errors),  # api_errors
        s.header_error,
    )


def _breakdown(s: BreakdownShape | None) -> LlmView | None:
    if s is None:
        return None
    parts = tuple(
        _ViewPart(
            name,
            reading(p.reading),
            () if p.alternatives is None else tuple(map(reading, p.alternatives)),
            text_or(p.marker, ""),
        )
        for name, p in s.parts.items()
    )
    return _LlmView(
        s.model,
        s.path,
        text_or(s.evidence, ""),
        text_or(s.status, ""),
        text_or(s.owner_marker, ""),
        s.runtime,
        s.architecture,
        s.file_type,
        num(s.parameter_count),
        num(s.n_ctx),
        s.n_ctx_source,
        parts,
        value_of(maybe(s.reported_total)),
        value_of(maybe(s.estimated_total)),
        texts(s.notes),
        s.format,
        s.kv_cache_dtype,
        None
        if s.runtime_figures is None
        else tuple((n, reading(r)) for n, r in s.runtime_figures.items()),
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
        texts(s.reasons),
    )


def _process(s: ProcessShape) -> ProcessDoc:
    scan = s.scan_reason
    evidence = s.model_evidence
    detail = _ProcDetail(
        None if s.cmdline is None else tuple(s.cmdline),
        texts(s.runtimes),
        texts(s.model_files),
        s.category,
        bool(s.scanned),
        None if scan is None else REASONS.get(scan, Reason.UNAVAILABLE),  # reason
        s.exe,
        () if evidence is None else tuple((e.evidence, e.path) for e in evidence),
        s.scan_detail,  # reason_detail
        s.user,
        num(s.ppid),
    )
    engines = s.engines
    proc = _ProcGpu(
        num(s.pid),
        num(s.started_at),  # create_time
        s.name,
        s.gpu,  # adapter
        texts(s.contexts),
        reading(s.vram_bytes),  # dedicated
        maybe(s.vram_inferred_bytes),  # inferred
        {} if engines is None else {k: reading(v) for k, v in engines.items()},
        detail,
        _model(s.model),
        _breakdown(s.breakdown),
        _app(s.app_model),
        maybe(s.paged_bytes),  # paged
        maybe(s.footprint_bytes),  # footprint
        s.host,
        num(s.parent_pid),
        bool(s.inferred_unique),  # unique
        memory_of(s, reading),
        owner_of(s.owner),
        mig_ref_of(s.mig, num),
    )
    return _ProcessDoc(proc, maybe(s.ram_bytes), maybe(s.cpu_percent))


# ---------------------------------------------------------------------------- document


def _adapter(s: AdapterShape, backend: str) -> AdapterDoc:
    m = s.metrics
    extra = s.extra_metrics
    return _AdapterDoc(
        num(s.index),
        s.vendor,
        s.name,
        s.uuid,
        s.pci_bus_id,
        text_or(s.backend, backend),  # files before per-adapter backends
        None if m is None else _DeviceMetrics(*map(reading, msgspec.structs.astuple(m))),
        {} if extra is None else {k: reading(v) for k, v in extra.items()},
        num(s.attributed_bytes),
        s.attributed_complete,
        *adapter_parts(s, reading, num),  # health, mig
    )


def _document(s: DocShape) -> Document:
    if s.schema != schema.NAME or s.schema_version != schema.VERSION or not is_number(s.taken):
        raise Refused
    backend = s.backend
    problems = () if s.problems is None else tuple(map(problem, s.problems))
    unavailable = None if s.unavailable is None else problem(s.unavailable)
    # the same object as in `problems`, as the collector builds it
    unavailable = next((p for p in problems if p == unavailable), unavailable)
    return _Document(
        s.taken,
        backend,
        tuple(_adapter(a, backend) for a in s.adapters),
        tuple(map(_process, s.processes)),
        problems,
        texts(s.notes),
        s.driver_version,
        unavailable,
        num(s.selected_gpu),
        None if s.system is None else system(s.system),
        s.taken_iso,
        num(s.attributed_bytes),
        s.attributed_complete,
    )


_ModelRef = builder(ModelRef)
_ViewPart = builder(ViewPart)
_LlmView = builder(LlmView)
_AppModel = builder(AppModel)
_ProcDetail = builder(ProcDetail)
_ProcGpu = builder(ProcGpu)
_ProcessDoc = builder(ProcessDoc)
_AdapterDoc = builder(AdapterDoc)
_DeviceMetrics = builder(DeviceMetrics)
_Document = builder(Document)
