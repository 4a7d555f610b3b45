"""The snapshot document's shape (``schema_version`` 1) as msgspec Structs, one per JSON
object, each field named as its key: `DOC_DECODER` turns a document's bytes into them in C,
checking every type on the way, and `document` builds the model's objects from them.

The Structs hold what a reader may rely on; what they cannot say is checked after decoding
(`document.read_document`): that a number is finite and within a float's range, that a
reading has a value or a reason, and which reasons this version knows (reasons are read as
`str`, so one a later version writes still decodes). Keys not declared here are skipped
(the derived ``shown_vram``, ``process_list`` and ``available``, and keys of later
versions). An optional key is ``None`` when absent or null.

``system.memory`` and ``system.cpu`` (open-ended keys) and ``system.swap``'s numbers are
declared as the current writer writes them: readings, a number that is not there absent.
Early files held bare numbers there, or null with the reason in a ``reasons`` object; such
a document does not decode into these Structs and is read by the reference reader
(`docfields`).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from gputaskman.base.readings import DeviceMetrics, Kind

Number = int | float
Texts = list[str] | None


# gc=False: decoded JSON holds no cycles, and a Struct the collector does not track costs
# less to make and to free (a fleet decodes some 200 documents a second)
class Shape(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    """A JSON object of the document (unknown keys skipped)."""


class ReadingShape(Shape):
    kind: Kind
    source: str
    value: Number | None = None
    reason: str | None = None
    detail: str | None = None


Readings = dict[str, ReadingShape] | None


class ProblemShape(Shape):
    where: str
    reason: str
    detail: str | None = None
    adapter: str | None = None


# one reading per `DeviceMetrics` field, all required, in its order
MetricsShape = msgspec.defstruct(
    "MetricsShape",
    [(name, ReadingShape) for name in DeviceMetrics.__slots__],
    bases=(Shape,),
    module=__name__,
)


class AdapterShape(Shape):
    index: int
    vendor: str
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    backend: str | None = None
    metrics: MetricsShape | None = None  # type: ignore[valid-type]
    extra_metrics: Readings = None
    attributed_bytes: int | None = None
    attributed_complete: bool | None = None


class ApiShape(Shape):
    runtime: str | None = None
    endpoint: str | None = None
    errors: Texts = None


class ModelShape(Shape):
    name: str
    evidence: str
    confirmed: bool | None = None
    path: str | None = None
    store: str | None = None
    status: str | None = None
    sources: Texts = None
    pending: bool | None = None
    api: ApiShape | None = None
    header_error: str | None = None


class PartShape(Shape):
    reading: ReadingShape
    alternatives: list[ReadingShape] | None = None
    marker: str | None = None


class BreakdownShape(Shape):
    parts: dict[str, PartShape]
    model: str | None = None
    path: str | None = None
    evidence: str | None = None
    status: str | None = None
    owner_marker: str | None = None
    runtime: str | None = None
    architecture: str | None = None
    file_type: str | None = None
    parameter_count: int | None = None
    n_ctx: int | None = None
    n_ctx_source: str | None = None
    reported_total: ReadingShape | None = None
    estimated_total: ReadingShape | None = None
    notes: Texts = None


class AppShape(Shape):
    app: str
    selected: str | None = None
    last_event: str | None = None
    last_event_model: str | None = None
    last_event_time: str | None = None
    reasons: Texts = None


class EvidenceShape(Shape):
    evidence: str
    path: str | None = None


class ProcessShape(Shape):
    pid: int
    vram_bytes: ReadingShape
    started_at: Number | None = None
    name: str | None = None
    gpu: str | None = None
    contexts: Texts = None
    vram_inferred_bytes: ReadingShape | None = None
    engines: Readings = None
    cmdline: Texts = None
    runtimes: Texts = None
    model_files: Texts = None
    category: str | None = None
    scanned: bool | None = None
    scan_reason: str | None = None
    exe: str | None = None
    model_evidence: list[EvidenceShape] | None = None
    scan_detail: str | None = None
    user: str | None = None
    ppid: int | None = None
    model: ModelShape | None = None
    breakdown: BreakdownShape | None = None
    app_model: AppShape | None = None
    paged_bytes: ReadingShape | None = None
    footprint_bytes: ReadingShape | None = None
    host: str | None = None
    parent_pid: int | None = None
    inferred_unique: bool | None = None
    ram_bytes: ReadingShape | None = None
    cpu_percent: ReadingShape | None = None


class PeerShape(Shape):
    peer: str | None = None
    connected: bool | None = None
    pages: ReadingShape | None = None
    reserved_pages: ReadingShape | None = None
    slabs: ReadingShape | None = None


class DaemonShape(Shape):
    socket: str
    pid: int | None = None
    size_bytes: ReadingShape | None = None
    replicas: ReadingShape | None = None
    pages_written: ReadingShape | None = None
    degraded_slabs: ReadingShape | None = None
    pages_lost: ReadingShape | None = None
    health: str | None = None
    reasons: Texts = None
    peers: list[PeerShape] | None = None


class BorrowerShape(Shape):
    client_id: str | None = None
    stored_bytes: ReadingShape | None = None
    reserved_bytes: ReadingShape | None = None
    connections: ReadingShape | None = None


class LendingShape(Shape):
    socket: str
    capacity_bytes: ReadingShape | None = None
    used_bytes: ReadingShape | None = None
    reserved_bytes: ReadingShape | None = None
    borrowers: list[BorrowerShape] | None = None
    borrowers_listed_of: ReadingShape | None = None


class PoolShape(Shape):
    daemons: list[DaemonShape]
    lending: list[LendingShape]
    errors: dict[str, str | None] | None = None
    looked: str | None = None


class SwapDeviceShape(Shape):
    filename: str | None = None
    type: str | None = None
    # null (an early file's "see reasons") does not decode: the reference reader reads it
    size_bytes: ReadingShape | UnsetType = UNSET
    used_bytes: ReadingShape | UnsetType = UNSET
    priority: ReadingShape | UnsetType = UNSET
    deleted: bool | None = None


class SwapShape(Shape):
    total_bytes: ReadingShape | UnsetType = UNSET
    free_bytes: ReadingShape | UnsetType = UNSET
    used_bytes: ReadingShape | UnsetType = UNSET
    devices: list[SwapDeviceShape] | None = None
    devices_reason: str | None = None
    problems: Texts = None
    reasons: dict[str, str | None] | None = None  # early files: the devices' reason


class SystemShape(Shape):
    taken: Number | None = None
    memory: Readings = None
    swap: SwapShape | None = None
    cpu: Readings = None
    processes_reason: str | None = None
    duvm: PoolShape | None = None


class DocShape(Shape):
    """The ``--json`` object (the top level)."""

    schema: str
    schema_version: int
    taken: Number
    backend: str
    adapters: list[AdapterShape]
    processes: list[ProcessShape]
    problems: list[ProblemShape] | None = None
    unavailable: ProblemShape | None = None
    notes: Texts = None
    driver_version: str | None = None
    selected_gpu: int | None = None
    system: SystemShape | None = None
    taken_iso: str | None = None
    attributed_bytes: int | None = None
    attributed_complete: bool | None = None


DOC_DECODER = msgspec.json.Decoder(DocShape)
