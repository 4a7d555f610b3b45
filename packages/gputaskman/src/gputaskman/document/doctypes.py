"""The types a snapshot document is read into (`reader.read_document`), where the
model's own types (`Reading`, `ProcGpu`, `LlmView`, `AppModel`, `duvmpool.PoolInfo`) do not
describe the document exactly: an adapter as recorded, a process row with the host's readings
beside it, the ``system`` section as written, and the `Document` holding them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    MigState,
    Problem,
    ProcGpu,
    Reading,
    Snapshot,
)
from gputaskman.document.jsonfields import SnapshotError
from gputaskman.sampling import duvmpool

RECORDED_SOURCE = "recorded"  # the source of a system number an early file held bare


@dataclass(frozen=True, slots=True)
class AdapterDoc:
    """One ``adapters[]`` entry. `pci_bus_id` may be None (a backend with no address);
    `attributed_bytes` / `attributed_complete` are the sums as recorded (None: not
    recorded, or nothing measured); `health` its health readings ({}: none) and `mig` its
    MIG state (None: not read)."""

    index: int
    vendor: str
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    backend: str
    metrics: DeviceMetrics | None = None
    extra_metrics: Mapping[str, Reading] = field(default_factory=dict)
    attributed_bytes: int | None = None
    attributed_complete: bool | None = None
    health: Mapping[str, Reading] = field(default_factory=dict)
    mig: MigState | None = None

    def identity(self) -> dict[str, Any]:
        """Which adapter this is, as summary and diff write it in their JSON."""
        return {
            "index": self.index,
            "vendor": self.vendor,
            "name": self.name,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
        }


@dataclass(frozen=True, slots=True)
class ProcessDoc:
    """One ``processes[]`` row: the process as the model has it, and the host's RAM and CPU
    readings written beside it (None when the row has none)."""

    proc: ProcGpu
    ram_bytes: Reading | None = None
    cpu_percent: Reading | None = None


@dataclass(frozen=True, slots=True)
class SwapDeviceDoc:
    filename: str | None
    type: str | None
    size_bytes: Reading | None = None
    used_bytes: Reading | None = None
    priority: Reading | None = None
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class SwapDoc:
    """``system.swap``: totals (None when not written), the devices (None: unreadable, with
    `devices_reason`), and lines of /proc/swaps that did not parse."""

    total_bytes: Reading | None = None
    free_bytes: Reading | None = None
    used_bytes: Reading | None = None
    devices: tuple[SwapDeviceDoc, ...] | None = None
    devices_reason: str | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SystemDoc:
    """The ``system`` object: the OS's numbers, by the key they were written under (a host
    sampler writes every `host.MemoryInfo` field; the demo and early files fewer)."""

    taken: float | None
    memory: Mapping[str, Reading] = field(default_factory=dict)
    swap: SwapDoc | None = None
    cpu: Mapping[str, Reading] = field(default_factory=dict)
    processes_reason: str | None = None
    duvm: duvmpool.PoolInfo | None = None


@dataclass(frozen=True, slots=True)
class Document:
    """One snapshot document (see the module docstring)."""

    taken: float
    backend: str
    adapters: tuple[AdapterDoc, ...] = ()
    processes: tuple[ProcessDoc, ...] = ()
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    driver_version: str | None = None
    unavailable: Problem | None = None  # the backend as a whole could not answer
    selected_gpu: int | None = None
    system: SystemDoc | None = None
    taken_iso: str | None = None  # as recorded
    attributed_bytes: int | None = None  # as recorded
    attributed_complete: bool | None = None  # as recorded; None: not recorded

    def snapshot(self) -> Snapshot:
        """The model's `Snapshot` of this document (replay shows it). The model keys a GPU
        by its address, so a document with an adapter that has none cannot be one."""
        adapters: list[Adapter] = []
        metrics: dict[str, DeviceMetrics] = {}
        extra: dict[str, Mapping[str, Reading]] = {}
        health: dict[str, Mapping[str, Reading]] = {}
        mig: dict[str, MigState] = {}
        for i, a in enumerate(self.adapters):
            if a.pci_bus_id is None:
                raise SnapshotError(f"adapters[{i}].pci_bus_id: null (replay needs an address)")
            adapters.append(Adapter(a.index, a.vendor, a.name, a.uuid, a.pci_bus_id, a.backend))
            if a.metrics is not None:
                metrics[a.pci_bus_id] = a.metrics
            if a.extra_metrics:
                extra[a.pci_bus_id] = a.extra_metrics
            if a.health:
                health[a.pci_bus_id] = a.health
            if a.mig is not None:
                mig[a.pci_bus_id] = a.mig
        return Snapshot(
            taken=self.taken,
            backend=self.backend,
            adapters=tuple(adapters),
            metrics=metrics,
            processes=tuple(p.proc for p in self.processes),
            problems=self.problems,
            notes=self.notes,
            driver_version=self.driver_version,
            backend_problem=self.unavailable,
            extra_metrics=extra,
            health=health,
            mig=mig,
        )


def value_of(r: Reading | None) -> int | None:
    """A recorded count or total (a reading the writer derives from an integer)."""
    return None if r is None or r.value is None else int(r.value)
