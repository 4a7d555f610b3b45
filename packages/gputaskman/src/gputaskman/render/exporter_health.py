"""The metric families `serve` exports for a GPU's health and MIG instances (`exporter` calls
these for each GPU and process row); `fleet.promhealth` reads them back.

Series (each with the GPU's labels, ``gpu``, ``pci_bus_id``, ``uuid``, ``gpu_name``, and the
``provenance`` label; an unknown reading has no series, never 0):

* ``gputaskman_gpu_health_<key>`` for each health reading (`gpuhealth.HEALTH_FIELDS`:
  ``..._xid_critical_errors``, ``..._ecc_volatile_uncorrected_errors``,
  ``..._clocks_event_reasons`` (the bit mask), ``..._fan_speed_percent``,
  ``..._pcie_tx_bytes_per_second``, ...);
* ``gputaskman_gpu_unhealthy``: 1 when the health verdict is unhealthy, 0 when ok, no series
  when no check could be made (derived from the readings above, for alerting; never read
  back);
* ``gputaskman_gpu_mig_mode``: 1 MIG enabled, 0 disabled (no series: the GPU has no MIG);
* ``gputaskman_mig_info`` (plus ``gpu_instance``, ``compute_instance``, ``mig_uuid``): 1 per
  MIG instance, and ``gputaskman_mig_memory_total_bytes`` / ``..._used_bytes`` /
  ``gputaskman_mig_attributed_bytes`` (measured process VRAM on it) /
  ``gputaskman_mig_attributed_complete`` by the instance's labels;
* ``gputaskman_process_mig_info`` (a process row's labels plus ``gpu_instance`` and
  ``compute_instance``): 1 per row on a MIG instance.
"""

from __future__ import annotations

from gputaskman.base.gpuhealth import HEALTH_FIELDS, OK, UNHEALTHY, instance_attributed, verdict
from gputaskman.base.readings import ProcGpu, Snapshot
from gputaskman.render.exporter_families import Families, info_series

HEALTH_PREFIX = "gputaskman_gpu_health_"
UNHEALTHY_SERIES = "gputaskman_gpu_unhealthy"
MIG_MODE = "gputaskman_gpu_mig_mode"
MIG_INFO = "gputaskman_mig_info"
MIG_LABELS = ("gpu_instance", "compute_instance")
PROCESS_MIG_INFO = "gputaskman_process_mig_info"
# a MIG instance's reading series -> the `MigInstance` field it exports
MIG_READINGS = {
    "gputaskman_mig_memory_total_bytes": "memory_total_bytes",
    "gputaskman_mig_memory_used_bytes": "memory_used_bytes",
}


def gpu_families(
    f: Families, snap: Snapshot, bus: str, labels: tuple[str, ...], gv: tuple[str, ...]
) -> None:
    """One GPU's health, verdict and MIG series (`labels`/`gv`: the GPU's labels)."""
    health = snap.health.get(bus) or {}
    for key, r in health.items():
        what = HEALTH_FIELDS.get(key, key)
        f.reading(f"{HEALTH_PREFIX}{key}", "", f"GPU health: {what}", labels, gv, r)
    state = verdict(health).state if health else None
    if state in (OK, UNHEALTHY):
        f.add(
            UNHEALTHY_SERIES,
            "1 if a health check tripped (XID, uncorrected ECC, pending retirement or remap, "
            "remap failure, slowdown), 0 if none did; absent: no check could be made",
            labels,
            gv,
            1 if state == UNHEALTHY else 0,
        )
    mig = snap.mig.get(bus)
    if mig is None:
        return
    f.reading(MIG_MODE, "", "MIG mode: 1 enabled, 0 disabled", labels, gv, mig.mode)
    for inst in mig.instances:
        iv = (*gv, str(inst.gpu_instance_id), str(inst.compute_instance_id))
        il = (*labels, *MIG_LABELS)
        info_series(f, MIG_INFO, "One per MIG instance", (*il, "mig_uuid"), (*iv, inst.uuid or ""))
        for name, fld in MIG_READINGS.items():
            r = getattr(inst, fld)
            f.reading(name.removesuffix("_bytes"), "bytes", f"MIG instance {fld}", il, iv, r)
        att, complete = instance_attributed(snap, bus, inst)
        if att is not None:  # a sum of measured values only
            doc = "Sum of measured per-process VRAM on the MIG instance"
            f.add("gputaskman_mig_attributed_bytes", doc, il, iv, att)
            doc = "1 if every process's VRAM on the instance was measured"
            f.add("gputaskman_mig_attributed_complete", doc, il, iv, 1 if complete else 0)


def process_families(f: Families, p: ProcGpu, labels: tuple[str, ...], pv: tuple[str, ...]) -> None:
    """A process row's MIG instance, when it is on one."""
    if p.mig is not None:
        doc = "The MIG instance a process row is on (gpu_instance / compute_instance)"
        info_series(f, PROCESS_MIG_INFO, doc, (*labels, *MIG_LABELS), (*pv, *map(str, p.mig)))
