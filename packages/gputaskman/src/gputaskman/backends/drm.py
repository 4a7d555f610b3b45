"""The DRM backend (AMD amdgpu, Intel i915 and xe on Linux).

Theory of operation
-------------------
`DrmBackend` is a `gpusource.GpuSource`: `sample()` makes one pass and returns a
`GpuSample` (backend ``drm``):

1. `drm_sysfs.enumerate_cards` lists the cards; only amdgpu, i915 and xe on PCI are kept.
2. `drm_clients.scan_clients` finds every DRM client in /proc (deduplicated by
   ``(pdev, client-id)``); `EngineRates` turns counter deltas since the previous sample into
   busy percentages, so the backend object is kept between samples (the first sample has no
   rates: None with a reason, never 0).
3. Device readings come from sysfs (`drm_sysfs.read_amdgpu` / `read_intel`). An Intel card's
   "used" memory is the sum over its visible clients, computed here; Intel power, where the
   hwmon gives only an energy counter, is a rate between two samples too.
4. `drm_clients.attribute` decides what each process may be credited with; here that becomes
   `GpuProcess.dedicated` (measured only for provably private clients, else missing with
   the reason) and `GpuProcess.engines`. Rows carry no name: the collector joins them with
   its host sample (``(pid, create_time)``), which already read it.
5. amdgpu's GTT (system memory the GPU has mapped) goes to `GpuSample.extra_metrics`;
   a throttled Intel GT frequency becomes a note naming the reasons.

`combine_with_nvml` (used by `linux.LinuxGpus`) pairs these adapters with NVML's by PCI
address (`merge_adapters`) so a machine with an NVIDIA GPU and an AMD or Intel one lists each
GPU once; `backend_for` says which backend serves a selected adapter (``"drm"`` for amdgpu
and Intel).

Everything reads below ``root`` (default ``/``), so tests run on fake /sys and /proc trees.
Not validated on real hardware.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from gputaskman.backends.drm_clients import (
    Client,
    EngineRates,
    ProcUsage,
    ScanResult,
    attribute,
    is_local_region,
    is_system_region,
    scan_clients,
)
from gputaskman.backends.drm_fdinfo import normalize_pci, pci_bus_id
from gputaskman.backends.drm_sysfs import (
    INTEL_DRIVERS,
    INTEL_MEMORY_NOTE,
    CardReadings,
    DrmCard,
    enumerate_cards,
    read_amdgpu,
    read_intel,
)
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    Kind,
    Problem,
    Reading,
    Reason,
)

BACKEND: Final = "drm"
#: What an empty DRM probe looked for (``--list-gpus`` and the snapshot's notes say it).
NO_CARD: Final = "no amdgpu, i915 or xe card in /sys/class/drm"
#: Memory or engine time of a DRM client held by several processes: credited to nobody;
#: the detail names the processes.
SHARED_REASON: Final = Reason.SHARED
FDINFO_SOURCE: Final = "drm-fdinfo"
__all__ = [
    "BACKEND",
    "INTEL_MEMORY_NOTE",
    "NO_CARD",
    "DrmBackend",
    "backend_for",
    "bus_id",
    "combine_with_nvml",
    "drm_adapters",
    "merge_adapters",
]


def bus_id(pdev: str) -> str:
    """NVML-style bus id (8-digit domain, lower case) of a PCI address (`pci_bus_id`)."""
    got = pci_bus_id(pdev)
    if got is None:
        raise ValueError(f"not a PCI address: {pdev!r}")
    return got


def pci_key(address: str) -> str | None:
    """The pairing key of any PCI address spelling (NVML's, sysfs', fdinfo's)."""
    return normalize_pci(address)


def drm_adapters(cards: Iterable[DrmCard], start_index: int = 0) -> tuple[Adapter, ...]:
    """Adapters for the supported cards (amdgpu, i915, xe on PCI), indexed from start_index."""
    out = []
    for card in cards:
        if not card.supported or card.pdev is None:
            continue
        out.append(
            Adapter(
                index=start_index + len(out),
                vendor=card.vendor,
                name=card.name,
                uuid=None,
                pci_bus_id=bus_id(card.pdev),
                backend=BACKEND,
            )
        )
    return tuple(out)


def merge_adapters(
    nvml_adapters: Sequence[Adapter], drm_adapters: Sequence[Adapter]
) -> tuple[Adapter, ...]:
    """NVML's adapters, then each DRM adapter whose PCI address NVML did not list.

    Pairing is by normalized PCI address only (never name or index), so an NVIDIA dGPU and
    an AMD or Intel iGPU both appear, each once. NVML keeps its indices; DRM adapters are
    renumbered after them so no NVML index moves.
    """
    seen = {pci_key(a.pci_bus_id) for a in nvml_adapters}
    merged = list(nvml_adapters)
    for a in drm_adapters:
        key = pci_key(a.pci_bus_id)
        if key is not None and key in seen:
            continue
        seen.add(key)
        merged.append(dataclasses.replace(a, index=len(merged)))
    return tuple(merged)


def backend_for(adapter: Adapter | None, default: str) -> str:
    """``"drm"`` when the selected adapter is an amdgpu or Intel card, else `default`."""
    if adapter is not None and (adapter.backend == BACKEND or adapter.vendor in ("amd", "intel")):
        return BACKEND
    return default


def combine_with_nvml(nvml: GpuSample, drm: GpuSample) -> GpuSample:
    """NVML's sample with the DRM adapters, metrics, processes, problems and notes added.

    Adapters are merged by PCI address (`merge_adapters`); DRM data for a device NVML
    already lists is dropped, so nothing shows twice. When NVML itself is unusable (no
    library on an AMD/Intel machine) but DRM found cards, the result is usable: NVML's
    problem stays in `problems` and `backend_problem` is cleared. With no DRM card, NVML's
    sample is returned with DRM's notes, if any.
    """
    if not drm.adapters:
        return dataclasses.replace(nvml, notes=drm.notes + nvml.notes) if drm.notes else nvml
    adapters = merge_adapters(nvml.adapters, drm.adapters)
    kept = {a.pci_bus_id for a in adapters if a.backend == BACKEND}
    metrics = dict(nvml.metrics)
    metrics.update({k: v for k, v in drm.metrics.items() if k in kept})
    return dataclasses.replace(
        nvml,
        adapters=adapters,
        metrics=metrics,
        processes=nvml.processes + tuple(p for p in drm.processes if p.adapter in kept),
        problems=nvml.problems + tuple(p for p in drm.problems if p.adapter in kept),
        backend_problem=None,
        notes=drm.notes + nvml.notes,
        extra_metrics={
            **nvml.extra_metrics,
            **{k: v for k, v in drm.extra_metrics.items() if k in kept},
        },
    )


class DrmBackend(GpuSource):
    """Samples DRM cards and clients under `root`; keep one instance across samples."""

    def __init__(self, root: str = "/", clock_ns: Callable[[], int] | None = None) -> None:
        self.root = root
        self._clock = clock_ns or time.monotonic_ns
        self._rates = EngineRates()
        self._energy: dict[str, tuple[int, int]] = {}  # pdev -> (t_ns, µJ)

    def cards(self) -> tuple[DrmCard, ...]:
        return tuple(c for c in enumerate_cards(self.root) if c.supported)

    def close(self) -> None:
        pass  # every read opens and closes its own file

    def sample(self, start_index: int = 0) -> GpuSample:
        """Adapters, device metrics and processes of every amdgpu/i915/xe card."""
        cards = self.cards()
        adapters = drm_adapters(cards, start_index)
        if not cards:
            return GpuSample(BACKEND)
        now = int(self._clock())
        scan = scan_clients(self.root)
        pdevs = {c.pdev for c in cards}
        clients = [c for c in scan.clients if c.pdev in pdevs]
        rates = self._rates.update(clients, now)
        integrated = {p: not _has_local(clients, p) for p in pdevs}
        metrics: dict[str, DeviceMetrics] = {}
        extra: dict[str, CardReadings] = {}
        for card in cards:
            assert card.pdev is not None
            if card.driver in INTEL_DRIVERS:
                wanted = is_system_region if integrated[card.pdev] else is_local_region
                readings = read_intel(self.root, card, _client_sum(clients, card.pdev, wanted))
                readings = self._intel_power(card.pdev, readings, now)
            else:
                readings = read_amdgpu(self.root, card)
            metrics[bus_id(card.pdev)] = readings.metrics
            extra[bus_id(card.pdev)] = readings
        usages = attribute(clients, rates)
        processes = tuple(self._proc(u, clients, integrated[u.pdev]) for u in usages)
        return GpuSample(
            BACKEND,
            adapters=adapters,
            metrics=metrics,
            processes=processes,
            problems=_problems(scan, adapters),
            notes=_notes(scan, cards) + _throttle_notes(extra),
            extra_metrics=_gtt(extra),
        )

    def _intel_power(self, pdev: str, r: CardReadings, now: int) -> CardReadings:
        """Power from hwmon ``energy1_input`` deltas when the card has no power file."""
        if r.metrics.power_w.known or r.energy_uj.value is None:
            return r
        uj = int(r.energy_uj.value)
        prev = self._energy.get(pdev)
        self._energy[pdev] = (now, uj)
        source = f"{r.energy_uj.source} (rate)"
        if prev is None or now <= prev[0] or uj < prev[1]:
            power = Reading.missing(
                Reason.UNAVAILABLE, source, "power is an energy rate: needs two samples"
            )
        else:
            power = Reading.measured((uj - prev[1]) / 1e6 / ((now - prev[0]) / 1e9), source)
        return dataclasses.replace(r, metrics=dataclasses.replace(r.metrics, power_w=power))

    @staticmethod
    def _proc(u: ProcUsage, clients: Sequence[Client], integrated: bool) -> GpuProcess:
        # No name: the collector joins each row with its host sample, which has it for
        # every process, so reading comm here again would be wasted.
        return GpuProcess(
            pid=u.pid,
            adapter=bus_id(u.pdev),
            contexts=("drm",),
            dedicated=_dedicated(u, integrated),
            engines=_engines(u, clients),
        )


def _gtt(extra: Mapping[str, CardReadings]) -> dict[str, dict[str, Reading]]:
    """amdgpu GTT readings of the cards that have them (a card without GTT files has none)."""
    return {
        bus: {"gtt_used_bytes": r.gtt_used_bytes, "gtt_total_bytes": r.gtt_total_bytes}
        for bus, r in extra.items()
        if r.gtt_used_bytes.known or r.gtt_total_bytes.known
    }


def _has_local(clients: Iterable[Client], pdev: str) -> bool:
    return any(is_local_region(r) for c in clients if c.pdev == pdev for r in c.info.regions)


def _client_sum(clients: Iterable[Client], pdev: str, wanted: Callable[[str], bool]) -> int | None:
    """Resident bytes over every visible client of `pdev` (each client once)."""
    total: int | None = None
    for c in clients:
        if c.pdev != pdev:
            continue
        for region, mem in c.info.regions.items():
            if wanted(region) and mem.resident_bytes is not None:
                total = (total or 0) + mem.resident_bytes
    return total


def _dedicated(u: ProcUsage, integrated: bool) -> Reading:
    """The process's measured bytes on its device, or why there are none."""
    if not u.private:
        return Reading.missing(SHARED_REASON, f"{FDINFO_SOURCE}:drm-resident-*", u.memory_why)
    if integrated:
        # An integrated GPU has no VRAM: its buffers are system memory the GPU maps.
        source = f"{FDINFO_SOURCE}:drm-resident-<system regions>"
        if u.system_bytes is None:
            return Reading.missing(Reason.NOT_SUPPORTED, source, "no system-memory region")
        return Reading(u.system_bytes, Kind.MEASURED, source, detail="integrated GPU")
    source = f"{FDINFO_SOURCE}:drm-resident-<vram regions>"
    if u.local_bytes is None:
        return Reading.missing(Reason.NOT_SUPPORTED, source, "client prints no VRAM region")
    return Reading.measured(u.local_bytes, source)


def _engines(u: ProcUsage, clients: Sequence[Client]) -> dict[str, Reading]:
    """``<engine>_percent`` per driver engine plus ``gpu_percent`` (the busiest engine)."""
    by_cycles = {
        e
        for c in clients
        if c.pdev == u.pdev and c.client_id in u.client_ids
        for e in c.info.cycles
        if e not in c.info.engine_ns
    }
    out: dict[str, Reading] = {}
    for engine, pct in sorted(u.engines.items()):
        counter = "drm-cycles" if engine in by_cycles else "drm-engine"
        source = f"{FDINFO_SOURCE}:{counter}-{engine}"
        out[f"{engine}_percent"] = (
            Reading.measured(round(pct, 2), source)
            if pct is not None
            else Reading.missing(Reason.UNAVAILABLE, source, u.engine_why)
        )
    source = f"{FDINFO_SOURCE}:busiest engine"
    values = [r.value for r in out.values()]
    if not u.engines and u.engine_why:
        out["gpu_percent"] = Reading.missing(SHARED_REASON, source, u.engine_why)
    elif values and all(v is not None for v in values):
        out["gpu_percent"] = Reading.measured(max(v for v in values if v is not None), source)
    elif values:
        out["gpu_percent"] = Reading.missing(Reason.UNAVAILABLE, source, u.engine_why)
    return out


def _problems(scan: ScanResult, adapters: Sequence[Adapter]) -> tuple[Problem, ...]:
    if not scan.denied:
        return ()
    detail = (
        f"{len(scan.denied)} processes' DRM descriptors are unreadable to this user "
        "(run as root to see every client)"
    )
    return tuple(Problem("processes.drm", Reason.DENIED, detail, a.pci_bus_id) for a in adapters)


def _throttle_notes(extra: Mapping[str, CardReadings]) -> tuple[str, ...]:
    """One line per card whose GT frequency is throttled now (Intel), naming the reasons."""
    return tuple(
        f"GPU {bus}: frequency throttled ({', '.join(r.throttle_reasons) or 'reason not given'})"
        f" [{r.throttle_source}]"
        for bus, r in extra.items()
        if r.throttle_reasons is not None and r.throttle_active
    )


def _notes(scan: ScanResult, cards: Sequence[DrmCard]) -> tuple[str, ...]:
    notes = []
    if any(c.driver in INTEL_DRIVERS for c in cards):
        notes.append(f"Intel memory: {INTEL_MEMORY_NOTE}")
    if scan.unkeyed:
        notes.append(
            f"{len(scan.unkeyed)} DRM descriptors print no drm-client-id or device: "
            "they cannot be deduplicated and are credited to nobody"
        )
    notes.extend(f"fdinfo: {e}" for e in scan.errors[:5])
    if len(scan.errors) > 5:
        notes.append(f"fdinfo: {len(scan.errors) - 5} more unreadable lines")
    return tuple(notes)
