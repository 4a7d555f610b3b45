"""A GPU's health readings and MIG instances as the JSON document writes them (`adapter_json`,
`mig_ref_json`) and as ``--once`` and the TUI's GPU header show them (`health_lines`,
`mig_lines`, `mig_cell`): one writer for each, over the snapshot's readings.

JSON (per adapter; see `report`'s docstring for the whole document)::

    "health": {"xid_critical_errors": R, ..., "nvlink_rx_bytes_per_second": R},  # {}: none
    "health_state": {"state": "ok" | "unhealthy" | "unknown", "reasons": [str, ...],
                     "unchecked": [str, ...]} | null,     # derived from "health" (null: {})
    "mig": {"mode": R, "instances": [MIG_INSTANCE, ...]} | null   # null: not read

    MIG_INSTANCE = {"gpu_instance_id": int, "compute_instance_id": int, "uuid": str | null,
                    "memory_total_bytes": R, "memory_used_bytes": R,
                    "attributed_bytes": int | null,   # measured VRAM of its processes
                    "attributed_complete": bool}      # derived, as the adapter's

and per process ``"mig": {"gpu_instance_id": int, "compute_instance_id": int} | null``.
"""

from __future__ import annotations

from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.gpuhealth import (
    UNHEALTHY,
    UNKNOWN,
    clock_events,
    instance_attributed,
    verdict,
)
from gputaskman.base.readings import Reading, Snapshot


def adapter_json(snapshot: Snapshot, bus: str) -> dict[str, Any]:
    """The ``health``, ``health_state`` and ``mig`` keys of one adapter."""
    health = snapshot.health.get(bus) or {}
    state = snapshot.mig.get(bus)
    mig = None
    if state is not None:
        instances = []
        for inst in state.instances:
            att, complete = instance_attributed(snapshot, bus, inst)
            instances.append(
                {
                    "gpu_instance_id": inst.gpu_instance_id,
                    "compute_instance_id": inst.compute_instance_id,
                    "uuid": inst.uuid,
                    "memory_total_bytes": reading_json(inst.memory_total_bytes),
                    "memory_used_bytes": reading_json(inst.memory_used_bytes),
                    "attributed_bytes": att,
                    "attributed_complete": complete,
                }
            )
        mig = {"mode": reading_json(state.mode), "instances": instances}
    return {
        "health": {k: reading_json(r) for k, r in health.items()},
        "health_state": verdict(health).to_json() if health else None,
        "mig": mig,
    }


def mig_ref_json(mig: tuple[int, int] | None) -> dict[str, int] | None:
    """A process's MIG instance (null: none)."""
    if mig is None:
        return None
    return {"gpu_instance_id": mig[0], "compute_instance_id": mig[1]}


def mig_cell(mig: tuple[int, int] | None) -> str:
    """A process's MIG instance in a table cell, ``mig 1/0`` (GPU / compute instance)."""
    return "" if mig is None else f"mig {mig[0]}/{mig[1]}"


# ---------------------------------------------------------------------------- text


def _r(h: dict[str, Reading] | Any, key: str, unit: str = "", *, as_bytes: bool = False) -> str:
    return fmt_reading(h.get(key), unit, as_bytes=as_bytes, reason=True)


def _rate(h: Any, key: str) -> str:
    r = h.get(key)
    if r is None or r.value is None:
        return fmt_reading(r, reason=True)
    return f"{fmt_bytes(r.value)}/s"


def verdict_line(health: Any) -> str:
    """``ok``, ``UNHEALTHY: why`` or ``unknown``, with the checks that could not be made."""
    v = verdict(health)
    if v.state == UNHEALTHY:
        return "UNHEALTHY: " + "; ".join(v.reasons)
    if v.state == UNKNOWN:
        return f"{NA} (no health check could be made)"
    n = len(v.unchecked)
    tail = f" ({n} check{'s' if n != 1 else ''} n/a: " + ", ".join(v.unchecked) + ")"
    return "ok" + (tail if v.unchecked else "")


def health_lines(snapshot: Snapshot, bus: str) -> list[str]:
    """The GPU's health in four lines (none when the backend reads no health)."""
    h = snapshot.health.get(bus)
    if not h:
        return []
    clocks = h.get("clocks_event_reasons")
    if clocks is not None and clocks.value is not None:
        names = clock_events(int(clocks.value))
        clock_text = ", ".join(names) if names else "none (full clocks)"
    else:
        clock_text = fmt_reading(clocks, reason=True)
    return [
        f"health  {verdict_line(h)}",
        f"errors  XID {_r(h, 'xid_critical_errors')} (last {_r(h, 'xid_last')}) in "
        f"{_r(h, 'xid_watched_seconds', ' s')}"
        f" · ECC volatile {_r(h, 'ecc_volatile_corrected_errors')} corrected /"
        f" {_r(h, 'ecc_volatile_uncorrected_errors')} uncorrected"
        f" · aggregate {_r(h, 'ecc_aggregate_corrected_errors')} /"
        f" {_r(h, 'ecc_aggregate_uncorrected_errors')}",
        f"pages   retired {_r(h, 'retired_pages_single_bit')} single-bit /"
        f" {_r(h, 'retired_pages_double_bit')} double-bit, pending {_r(h, 'retired_pages_pending')}"
        f" · rows remapped {_r(h, 'remapped_rows_correctable')} /"
        f" {_r(h, 'remapped_rows_uncorrectable')}, pending {_r(h, 'remapped_rows_pending')},"
        f" failed {_r(h, 'remapped_rows_failure')}",
        f"clocks  held back by {clock_text} · fan {_r(h, 'fan_speed_percent', '%')}"
        f" · PCIe tx {_rate(h, 'pcie_tx_bytes_per_second')}"
        f" rx {_rate(h, 'pcie_rx_bytes_per_second')}"
        f" · NVLink tx {_rate(h, 'nvlink_tx_bytes_per_second')}"
        f" rx {_rate(h, 'nvlink_rx_bytes_per_second')}",
    ]


def mig_lines(snapshot: Snapshot, bus: str) -> list[str]:
    """The GPU's MIG mode, and one line per instance when enabled (none when not read, or
    when the GPU has no MIG)."""
    state = snapshot.mig.get(bus)
    if state is None or state.mode.value is None:
        return []
    if state.mode.value != 1:
        return ["MIG     disabled"]
    lines = [f"MIG     enabled, {len(state.instances)} instance(s) (GPU/compute instance)"]
    for inst in state.instances:
        att, complete = instance_attributed(snapshot, bus, inst)
        used = fmt_reading(inst.memory_used_bytes, as_bytes=True, reason=True)
        total = fmt_reading(inst.memory_total_bytes, as_bytes=True, reason=True)
        lower = "" if complete else " (lower bound)"
        lines.append(
            f"  {inst.gpu_instance_id}/{inst.compute_instance_id}  memory {used} / {total}"
            f"  attributed {fmt_bytes(att)}{lower}  {inst.uuid or ''}".rstrip()
        )
    return lines
