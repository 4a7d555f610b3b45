"""The snapshot document's shape (``schema_version`` 1) as msgspec Structs, one per JSON
object, each field named as its key: `DOC_DECODER` turns a document's bytes into them in C,
checking every type on the way, and `reader` builds the model's objects from them. The
packaged JSON Schema (``base/snapshot.schema.json``) is generated from them by
``tools/snapshot_schema.py``, and a test requires the checked-in file to be what it generates.

The Structs hold what a reader may rely on; what they cannot say is checked after decoding
(`reader.read_document`): that a number is finite and within a float's range, that a
reading has a value or a reason, and which reasons this version knows (reasons are read as
`str`, so one a later version writes still decodes). Keys not declared as fields are skipped
(those of later versions, and the keys the writer derives, declared in each Struct's
`DERIVED`: ``tool``, ``available``, ``shown_vram``, ``process_list``, ``health_state``, a MIG
instance's sums, an app's ``evidence``, the ``kind`` of ``system`` and of its duvm pool,
``owner_totals``). An optional key is ``None`` when absent or null.

What the writer promises beyond what a reader takes (files of older writers lack keys, later
ones may add values) is said in `msgspec.Meta` annotations, which decoding ignores and the
schema keeps: `ALWAYS` (the key is in every object written), `SET` (never null where
written), `EARLY` (only early files hold it: not in the schema), `code` (one of the codes in
`CODES`), and ``extra_json_schema`` for the non-null value's schema where the type's own is
too wide (a short list of values, a constant); each Struct's `RULES` adds keywords to its
object's schema.

``system.memory`` and ``system.cpu`` (open-ended keys) and ``system.swap``'s numbers are
declared as the current writer writes them: readings, a number that is not there absent.
Early files held bare numbers there, or null with the reason in a ``reasons`` object; such
a document does not decode into these Structs and is read by the reference reader
(`docfields`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from gputaskman.base.readings import DeviceMetrics, Kind, Reason
from gputaskman.base.schema import NAME, VERSION
from gputaskman.intel.evidence import Source

Number = int | float
Texts = list[str] | None

ALWAYS = Meta(extra={"always": True})
SET = Meta(extra={"null": False})
EARLY = Meta(extra={"early": True})

CODES: dict[str, type[StrEnum]] = {"kind": Kind, "reason": Reason, "evidence_source": Source}
"""The closed value sets the schema names (``$defs``), each the values of a code enum."""


def code(name: str) -> Meta:
    """A string that is one of `CODES[name]` as written (read as `str`: a later version's
    value still decodes)."""
    return Meta(extra_json_schema={"$ref": f"#/$defs/{name}"})


def one_of(*values: str) -> Meta:
    """A string the writer writes as one of `values` (read as any `str`)."""
    return Meta(extra_json_schema={"enum": list(values)})


STATUS = one_of("confirmed", "single source", "informational")
# the parts `report_models.breakdown_json` writes (it imports the reader, so not from there;
# test_schema's writer check fails on a part written but not named here)
BREAKDOWN_PARTS = ("weights", "kv_cache", "compute", "other")


# gc=False: decoded JSON holds no cycles, and a Struct the collector does not track costs
# less to make and to free (a fleet decodes some 200 documents a second)
class Shape(msgspec.Struct, frozen=True, forbid_unknown_fields=False, gc=False):
    """A JSON object of the document (unknown keys skipped)."""

    DERIVED: ClassVar[dict[str, Any]] = {}  # key: type, written but not read
    RULES: ClassVar[dict[str, Any]] = {}  # more JSON Schema keywords for this object


class ReadingShape(Shape):
    """One number and where it came from. `value` is null exactly when `reason` says why; a
    measured zero is 0."""

    RULES: ClassVar[dict[str, Any]] = {
        "additionalProperties": False,
        "if": {"properties": {"value": {"type": "null"}}},
        "then": {"properties": {"reason": {"$ref": "#/$defs/reason"}}},
        "else": {"properties": {"reason": {"type": "null"}}},
    }

    kind: Kind
    source: str
    value: Annotated[Number | None, ALWAYS] = None
    reason: Annotated[str | None, ALWAYS, code("reason")] = None
    detail: Annotated[str | None, ALWAYS] = None


Readings = dict[str, ReadingShape] | None
SetReadings = Annotated[Readings, SET]
SetTexts = Annotated[Texts, SET]


class ProblemShape(Shape):
    where: str
    reason: Annotated[str, code("reason")]
    detail: str | None = None
    adapter: str | None = None


# one reading per `DeviceMetrics` field, all required, in its order
MetricsShape = msgspec.defstruct(
    "MetricsShape",
    [(name, ReadingShape) for name in DeviceMetrics.__slots__],
    bases=(Shape,),
    module=__name__,
)


class MigInstanceShape(Shape):
    """One MIG instance of a GPU (`readings.MigInstance`); its sums are derived."""

    DERIVED: ClassVar[dict[str, Any]] = {
        "attributed_bytes": Annotated[int | None, ALWAYS],
        "attributed_complete": Annotated[bool, ALWAYS],
    }

    gpu_instance_id: int
    compute_instance_id: int
    memory_total_bytes: ReadingShape
    memory_used_bytes: ReadingShape
    uuid: Annotated[str | None, ALWAYS] = None


class MigShape(Shape):
    """A GPU's MIG mode (1 enabled, 0 disabled) and its instances (`readings.MigState`)."""

    mode: ReadingShape
    instances: Annotated[list[MigInstanceShape] | None, ALWAYS, SET] = None


class MigRefShape(Shape):
    """The MIG instance a process is listed on."""

    gpu_instance_id: int
    compute_instance_id: int


class HealthStateShape(Shape):
    """What a GPU's health readings say (`gpuhealth.verdict`): derived, never read."""

    state: Annotated[str, one_of("ok", "unhealthy", "unknown")]
    reasons: list[str]
    unchecked: list[str]


class AdapterShape(Shape):
    DERIVED: ClassVar[dict[str, Any]] = {
        "process_list": dict[str, Literal["ok"] | ProblemShape],
        "health_state": HealthStateShape | None,
    }

    index: int
    vendor: str
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    backend: Annotated[str | None, ALWAYS, SET] = None
    metrics: Annotated[MetricsShape | None, ALWAYS] = None  # type: ignore[valid-type]
    extra_metrics: SetReadings = None
    attributed_bytes: int | None = None
    attributed_complete: Annotated[bool | None, SET] = None
    health: SetReadings = None  # `gpuhealth.HEALTH_FIELDS`; {} where the backend reads none
    mig: MigShape | None = None


class ApiShape(Shape):
    runtime: str | None = None
    endpoint: str | None = None
    errors: SetTexts = None


class ModelShape(Shape):
    name: str
    evidence: Annotated[str, code("evidence_source")]
    confirmed: Annotated[bool | None, ALWAYS, SET] = None
    path: str | None = None
    store: str | None = None
    status: Annotated[str | None, STATUS] = None
    sources: Annotated[list[Annotated[str, code("evidence_source")]] | None, SET] = None
    pending: Annotated[bool | None, SET] = None
    api: ApiShape | None = None
    header_error: str | None = None


class PartShape(Shape):
    reading: ReadingShape
    alternatives: Annotated[list[ReadingShape] | None, SET] = None
    marker: Annotated[str | None, one_of("*")] = None


class BreakdownShape(Shape):
    parts: Annotated[
        dict[str, PartShape],
        Meta(
            extra_json_schema={
                "type": "object",
                "required": list(BREAKDOWN_PARTS),
                "properties": {p: {"$ref": "#/$defs/part"} for p in BREAKDOWN_PARTS},
            }
        ),
    ]
    model: str | None = None
    path: str | None = None
    evidence: Annotated[str | None, SET] = None
    status: Annotated[str | None, STATUS] = None
    owner_marker: Annotated[str | None, one_of("?", "")] = None
    runtime: str | None = None
    architecture: str | None = None
    file_type: str | None = None
    parameter_count: int | None = None
    n_ctx: int | None = None
    n_ctx_source: str | None = None
    reported_total: ReadingShape | None = None
    estimated_total: ReadingShape | None = None
    notes: SetTexts = None
    format: Annotated[str | None, one_of("gguf", "safetensors")] = None
    kv_cache_dtype: str | None = None
    runtime_figures: Readings = None


class AppShape(Shape):
    DERIVED: ClassVar[dict[str, Any]] = {"evidence": str | None}

    app: str
    selected: str | None = None
    last_event: str | None = None
    last_event_model: str | None = None
    last_event_time: str | None = None
    reasons: SetTexts = None


class EvidenceShape(Shape):
    evidence: Annotated[str, code("evidence_source")]
    path: str | None = None


class OwnerShape(Shape):
    """What a process's cgroup names (`readings.Owner`); null fields: not named."""

    cgroup: str | None = None
    user: str | None = None
    pod_uid: str | None = None
    pod_namespace: str | None = None
    pod_name: str | None = None
    pod_source: str | None = None
    qos: Annotated[str | None, one_of("guaranteed", "burstable", "besteffort")] = None
    container_id: str | None = None
    container_runtime: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    unit: str | None = None
    user_unit: Annotated[bool | None, SET] = None
    session: str | None = None
    reason: Annotated[str | None, code("reason")] = None
    detail: str | None = None


class OwnerTotalShape(Shape):
    """Measured VRAM of one owner's rows (derived from the rows: `owners.owner_totals`)."""

    by: Annotated[str, one_of("user", "pod", "job")]
    state: Annotated[str, one_of("named", "none", "unknown")]
    pids: list[int]
    owner: str | None = None
    attributed_bytes: int | None = None
    attributed_complete: Annotated[bool | None, SET] = None
    pod_namespace: str | None = None
    pod_name: str | None = None


class ProcessShape(Shape):
    DERIVED: ClassVar[dict[str, Any]] = {"shown_vram": ReadingShape | None}

    pid: int
    vram_bytes: ReadingShape
    started_at: Number | None = None
    name: str | None = None
    gpu: str | None = None
    contexts: SetTexts = None
    vram_inferred_bytes: ReadingShape | None = None
    engines: SetReadings = None
    cmdline: Texts = None
    runtimes: SetTexts = None
    model_files: SetTexts = None
    category: str | None = None
    scanned: Annotated[bool | None, SET] = None
    scan_reason: Annotated[str | None, code("reason")] = None
    exe: str | None = None
    model_evidence: Annotated[list[EvidenceShape] | None, SET] = None
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
    inferred_unique: Annotated[bool | None, SET] = None
    ram_bytes: ReadingShape | None = None
    cpu_percent: ReadingShape | None = None
    swapped_bytes: ReadingShape | None = None
    swapped_to: Annotated[str | None, one_of("pool", "swap")] = None
    locked_bytes: ReadingShape | None = None
    pinned_bytes: ReadingShape | None = None
    owner: OwnerShape | None = None
    mig: MigRefShape | None = None


class PeerShape(Shape):
    peer: Annotated[str | None, SET] = None
    connected: bool | None = None
    pages: Annotated[ReadingShape | None, SET] = None
    reserved_pages: Annotated[ReadingShape | None, SET] = None
    slabs: Annotated[ReadingShape | None, SET] = None


class DaemonShape(Shape):
    socket: str
    pid: int | None = None
    size_bytes: Annotated[ReadingShape | None, SET] = None
    replicas: Annotated[ReadingShape | None, SET] = None
    pages_written: Annotated[ReadingShape | None, SET] = None
    degraded_slabs: Annotated[ReadingShape | None, SET] = None
    pages_lost: Annotated[ReadingShape | None, SET] = None
    health: Annotated[str | None, SET, one_of("ok", "degraded", "failing")] = None
    reasons: SetTexts = None
    peers: Annotated[list[PeerShape] | None, SET] = None
    swap_device: str | None = None


class BorrowerShape(Shape):
    client_id: Annotated[str | None, SET] = None
    stored_bytes: Annotated[ReadingShape | None, SET] = None
    reserved_bytes: Annotated[ReadingShape | None, SET] = None
    connections: Annotated[ReadingShape | None, SET] = None


class LendingShape(Shape):
    socket: str
    capacity_bytes: Annotated[ReadingShape | None, SET] = None
    used_bytes: Annotated[ReadingShape | None, SET] = None
    reserved_bytes: Annotated[ReadingShape | None, SET] = None
    borrowers: Annotated[list[BorrowerShape] | None, SET] = None
    borrowers_listed_of: Annotated[ReadingShape | None, SET] = None


class PoolShape(Shape):
    DERIVED: ClassVar[dict[str, Any]] = {"kind": Annotated[Literal["runtime"], ALWAYS]}

    daemons: list[DaemonShape]
    lending: list[LendingShape]
    errors: Annotated[dict[str, Annotated[str | None, SET]] | None, SET] = None
    looked: Annotated[str | None, SET] = None


class SwapDeviceShape(Shape):
    filename: Annotated[str | None, SET] = None
    type: Annotated[str | None, SET] = None
    # null (an early file's "see reasons") does not decode: the reference reader reads it
    size_bytes: ReadingShape | UnsetType = UNSET
    used_bytes: ReadingShape | UnsetType = UNSET
    priority: ReadingShape | UnsetType = UNSET
    deleted: Annotated[bool | None, SET] = None


class SwapShape(Shape):
    total_bytes: ReadingShape | UnsetType = UNSET
    free_bytes: ReadingShape | UnsetType = UNSET
    used_bytes: ReadingShape | UnsetType = UNSET
    devices: list[SwapDeviceShape] | None = None
    devices_reason: str | None = None
    problems: SetTexts = None
    reasons: Annotated[dict[str, str | None] | None, EARLY] = None  # the devices' reason


class SystemShape(Shape):
    DERIVED: ClassVar[dict[str, Any]] = {"kind": Annotated[Literal["measured"], ALWAYS]}

    taken: Number | None = None
    memory: SetReadings = None
    swap: Annotated[SwapShape | None, SET] = None
    cpu: SetReadings = None
    processes_reason: Annotated[str | None, SET] = None
    duvm: Annotated[PoolShape | None, SET] = None


class ToolShape(Shape):
    name: str
    version: str


class DocShape(Shape):
    """One `gputaskman --json` document; a record file holds one per line. Every number is a
    reading: value, kind, source, reason, detail; the value is null exactly when a reason is
    given. New keys may be added within schema_version 1, so objects other than readings
    accept keys not listed here."""

    DERIVED: ClassVar[dict[str, Any]] = {
        "tool": ToolShape,
        "available": Annotated[bool, ALWAYS],
        "owner_totals": list[OwnerTotalShape],
    }

    schema: Annotated[str, Meta(extra_json_schema={"const": NAME})]
    schema_version: Annotated[int, Meta(extra_json_schema={"const": VERSION})]
    taken: Number
    backend: str
    adapters: list[AdapterShape]
    processes: list[ProcessShape]
    problems: Annotated[list[ProblemShape] | None, ALWAYS, SET] = None
    unavailable: ProblemShape | None = None
    notes: SetTexts = None
    driver_version: str | None = None
    selected_gpu: int | None = None
    system: SystemShape | None = None
    taken_iso: str | None = None
    attributed_bytes: int | None = None
    attributed_complete: Annotated[bool | None, SET] = None


DOC_DECODER = msgspec.json.Decoder(DocShape)


# ---------------------------------------------------------------------------- the fleet table
# What the fleet table and its totals read of a host's document (`fleet.view`): a poller that
# shows only the table decodes these, a fraction of the document, and the whole document
# only for a host that is open. Not part of the schema: the document is `DocShape`.


class TotalsShape(Shape):
    """A breakdown's totals (the fleet's "apart" sums)."""

    reported_total: ReadingShape | None = None
    estimated_total: ReadingShape | None = None


class TableProcessShape(Shape):
    pid: int
    vram_bytes: ReadingShape
    name: str | None = None
    gpu: str | None = None
    cmdline: Texts = None  # not shown: the table's filter reads it
    vram_inferred_bytes: ReadingShape | None = None
    model: ModelShape | None = None
    breakdown: TotalsShape | None = None
    host: str | None = None


class TableDocShape(Shape):
    schema: str
    schema_version: int
    taken: Number
    backend: str
    adapters: list[AdapterShape]
    processes: list[TableProcessShape]
    unavailable: ProblemShape | None = None


TABLE_DECODER = msgspec.json.Decoder(TableDocShape)
