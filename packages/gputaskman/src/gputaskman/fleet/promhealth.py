"""One host's GPU health readings and MIG instances rebuilt from the series its ``serve``
exported (`render.exporter_health` writes them): `promseries` hands each series to
`HealthSeries.take` and builds the snapshot with what it gathered.

What comes back: each ``gputaskman_gpu_health_<key>`` as the GPU's health reading ``key``
(its kind from the ``provenance`` label), so the verdict (`gpuhealth.verdict`) is made again
from the readings, as from a host's own document; ``gputaskman_gpu_mig_mode`` and, per MIG
instance, ``gputaskman_mig_info`` (its ids and UUID) and its memory series; and a process
row's instance from ``gputaskman_process_mig_info``. What the exporter derives
(``gputaskman_gpu_unhealthy``, a MIG instance's attributed sums) is not read: it follows from
the rest. A MIG instance whose memory series are missing has those readings unknown ("no
series in Prometheus"), never 0; a GPU with instances but no mode series has its mode unknown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Protocol

from gputaskman.base.gpuhealth import HEALTH_FIELDS
from gputaskman.base.readings import Kind, MigInstance, MigState, ProcGpu, Reading
from gputaskman.fleet.promreadings import KINDS, absent
from gputaskman.render.exporter_health import (
    HEALTH_PREFIX,
    MIG_INFO,
    MIG_MODE,
    MIG_READINGS,
    PROCESS_MIG_INFO,
    UNHEALTHY_SERIES,
)

DERIVED = ("gputaskman_mig_attributed_bytes", "gputaskman_mig_attributed_complete")
# what the fleet table needs of each host (its unhealthy flag): a regex for `promseries`
TABLE_PATTERN = f"{HEALTH_PREFIX}.+"

ProcKey = tuple[str, str, str]  # a process series' pid, name and pci_bus_id labels


class Builder(Protocol):
    """`promseries._Builder`: a checked reading from one series' value."""

    def reading(
        self, name: str, value: float, kind: Kind, scale: float = 1, adapter: str | None = None
    ) -> Reading: ...


def _ids(labels: Mapping[str, str]) -> tuple[int, int] | None:
    gi, ci = labels.get("gpu_instance", ""), labels.get("compute_instance", "")
    return (int(gi), int(ci)) if gi.isdigit() and ci.isdigit() else None


class HealthSeries:
    """The health and MIG series of one host, gathered as they come."""

    def __init__(self) -> None:
        self.health: dict[str, dict[str, Reading]] = {}
        self.modes: dict[str, Reading] = {}
        self.instances: dict[str, dict[tuple[int, int], dict[str, object]]] = {}
        self.on_instance: dict[ProcKey, tuple[int, int]] = {}

    def take(self, b: Builder, name: str, labels: Mapping[str, str], value: float) -> bool:
        """Keeps `name`'s sample when it is one of these series (True), else leaves it."""
        pci = labels.get("pci_bus_id", "")
        kind = KINDS.get(labels.get("provenance", ""), Kind.MEASURED)
        if name.startswith(HEALTH_PREFIX):
            key = name.removeprefix(HEALTH_PREFIX)
            if kind is not Kind.MEASURED:
                key = key.removesuffix(f"_{kind.value}")
            self.health.setdefault(pci, {})[key] = b.reading(name, value, kind, 1, pci)
        elif name.startswith(MIG_MODE):
            self.modes[pci] = b.reading(name, value, kind, 1, pci)
        elif name == MIG_INFO or name in MIG_READINGS:
            ids = _ids(labels)
            if ids is not None:
                got = self.instances.setdefault(pci, {}).setdefault(ids, {})
                if name == MIG_INFO:
                    got["uuid"] = labels.get("mig_uuid") or None
                else:
                    got[MIG_READINGS[name]] = b.reading(name, value, kind, 1, pci)
        elif name == PROCESS_MIG_INFO:
            ids = _ids(labels)
            if ids is not None:
                key = (labels.get("pid", ""), labels.get("name", ""), pci)
                self.on_instance[key] = ids
        elif name != UNHEALTHY_SERIES and name not in DERIVED:
            return False
        return True

    def health_of(self, gpus: Iterable[str]) -> dict[str, dict[str, Reading]]:
        """Each GPU's health readings, for the GPUs that exported one: every key of
        `HEALTH_FIELDS` (unknown without a series), then any later version's."""
        out = {}
        for pci in gpus:
            got = self.health.get(pci)
            if got:
                known = {k: got.get(k) or absent(f"{HEALTH_PREFIX}{k}") for k in HEALTH_FIELDS}
                out[pci] = {**known, **got}
        return out

    def mig_of(self, gpus: Iterable[str]) -> dict[str, MigState]:
        """Each GPU's MIG state, for the GPUs that exported a mode or an instance."""
        out = {}
        for pci in gpus:
            found = self.instances.get(pci, {})
            if pci not in self.modes and not found:
                continue
            instances = tuple(
                MigInstance(
                    gi,
                    ci,
                    got.get("uuid"),  # type: ignore[arg-type]
                    got.get("memory_total_bytes") or absent("gputaskman_mig_memory_total_bytes"),  # type: ignore[arg-type]
                    got.get("memory_used_bytes") or absent("gputaskman_mig_memory_used_bytes"),  # type: ignore[arg-type]
                )
                for (gi, ci), got in sorted(found.items())
            )
            out[pci] = MigState(self.modes.get(pci) or absent(MIG_MODE), instances)
        return out

    def placed(self, key: ProcKey, row: ProcGpu) -> ProcGpu:
        """`row` with the MIG instance its series name, if any."""
        ids = self.on_instance.get(key)
        return row if ids is None else dataclasses.replace(row, mig=ids)
