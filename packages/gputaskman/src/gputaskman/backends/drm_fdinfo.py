"""Parser for DRM client usage stats (``/proc/PID/fdinfo/N`` of a DRM file).

Theory of operation
-------------------
Every open DRM file (a ``/dev/dri/card*`` or ``/dev/dri/renderD*`` descriptor) has an fdinfo
file. Drivers that implement the kernel's "DRM client usage stats" format
(``Documentation/gpu/drm-usage-stats.rst``, torvalds/linux f76ad354, 2025) add
``key:<ws>value`` lines to it:

* identification: ``drm-driver``, ``drm-pdev`` (PCI slot), ``drm-client-id`` (one value per
  ``struct drm_file``: dup'd or inherited descriptors of one client show the same id),
  ``drm-client-name``;
* utilisation: ``drm-engine-<e>: <uint> ns`` (busy time), ``drm-engine-capacity-<e>``
  (identical engines in the group, default 1), ``drm-cycles-<e>`` with either
  ``drm-total-cycles-<e>`` (xe: a GPU timestamp in the same unit) or ``drm-maxfreq-<e>``;
* memory per region: ``drm-total-``, ``drm-shared-``, ``drm-resident-``, ``drm-purgeable-``,
  ``drm-active-<region>``, and the deprecated ``drm-memory-<region>`` (an alias of resident
  that amdgpu still prints beside ``drm-resident-*``), each ``<uint>`` with an optional
  ``KiB``/``MiB`` unit (bytes by default).

This module is sans-io: :func:`parse_fdinfo` takes the file's text and returns a frozen
:class:`FdInfo`. It never raises on bad input: a line it cannot read is kept in
``FdInfo.errors`` and its value is left out (unknown), never turned into 0. Keys it does not
know (driver-private ``amd-*`` keys, future ``drm-*`` keys) are kept verbatim in
``FdInfo.other``. Text without ``drm-driver`` is not a DRM client: the result is ``None``.

Not validated on real hardware: formats come from the kernel sources cited above.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

#: fdinfo files are a few hundred bytes; anything longer than this is read no further.
MAX_FDINFO_CHARS: Final = 64 * 1024

_SIZE_UNITS: Final = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_FREQ_UNITS: Final = {"": 1, "Hz": 1, "KHz": 1000, "kHz": 1000, "MHz": 1000**2, "GHz": 1000**3}
# One pattern decides every drm-* key. Alternatives are tried in order, so the longer
# "engine-capacity" and "total-cycles" win over "engine" and the memory stat "total".
_DRM_KEY = re.compile(
    r"drm-(engine-capacity|engine|total-cycles|cycles|maxfreq"
    r"|total|shared|resident|purgeable|active|memory)-(.+)"
)
_UNITS_BY_KIND: Final = {
    "engine-capacity": {"": 1},
    "engine": {"ns": 1},
    "total-cycles": {"": 1},
    "cycles": {"": 1},
    "maxfreq": _FREQ_UNITS,
}
_KEY = re.compile(r"[^\s:]+")
_UINT = re.compile(r"[0-9]+")
_PDEV = re.compile(r"([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])")


def _empty() -> Mapping[str, int]:
    return MappingProxyType({})


def normalize_pci(address: str | None) -> str | None:
    """Canonical PCI slot address ``dddd:bb:ss.f`` (lower case), or None if it is not one.

    NVML prints an 8-digit domain (``00000000:01:00.0``), sysfs and fdinfo a 4-digit one,
    some tools none (``01:00.0``, domain 0). All compare equal after this.
    """
    if not address:
        return None
    text = address.strip()
    if text.count(":") == 1:
        text = "0:" + text
    m = _PDEV.fullmatch(text)
    if m is None:
        return None
    domain, bus, slot, function = m.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.{function}"


def pci_bus_id(address: str | None) -> str | None:
    """NVML's spelling (8-digit domain, lower case: ``00000000:03:00.0``) of any PCI address
    spelling, or None if it is not one. The one key adapters of every backend pair by."""
    canonical = normalize_pci(address)
    if canonical is None:
        return None
    domain, rest = canonical.split(":", 1)
    return f"{int(domain, 16):08x}:{rest}"


@dataclass(frozen=True, slots=True)
class RegionMemory:
    """One memory region of one client, in bytes; None where the driver printed nothing."""

    total: int | None = None
    shared: int | None = None
    resident: int | None = None
    purgeable: int | None = None
    active: int | None = None
    memory: int | None = None  # deprecated alias of resident (amdgpu prints both)

    @property
    def resident_bytes(self) -> int | None:
        """Resident bytes: ``drm-resident-*``, else its legacy alias ``drm-memory-*``.

        The two are the same quantity, so they are never added together.
        """
        return self.resident if self.resident is not None else self.memory


@dataclass(frozen=True, slots=True)
class FdInfo:
    """What one DRM fdinfo file says. Mappings are read-only; absent means not printed."""

    driver: str
    client_id: int | None = None
    pdev: str | None = None
    client_name: str | None = None
    engine_ns: Mapping[str, int] = field(default_factory=_empty)
    engine_capacity: Mapping[str, int] = field(default_factory=_empty)
    cycles: Mapping[str, int] = field(default_factory=_empty)
    total_cycles: Mapping[str, int] = field(default_factory=_empty)
    maxfreq_hz: Mapping[str, int] = field(default_factory=_empty)
    regions: Mapping[str, RegionMemory] = field(default_factory=_empty)
    other: Mapping[str, str] = field(default_factory=_empty)
    errors: tuple[str, ...] = ()

    def capacity(self, engine: str) -> int:
        """Identical engines behind ``engine``; the spec says to assume 1 when absent."""
        return self.engine_capacity.get(engine, 1)

    @property
    def engines(self) -> tuple[str, ...]:
        """Engine names with a busy-time or busy-cycles counter, sorted."""
        return tuple(sorted(set(self.engine_ns) | set(self.cycles)))


def _number(value: str, units: dict[str, int]) -> int | None:
    """``"<uint>[ unit]"`` to an int scaled by its unit; None if malformed or unit unknown."""
    parts = value.split()
    if not parts or len(parts) > 2 or not _UINT.fullmatch(parts[0]):
        return None
    unit = parts[1] if len(parts) == 2 else ""
    scale = units.get(unit)
    return None if scale is None else int(parts[0]) * scale


def parse_fdinfo(text: str) -> FdInfo | None:
    """Parse one fdinfo file's text. None if it has no ``drm-driver`` (not a DRM client)."""
    if len(text) > MAX_FDINFO_CHARS:
        text = text[:MAX_FDINFO_CHARS]
    errors: list[str] = []
    fields: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            errors.append(f"unreadable line {raw[:80]!r}")
            continue
        if key in fields and fields[key] != value.strip():
            errors.append(f"{key} repeated with a different value; last one kept")
        fields[key] = value.strip()

    driver = fields.pop("drm-driver", None)
    if not driver:
        return None

    engine_ns: dict[str, int] = {}
    capacity: dict[str, int] = {}
    cycles: dict[str, int] = {}
    total_cycles: dict[str, int] = {}
    maxfreq: dict[str, int] = {}
    memory: dict[str, dict[str, int]] = {}
    other: dict[str, str] = {}
    client_id: int | None = None
    pdev: str | None = None
    client_name = fields.pop("drm-client-name", None) or None

    if (raw_id := fields.pop("drm-client-id", None)) is not None:
        if _UINT.fullmatch(raw_id):
            client_id = int(raw_id)
        else:
            errors.append(f"drm-client-id {raw_id[:40]!r} is not an unsigned integer")
    if (raw_pdev := fields.pop("drm-pdev", None)) is not None:
        pdev = normalize_pci(raw_pdev)
        if pdev is None:
            errors.append(f"drm-pdev {raw_pdev[:40]!r} is not a PCI address")

    for key, value in fields.items():
        m = _DRM_KEY.fullmatch(key)
        if m is None:
            other[key] = value
            continue
        kind, name = m.groups()
        number = _number(value, _UNITS_BY_KIND.get(kind, _SIZE_UNITS))
        if number is None:
            errors.append(f"{key}: unreadable value {value[:40]!r}")
        elif kind == "engine-capacity":
            if number == 0:
                errors.append(f"{key} is 0, which the spec forbids; capacity 1 assumed")
            else:
                capacity[name] = number
        elif kind == "engine":
            engine_ns[name] = number
        elif kind == "total-cycles":
            total_cycles[name] = number
        elif kind == "cycles":
            cycles[name] = number
        elif kind == "maxfreq":
            maxfreq[name] = number
        else:
            memory.setdefault(name, {})[kind] = number

    regions = {name: RegionMemory(**stats) for name, stats in memory.items()}
    return FdInfo(
        driver=driver,
        client_id=client_id,
        pdev=pdev,
        client_name=client_name,
        engine_ns=MappingProxyType(engine_ns),
        engine_capacity=MappingProxyType(capacity),
        cycles=MappingProxyType(cycles),
        total_cycles=MappingProxyType(total_cycles),
        maxfreq_hz=MappingProxyType(maxfreq),
        regions=MappingProxyType(regions),
        other=MappingProxyType(other),
        errors=tuple(errors),
    )
