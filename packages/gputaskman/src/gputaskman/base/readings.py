"""Plain data for one sample of the GPU and its processes, with the provenance of every number.

Theory of operation
-------------------
Everything a backend learns ends up in a `Snapshot`: frozen, slotted dataclasses with no
behaviour beyond small derived properties, so a snapshot can be rendered, serialised, diffed
or replayed without touching the hardware again.

Every number is a `Reading`: a value plus the `Kind` of knowledge it is (measured, inferred,
estimated, or reported by a runtime), the API it came from (`source`), and, when the value
is missing, a `Reason` saying why. A missing value is `None`, never 0; a measured zero stays
0. `Reading` enforces this pairing itself, so a reading with neither a value nor a reason
cannot exist.

Two rules from the project's provenance contract live here as code:

* `ProcGpu.shown_vram` (measured, else inferred, else `None`) is what the UI shows, sorts by
  and scans first. It is never summed.
* `Snapshot.attributed` sums measured per-process bytes only, and is `None` when nothing was
  measured. `Snapshot.attributed_complete` says whether that sum can be a lower bound only
  (a process whose memory the driver hid, or a process list that failed).

Units are in the field names where they are not obvious: bytes, percent (0-100), degrees
Celsius, watts, MHz. Timestamps are Unix seconds (float).

This module imports only the standard library and `base.frozen` (checked by
tests/test_import_graph.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from gputaskman.base.frozen import builder


class Kind(StrEnum):
    """What kind of knowledge a number is."""

    MEASURED = "measured"  # read from a driver or OS counter for exactly this thing
    INFERRED = "inferred"  # derived from measurements by a rule that admits one explanation
    ESTIMATED = "estimated"  # computed from a model (e.g. GGUF sizes), not observed
    RUNTIME = "runtime"  # reported by the runtime that owns it (llama.cpp log, an API)


class Reason(StrEnum):
    """Why a value is missing. The string values are part of the JSON format."""

    DENIED = "denied"  # permission refused (another user's process, NVML NoPermission)
    NOT_SUPPORTED = "not supported"  # this device/driver does not offer the counter
    PROCESS_GONE = "process gone"  # the process exited between listing and reading
    UNAVAILABLE = "unavailable"  # the source exists but gave no value this time
    HIDDEN = "hidden by driver"  # NVML lists the process but withholds its memory
    NO_LIBRARY = "library not found"  # libnvidia-ml.so is not installed
    NO_DRIVER = "driver not loaded"  # library present, kernel driver absent
    NO_GPU = "no gpu"  # the backend works but found no device
    GPU_LOST = "gpu lost"  # the device fell off the bus or disappeared between samples
    QUERY_FAILED = "query failed"  # any other error from the source; `detail` says which
    NOT_LISTED = "not listed"  # the driver's process list does not name this process
    NOT_SCANNED = "not scanned yet"  # budgeted scan has not reached this process yet
    SHARED = "shared"  # held jointly with other processes (a DRM client): credited to nobody


@dataclass(frozen=True, slots=True)
class Reading:
    """One number with its provenance.

    Exactly one of `value` and `reason` is set. `source` names the API or file the value
    came from (or would have come from), e.g. ``"nvml:nvmlDeviceGetMemoryInfo"``.
    `detail` is free text for humans (the raw error string), never parsed.
    """

    value: int | float | None
    kind: Kind
    source: str
    reason: Reason | None = None
    detail: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.value, bool):
            raise TypeError("a Reading holds a number, not a bool")
        if self.value is None and self.reason is None:
            raise ValueError(f"missing value from {self.source!r} needs a reason")
        if self.value is not None and self.reason is not None:
            raise ValueError(f"value from {self.source!r} cannot also carry reason {self.reason}")
        if isinstance(self.value, float) and not math.isfinite(self.value):
            raise ValueError(f"non-finite value from {self.source!r}; use a reason instead")
        if not isinstance(self.kind, Kind):
            raise TypeError(f"kind must be a Kind, got {self.kind!r}")

    @property
    def known(self) -> bool:
        return self.value is not None

    @classmethod
    def measured(cls, value: int | float, source: str) -> Reading:
        return cls(value, Kind.MEASURED, source)

    @classmethod
    def inferred(cls, value: int | float, source: str) -> Reading:
        return cls(value, Kind.INFERRED, source)

    @classmethod
    def estimated(cls, value: int | float, source: str) -> Reading:
        return cls(value, Kind.ESTIMATED, source)

    @classmethod
    def runtime(cls, value: int | float, source: str) -> Reading:
        return cls(value, Kind.RUNTIME, source)

    @classmethod
    def missing(
        cls,
        reason: Reason,
        source: str,
        detail: str | None = None,
        kind: Kind = Kind.MEASURED,
    ) -> Reading:
        """A value that is unknown; `kind` is what it would have been."""
        return cls(None, kind, source, reason, detail)


# `Reading(value, kind, source, reason, detail)` for a caller that has already checked what
# `Reading.__post_init__` checks (the snapshot readers, for every reading of every document):
# the same object, built without the frozen class's per-field ``object.__setattr__`` and
# without checking twice, at a third of the cost (`frozen.builder`).
checked_reading: Callable[[int | float | None, Kind, str, Reason | None, str | None], Reading] = (
    builder(Reading)
)


@dataclass(frozen=True, slots=True)
class Problem:
    """Something that reduced what a snapshot can show, with the reason.

    `where` names the probe: ``"backend.init"`` when the backend as a whole is unusable,
    ``"processes.compute"`` / ``"processes.graphics"`` for a failed per-adapter process list,
    ``"device.<field>"`` or ``"procinfo"`` otherwise. `adapter` is the PCI bus id it concerns.
    """

    where: str
    reason: Reason
    detail: str | None = None
    adapter: str | None = None

    @property
    def is_process_list(self) -> bool:
        """A failed per-adapter process list (``where`` starts with ``processes.``)."""
        return self.where.startswith("processes.")


@dataclass(frozen=True, slots=True)
class Adapter:
    """One GPU as the backend identifies it.

    `pci_bus_id` is the pairing key across probes and samples (normalised lower case,
    ``"00000000:01:00.0"``); `index` is the backend's enumeration order, for display and
    `--gpu N` only.
    """

    index: int
    vendor: str
    name: str | None
    uuid: str | None
    pci_bus_id: str
    backend: str


@dataclass(frozen=True, slots=True)
class DeviceMetrics:
    """Device-wide readings for one adapter. All measured by the driver when known."""

    memory_total_bytes: Reading
    memory_used_bytes: Reading
    memory_reserved_bytes: Reading
    util_gpu_percent: Reading
    util_memory_percent: Reading
    encoder_percent: Reading
    decoder_percent: Reading
    temperature_c: Reading
    power_w: Reading
    power_limit_w: Reading
    clock_graphics_mhz: Reading
    clock_sm_mhz: Reading
    clock_memory_mhz: Reading

    @classmethod
    def all_missing(cls, reason: Reason, source: str, detail: str | None = None) -> DeviceMetrics:
        """Every field unknown for the same reason (e.g. the GPU was lost mid-sample)."""
        r = Reading.missing(reason, source, detail)
        return cls(*([r] * len(cls.__slots__)))  # type: ignore[arg-type]

    @classmethod
    def partial(cls, source: str, absent: str, **known: Reading) -> DeviceMetrics:
        """The fields a backend has (`known`); every other one is ``not supported`` from
        `source`, its detail "<what> is <absent>" ("temperature is not published")."""
        unknown = set(known) - set(cls.__slots__)
        if unknown:
            raise TypeError(f"not DeviceMetrics fields: {sorted(unknown)}")
        return cls(
            **{
                f: known[f]
                if f in known
                else Reading.missing(Reason.NOT_SUPPORTED, source, f"{METRIC_NAMES[f]} is {absent}")
                for f in cls.__slots__
            }
        )


# What each DeviceMetrics field is, in words (details of readings a backend does not have).
METRIC_NAMES: dict[str, str] = {
    "memory_total_bytes": "total memory",
    "memory_used_bytes": "used memory",
    "memory_reserved_bytes": "reserved memory",
    "util_gpu_percent": "GPU use",
    "util_memory_percent": "memory controller use",
    "encoder_percent": "encoder use",
    "decoder_percent": "decoder use",
    "temperature_c": "temperature",
    "power_w": "power",
    "power_limit_w": "power limit",
    "clock_graphics_mhz": "graphics clock",
    "clock_sm_mhz": "SM clock",
    "clock_memory_mhz": "memory clock",
}


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One MIG device of a GPU in MIG mode: a GPU instance's compute instance, by the ids NVML
    gives it (`gpu_instance_id`, `compute_instance_id`), with its own memory slice."""

    gpu_instance_id: int
    compute_instance_id: int
    uuid: str | None
    memory_total_bytes: Reading
    memory_used_bytes: Reading


@dataclass(frozen=True, slots=True)
class MigState:
    """A GPU's MIG mode as a reading (1 enabled, 0 disabled; missing with the reason where the
    GPU has no MIG) and, when enabled, its instances. A process on an instance is one row
    (`ProcGpu.mig`) on the parent GPU, never also listed on the parent."""

    mode: Reading
    instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelRef:
    """Which model a process holds (filled by `modelinfo`).

    `evidence` is one of ``api``, ``mapped``, ``cmdline``, ``path-arg``, ``installed``
    (strongest first); `confirmed` is true only when two of api/mapped/cmdline agree.
    `sources` lists every kind of evidence found; `status` is ``confirmed``,
    ``single source`` or ``informational`` (path-arg only). `store` names the model store
    that supplied `name` (names only, never evidence). `pending` is true while the costly
    look (API probe, header, logs) has not finished; `api_*` say what the local API probe
    answered (errors are reasons, never secrets); `header_error` why the model's header
    (GGUF, or safetensors headers and config.json) could not be read.
    """

    name: str
    evidence: str
    confirmed: bool = False
    path: str | None = None
    store: str | None = None
    status: str | None = None
    sources: tuple[str, ...] = ()
    pending: bool = False
    api_runtime: str | None = None
    api_endpoint: str | None = None
    api_errors: tuple[str, ...] = ()
    header_error: str | None = None


@dataclass(frozen=True, slots=True)
class ProcDetail:
    """What procinfo found about a process (not GPU numbers): identity and evidence.

    `runtimes` are labels of libraries mapped into the process (detection, not proof of
    GPU work); `model_files` are mapped model files (.gguf, .safetensors, ...);
    `model_evidence` lists every model candidate as ``(evidence, path)`` with evidence
    ``mapped``, ``cmdline`` or ``path-arg`` (path None when it could not be resolved).
    `scanned` is false when the budgeted scanner has not reached the process yet, so empty
    tuples mean "not looked" rather than "none"; `reason` says why a scan failed or a field
    is missing (denied, process gone), with `reason_detail` in words.
    """

    cmdline: tuple[str, ...] | None = None
    runtimes: tuple[str, ...] = ()
    model_files: tuple[str, ...] = ()
    category: str | None = None
    scanned: bool = False
    reason: Reason | None = None
    exe: str | None = None
    model_evidence: tuple[tuple[str, str | None], ...] = ()
    reason_detail: str | None = None
    user: str | None = None  # the user it runs as (name, or uid when unnamed)
    ppid: int | None = None  # its parent's PID


@dataclass(frozen=True, slots=True)
class ProcMemory:
    """A process's memory outside the GPU that swap concerns, from ``/proc/PID/status``.

    `swapped` is ``VmSwap`` (its pages swapped out now), `locked` ``VmLck`` (``mlock``ed:
    never swapped) and `pinned` ``VmPin`` (pinned by the kernel for a device, an RDMA
    registration or io_uring: never swapped). `swapped_to` says where the swapped-out bytes
    are: ``"pool"`` when duvm's device is the node's only active swap device (its daemon names
    the device), ``"swap"`` otherwise, None when `swapped` is unknown; the reading's detail
    says why. Machine RAM and swap, never GPU bytes, never in any GPU total.
    """

    swapped: Reading
    locked: Reading
    pinned: Reading
    swapped_to: str | None = None


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a process belongs to, as its cgroup path (``/proc/PID/cgroup``) names it.

    Each field is set only where the path names it in the form the software that made the
    cgroup writes (kubelet, a container runtime, slurmd, systemd): `pod_uid` and
    `container_id` (with `container_runtime`: containerd, cri-o, docker, podman; `qos`: the
    pod's QoS class), `slurm_job` and `slurm_step`, a systemd `unit` (and `user_unit`: it is
    a user manager's) and a login `session`. None means the path does not name it; nothing is
    guessed from a process's name. `user` is the user from ``/proc/PID/status`` (effective
    uid, as ps shows it: a name, or the uid when unnamed). `pod_name` / `pod_namespace` come
    only from a local read-only source, named in `pod_source`. `cgroup` is the path parsed
    (None with `reason` when it could not be read: the process is gone, permission).
    """

    cgroup: str | None
    user: str | None = None
    pod_uid: str | None = None
    container_id: str | None = None
    container_runtime: str | None = None
    qos: str | None = None
    slurm_job: str | None = None
    slurm_step: str | None = None
    unit: str | None = None
    user_unit: bool = False
    session: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    pod_source: str | None = None
    reason: Reason | None = None
    detail: str | None = None


class Breakdown(Protocol):
    """What the model layer's breakdown of a process's memory (`intel.llm.LlmView`) gives
    every layer: its totals, each of one kind, never added to a measured total."""

    @property
    def reported_total(self) -> int | None: ...  # runtime-reported

    @property
    def estimated_total(self) -> int | None: ...  # estimated from the model file


class AppSelection(Protocol):
    """An app's own choice of model (`intel.apps.AppModel`): a setting, not residency."""

    @property
    def app(self) -> str: ...

    @property
    def selected(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ProcGpu:
    """One process as seen on one adapter (or on none: a runtime candidate with no context).

    `dedicated` is the driver-measured VRAM of the process on `adapter` (missing with a
    reason when hidden, not listed, or unknown); `inferred` is an optional derived value
    (WSL context tracking; no Linux NVML path produces one). `engines` maps engine names
    (``gpu``, ``memory``, ``encoder``, ``decoder``) to per-process utilisation readings;
    engine availability is independent of memory availability.

    Fields only some backends know (`gpusource.GpuProcess`), none of them ever
    summed into `Snapshot.attributed`: `paged` is measured non-local memory (Windows PDH
    ``Non Local Usage``, macOS compressed graphics memory, the "Paged" column); `footprint`
    the macOS physical footprint (unified memory, not VRAM); `host` names the OS a row's
    PID belongs to when it is not this machine's (``"windows"``: a Windows host process
    seen from WSL, never matched with this machine's /proc); `parent_pid` the host row
    whose measured total already counts this row's bytes (WSL: ``vmwp.exe``); `unique`
    that the inference admits one explanation only (the ``*`` marker).

    Read from /proc for rows of this machine (None where not read): `memory`, what of the
    process is swapped out, locked or pinned (`ProcMemory`), and `owner`, what its cgroup
    names (`Owner`).
    """

    pid: int
    create_time: float | None
    name: str | None
    adapter: str | None  # pci_bus_id, None when the process has no GPU context we know of
    contexts: tuple[str, ...]  # "compute", "graphics"
    dedicated: Reading
    inferred: Reading | None = None
    engines: Mapping[str, Reading] = field(default_factory=dict)
    detail: ProcDetail = field(default_factory=ProcDetail)
    model: ModelRef | None = None  # which model (modelinfo: evidence ladder + store names)
    # the weights / KV cache / compute view (`llm.LlmView`); estimates in it are never added
    # to any measured total
    breakdown: Breakdown | None = None
    app_model: AppSelection | None = None  # an app adapter's selected model (`apps.AppModel`)
    paged: Reading | None = None
    footprint: Reading | None = None
    host: str | None = None
    parent_pid: int | None = None
    unique: bool = False
    memory: ProcMemory | None = None  # VmSwap / VmLck / VmPin (`ProcMemory`); None: not read
    owner: Owner | None = None  # pod, container, Slurm job, unit from its cgroup; None: not read
    # (gpu_instance_id, compute_instance_id) of the MIG instance NVML lists it on; None: none
    mig: tuple[int, int] | None = None

    @property
    def started_at(self) -> float | None:
        return self.create_time

    @property
    def key(self) -> tuple[int, float | None]:
        """Identity across samples: a reused PID has a different create_time."""
        return (self.pid, self.create_time)

    @property
    def shown_vram(self) -> Reading | None:
        """Measured, else inferred, else None. For display, sorting and scan priority only;
        never add these up (see `Snapshot.attributed`)."""
        if self.dedicated.kind is Kind.MEASURED and self.dedicated.value is not None:
            return self.dedicated
        if self.inferred is not None and self.inferred.value is not None:
            return self.inferred
        return None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One sample: adapters, their metrics, processes, and what went wrong.

    `metrics` is keyed by `Adapter.pci_bus_id`. `problems` lists everything that reduced
    what is shown (library missing, a failed process list, a lost GPU), each with a reason.
    `notes` are informational lines for humans.
    """

    taken: float
    backend: str
    adapters: tuple[Adapter, ...] = ()
    metrics: Mapping[str, DeviceMetrics] = field(default_factory=dict)
    processes: tuple[ProcGpu, ...] = ()
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    driver_version: str | None = None
    backend_problem: Problem | None = None  # set when the backend is unusable as a whole
    # Backend-specific device readings beyond `DeviceMetrics`, keyed by pci_bus_id, e.g.
    # amdgpu's GTT (system memory the GPU has mapped): {"gtt_used_bytes": Reading, ...}.
    extra_metrics: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)
    # Health readings by pci_bus_id (`gpuhealth.HEALTH_FIELDS`: XID events, ECC, retired pages,
    # remapped rows, clock event reasons, fan, PCIe and NVLink rates); {} where not read.
    health: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)
    mig: Mapping[str, MigState] = field(default_factory=dict)  # by pci_bus_id; {}: not read

    @property
    def available(self) -> bool:
        """True when the backend answered (even with zero GPUs)."""
        return self.backend_problem is None

    def adapter(self, pci_bus_id: str) -> Adapter | None:
        return next((a for a in self.adapters if a.pci_bus_id == pci_bus_id), None)

    def attributed_on(self, pci_bus_id: str | None = None) -> int | None:
        """Sum of measured per-process VRAM bytes (all adapters when None); None when
        nothing was measured. Inferred and estimated values never enter this sum."""
        total: int | None = None
        for p in self.processes:
            if pci_bus_id is not None and p.adapter != pci_bus_id:
                continue
            d = p.dedicated
            if d.kind is Kind.MEASURED and d.value is not None:
                total = (total or 0) + int(d.value)
        return total

    @property
    def attributed(self) -> int | None:
        return self.attributed_on(None)

    def attributed_complete_on(self, pci_bus_id: str | None = None) -> bool:
        """False when the sum can only be a lower bound: a listed process's memory was
        hidden or unknown, or a process-list query failed (or the backend is down). A row
        with `parent_pid` set does not count: its bytes are inside its parent's measured
        total (WSL processes under ``vmwp.exe``)."""
        if self.backend_problem is not None:
            return False
        for pr in self.problems:
            if pr.is_process_list and (pci_bus_id is None or pr.adapter == pci_bus_id):
                return False
        for p in self.processes:
            if p.adapter is None or (pci_bus_id is not None and p.adapter != pci_bus_id):
                continue
            if p.dedicated.value is None and p.parent_pid is None:
                return False
        return True

    @property
    def attributed_complete(self) -> bool:
        return self.attributed_complete_on(None)
