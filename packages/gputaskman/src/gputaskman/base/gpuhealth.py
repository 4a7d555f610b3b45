"""What a GPU's health readings say (`verdict`: ok, unhealthy and why, or unknown) and what is
attributed to each of its MIG instances (`instance_attributed`): pure functions over the
snapshot's readings, shared by every writer and reader.

Health readings (`Snapshot.health`, JSON ``adapters[].health``) are `Reading`s keyed as
`HEALTH_FIELDS` lists them; NVML is the only backend that reads them (`backends.nvml_health`).
A GPU is **unhealthy** when a known reading shows one of these (`CHECKS`):

* a critical XID event since gputaskman began watching (NVML's event API);
* an uncorrected ECC error since the driver loaded (volatile count);
* a page retirement or a row remap waiting for a GPU reset, or a row remap that failed;
* clocks slowed by a hardware slowdown, a thermal slowdown (hardware or software) or a
  hardware power brake (the clock event reasons; a software power cap, idle or an
  applications-clocks setting are not).

It is **ok** when no check trips and at least one could be made; the checks that could not
(a counter the GPU or driver does not have, a failed call) are listed as `unchecked` with
the reason, so "ok" never claims what was not read. It is **unknown** when no check could be
made. An unknown reading never makes a GPU healthy or unhealthy.

This module imports only the standard library and `base.readings`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gputaskman.base.readings import Kind, MigInstance, Reading, Snapshot

# key -> what it is, in words (the unit is in the key where it has one)
HEALTH_FIELDS: dict[str, str] = {
    "xid_critical_errors": "critical XID events since gputaskman began watching",
    "xid_last": "the code of the latest critical XID event",
    "xid_watched_seconds": "how long XID events have been watched",
    "ecc_volatile_corrected_errors": "corrected ECC errors since the driver loaded",
    "ecc_volatile_uncorrected_errors": "uncorrected ECC errors since the driver loaded",
    "ecc_aggregate_corrected_errors": "corrected ECC errors over the GPU's life",
    "ecc_aggregate_uncorrected_errors": "uncorrected ECC errors over the GPU's life",
    "retired_pages_single_bit": "pages retired for single-bit ECC errors",
    "retired_pages_double_bit": "pages retired for double-bit ECC errors",
    "retired_pages_pending": "1 when a page retirement waits for a reset",
    "remapped_rows_correctable": "rows remapped for correctable errors",
    "remapped_rows_uncorrectable": "rows remapped for uncorrectable errors",
    "remapped_rows_pending": "1 when a row remap waits for a reset",
    "remapped_rows_failure": "1 when a row remap failed",
    "clocks_event_reasons": "bit mask of why the clocks are below their maximum",
    "fan_speed_percent": "fan speed, percent of its maximum",
    "pcie_tx_bytes_per_second": "PCIe bytes sent per second since the last refresh",
    "pcie_rx_bytes_per_second": "PCIe bytes received per second since the last refresh",
    "nvlink_tx_bytes_per_second": "NVLink data bytes sent per second, all links",
    "nvlink_rx_bytes_per_second": "NVLink data bytes received per second, all links",
}

# NVML's clock event (throttle) reason bits, by name
CLOCK_EVENTS: dict[int, str] = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
SLOWDOWN_BITS = 0x8 | 0x20 | 0x40 | 0x80  # the reasons that make a GPU unhealthy

OK, UNHEALTHY, UNKNOWN = "ok", "unhealthy", "unknown"


def clock_events(mask: int) -> list[str]:
    """The names of the bits set in a clock event reasons mask (unknown bits in hex)."""
    names = [name for bit, name in CLOCK_EVENTS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_EVENTS)
    return names + ([f"0x{rest:x}"] if rest else [])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _xid(v: int, h: Mapping[str, Reading]) -> str | None:
    if v <= 0:
        return None
    last = h.get("xid_last")
    code = f" (latest XID {int(last.value)})" if last is not None and last.known else ""
    return f"{_plural(v, 'critical XID event')} since watching began{code}"


def _ecc(v: int, h: Mapping[str, Reading]) -> str | None:
    return f"{_plural(v, 'uncorrected ECC error')} since the driver loaded" if v > 0 else None


def _flag(words: str) -> Callable[[int, Mapping[str, Reading]], str | None]:
    return lambda v, h: words if v == 1 else None


def _clocks(v: int, h: Mapping[str, Reading]) -> str | None:
    slow = clock_events(v & SLOWDOWN_BITS)
    return f"clocks slowed: {', '.join(slow)}" if slow else None


# key -> what a known value of it says (None: nothing wrong)
CHECKS: dict[str, Callable[[int, Mapping[str, Reading]], str | None]] = {
    "xid_critical_errors": _xid,
    "ecc_volatile_uncorrected_errors": _ecc,
    "retired_pages_pending": _flag("a page retirement waits for a GPU reset"),
    "remapped_rows_pending": _flag("a row remap waits for a GPU reset"),
    "remapped_rows_failure": _flag("a row remap failed"),
    "clocks_event_reasons": _clocks,
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """`state` is `OK`, `UNHEALTHY` or `UNKNOWN`; `reasons` why it is unhealthy; `unchecked`
    the checks that could not be made, each ``"<key>: <reason>"``."""

    state: str
    reasons: tuple[str, ...] = ()
    unchecked: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "reasons": list(self.reasons),
            "unchecked": list(self.unchecked),
        }


def verdict(health: Mapping[str, Reading]) -> Verdict:
    """What `health` says (see the module docstring)."""
    reasons: list[str] = []
    unchecked: list[str] = []
    checked = 0
    for key, check in CHECKS.items():
        r = health.get(key)
        if r is None or r.value is None:
            unchecked.append(f"{key}: {'not read' if r is None else r.reason}")
            continue
        checked += 1
        said = check(int(r.value), health)
        if said is not None:
            reasons.append(said)
    state = UNHEALTHY if reasons else OK if checked else UNKNOWN
    return Verdict(state, tuple(reasons), tuple(unchecked))


def instance_where(inst: MigInstance) -> str:
    """The `Problem.where` of a failed process list on a MIG instance (a process-list
    problem, so its GPU's attributed sum is a lower bound too); without the ``processes.``
    prefix, of a process listed on several instances (reason ``shared``)."""
    return f"processes.mig.{inst.gpu_instance_id}.{inst.compute_instance_id}"


def instance_attributed(snapshot: Snapshot, bus: str, inst: MigInstance) -> tuple[int | None, bool]:
    """The measured bytes of the processes on MIG instance `inst` of GPU `bus` (None when
    nothing was measured), and whether that sum is complete (no process's memory hidden, no
    failed list on the instance). Each process row is on one instance: these sums never
    count a byte twice, and together they are the GPU's attributed sum."""
    ids = (inst.gpu_instance_id, inst.compute_instance_id)
    total: int | None = None
    where = instance_where(inst).removeprefix("processes.")  # a failed list, or a shared row
    complete = all(
        not (p.where.removeprefix("processes.") == where and p.adapter == bus)
        for p in snapshot.problems
    )
    for p in snapshot.processes:
        if p.adapter != bus or p.mig != ids:
            continue
        d = p.dedicated
        if d.kind is Kind.MEASURED and d.value is not None:
            total = (total or 0) + int(d.value)
        elif p.parent_pid is None:
            complete = False
    return total, complete
