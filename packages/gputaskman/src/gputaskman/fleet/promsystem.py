"""A host's system panel (the document's ``system`` object: RAM, swap and its devices, CPU)
rebuilt from the ``gputaskman_system_*`` series its serve exported (`render.exporter_system`
writes them), for `promseries`. A key with no series is unknown, never 0; one the exporter
never writes says so (`promreadings.NOT_EXPORTED`).
"""

from __future__ import annotations

from typing import Protocol

from gputaskman.base.readings import Kind, Reading
from gputaskman.document.doctypes import SwapDeviceDoc, SwapDoc, SystemDoc
from gputaskman.fleet.promreadings import NO_SERIES, NOT_EXPORTED_READING, SOURCE, absent
from gputaskman.render.exporter_families import metric_name
from gputaskman.render.exporter_system import SYSTEM_MEMORY, SYSTEM_SWAP

# the system object's keys, as a host sampler writes them (`host.MemoryInfo`, `host.CpuInfo`)
MEMORY_KEYS = (
    "total_bytes",
    "available_bytes",
    "used_bytes",
    "free_bytes",
    "cached_bytes",
    "buffers_bytes",
    "shared_bytes",
)
CPU_KEYS = ("logical_cpus", "load_1", "load_5", "load_15", "percent")
SWAP_KEYS = ("total_bytes", "free_bytes", "used_bytes")
# a system series' name -> (the system object's section, its key there, the kind)
_SYSTEM_BYTES = [("memory", n) for n in SYSTEM_MEMORY] + [("swap", n) for n in SYSTEM_SWAP]
SYSTEM_SERIES: dict[str, tuple[str, str, Kind]] = {
    metric_name(f"gputaskman_system_{sec}_{n}", "bytes", k): (sec, f"{n}_bytes", k)
    for sec, n in _SYSTEM_BYTES
    for k in Kind
} | {metric_name("gputaskman_system_cpu", "percent", k): ("cpu", "percent", k) for k in Kind}
_SYSTEM_MEASURED = {
    (section, key): name
    for name, (section, key, kind) in SYSTEM_SERIES.items()
    if kind is Kind.MEASURED
}
# a swap device's series (always measured: the exporter writes /proc/swaps's numbers)
SWAP_DEVICE_SERIES = {
    "gputaskman_system_swap_device_size_bytes": "size_bytes",
    "gputaskman_system_swap_device_used_bytes": "used_bytes",
}


class Checker(Protocol):
    """`promseries._Builder`: refuses an impossible value, recording the problem."""

    def impossible(
        self, name: str, value: float, kind: Kind, adapter: str | None, why: str = ""
    ) -> Reading: ...


def not_over(
    b: Checker, rs: dict[str, Reading], used: str, total: str, what: str = "the total"
) -> None:
    """Refuses ``rs[used]`` when it is over ``rs[total]`` (memory no host can have used)."""
    u, t = rs.get(used), rs.get(total)
    if u is None or t is None or u.value is None or t.value is None or u.value <= t.value:
        return
    name = u.source.removeprefix(f"{SOURCE}:")
    rs[used] = b.impossible(name, float(u.value), u.kind, None, f": over {what} of {t.value:g}")


def _section(got: dict[str, Reading], section: str, keys: tuple[str, ...]) -> dict[str, Reading]:
    """Every key of a system section: its series' reading, unknown without one."""
    out = {}
    for key in keys:
        r = got.get(key)
        if r is None:
            name = _SYSTEM_MEASURED.get((section, key))
            r = NOT_EXPORTED_READING if name is None else absent(name)
        out[key] = r
    return out


def system_doc(
    b: Checker,
    parts: dict[str, dict[str, Reading]],
    devices: dict[tuple[str, str], dict[str, Reading]],
) -> SystemDoc | None:
    """The document's ``system`` object from the readings of its series by section
    (`SYSTEM_SERIES`) and by swap device (file name, type; `SWAP_DEVICE_SERIES`); None when the
    host exported none. Used bytes over their total are refused through `b`."""
    if not parts and not devices:
        return None
    memory, swap, cpu = parts.get("memory", {}), parts.get("swap", {}), parts.get("cpu", {})
    not_over(b, memory, "used_bytes", "total_bytes")
    not_over(b, swap, "used_bytes", "total_bytes")
    busy = cpu.get("percent")
    if busy is not None and busy.value is not None and busy.value > 100:
        name = busy.source.removeprefix(f"{SOURCE}:")
        why = ": over 100 percent of all CPUs"
        cpu["percent"] = b.impossible(name, float(busy.value), busy.kind, None, why)
    listed = []
    for (filename, swap_type), rs in sorted(devices.items()):
        not_over(b, rs, "used_bytes", "size_bytes", "the size")
        size = rs.get("size_bytes") or absent("gputaskman_system_swap_device_size_bytes")
        used = rs.get("used_bytes") or absent("gputaskman_system_swap_device_used_bytes")
        listed.append(SwapDeviceDoc(filename, swap_type, size, used, NOT_EXPORTED_READING))
    return SystemDoc(
        None,  # the host sample's own time is not exported
        _section(memory, "memory", MEMORY_KEYS),
        SwapDoc(
            *_section(swap, "swap", SWAP_KEYS).values(),
            tuple(listed) if devices else None,
            None if devices else NO_SERIES,
        ),
        _section(cpu, "cpu", CPU_KEYS),
    )
