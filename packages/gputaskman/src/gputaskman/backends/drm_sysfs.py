"""DRM cards and their device-wide readings from sysfs (amdgpu, Intel i915 and xe).

Theory of operation
-------------------
`enumerate_cards` lists ``/sys/class/drm/cardN`` (not the connector entries such as
``card0-DP-1``) and reads, through each card's ``device`` link: the PCI address (``uevent``
``PCI_SLOT_NAME``, else the link's target name), ``vendor`` and ``device`` ids, the bound
driver (the ``driver`` link's name), and a product name where the kernel offers one
(amdgpu's ``product_name``, often empty on consumer boards; else the device's line in the
system's ``pci.ids`` from hwdata; else None).

Device readings come from plain sysfs files, one small read each:

* amdgpu: ``mem_info_vram_used/total``, ``mem_info_gtt_used/total`` (bytes),
  ``gpu_busy_percent``, ``mem_busy_percent``, the current ``pp_dpm_sclk``/``pp_dpm_mclk``
  level (the line marked ``*``), and hwmon ``power1_average`` or ``power1_input`` (µW),
  ``power1_cap`` (µW), ``temp1_input`` (m°C).
* Intel: GT frequency (i915 ``gt_act_freq_mhz``, else ``gt_cur_freq_mhz``; xe
  ``tile0/gt0/freq0/act_freq``, else ``cur_freq``), throttle reasons (i915
  ``gt/gtN/throttle_reason_*``, xe ``tileN/gtN/freq0/throttle/reason_*``), hwmon where the
  card has one. Intel has no device-wide memory counter: the caller passes the sum of the
  visible clients' resident bytes as "used", and the total is the largest prefetchable PCI
  BAR (``resource``), a window size rather than a memory size. Both are *inferred* and carry
  `INTEL_MEMORY_NOTE`; a BAR of size 0 is unknown.

Every value is a `model.Reading` whose ``source`` names the sysfs file (relative to the real
``/``, whatever ``root`` the tests use). A file that does not exist is ``not supported``, a
refused read ``denied``, unparseable text ``query failed``; never 0.

Not validated on real hardware: file names and formats follow the kernel's amdgpu, i915 and
xe sysfs code and documentation in the 2025 mainline kernel.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from gputaskman.backends.drm_fdinfo import normalize_pci
from gputaskman.base.readings import DeviceMetrics, Kind, Reading, Reason

DRM_DRIVERS: Final = frozenset({"amdgpu", "i915", "xe"})
INTEL_DRIVERS: Final = frozenset({"i915", "xe"})
VENDORS: Final = {0x1002: "amd", 0x8086: "intel", 0x10DE: "nvidia"}
INTEL_MEMORY_NOTE: Final = (
    "Intel has no device-wide memory counter: used is a sum over the DRM clients this user "
    "can see (buffers shared between clients count once per client), total is the size of "
    "the largest PCI memory window (BAR), not the memory size"
)

_CARD = re.compile(r"card[0-9]+")
_DPM_LEVEL = re.compile(r"\s*[0-9A-Za-z]+:\s*([0-9]+)\s*[Mm][Hh][Zz]\s*(\*)?\s*")
_IORESOURCE_MEM: Final = 0x200
_IORESOURCE_PREFETCH: Final = 0x2000


@dataclass(frozen=True, slots=True)
class DrmCard:
    """One ``/sys/class/drm/cardN`` with what identifies its device."""

    card: str  # "card0"
    pdev: str | None  # "0000:03:00.0", None for a non-PCI device
    vendor_id: int | None
    device_id: int | None
    driver: str | None
    name: str | None

    @property
    def vendor(self) -> str:
        return VENDORS.get(self.vendor_id or -1, "unknown")

    @property
    def supported(self) -> bool:
        """True for the drivers this backend reads (amdgpu, i915, xe) on a PCI device."""
        return self.driver in DRM_DRIVERS and self.pdev is not None

    def sys_path(self, *parts: str) -> str:
        """Path of a file under this card, relative to the root (e.g. for `Reading.source`)."""
        return "/".join(("/sys/class/drm", self.card, *parts))


def _read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel.lstrip("/")), encoding="utf-8", errors="replace") as f:
        return f.read(65536)


def _hex(root: str, rel: str) -> int | None:
    try:
        return int(_read(root, rel).strip(), 16)
    except (OSError, ValueError):
        return None


def enumerate_cards(root: str = "/") -> tuple[DrmCard, ...]:
    """Every ``cardN`` under ``root/sys/class/drm``, in card-number order."""
    base = os.path.join(root, "sys/class/drm")
    try:
        names = [n for n in os.listdir(base) if _CARD.fullmatch(n)]
    except OSError:
        return ()
    cards = []
    for card in sorted(names, key=lambda n: int(n[4:])):
        dev = f"/sys/class/drm/{card}/device"
        uevent: dict[str, str] = {}
        try:
            for line in _read(root, f"{dev}/uevent").splitlines():
                k, _, v = line.partition("=")
                uevent[k] = v.strip()
        except OSError:
            pass
        pdev = normalize_pci(uevent.get("PCI_SLOT_NAME"))
        if pdev is None:
            try:
                pdev = normalize_pci(os.path.basename(os.readlink(os.path.join(root, dev[1:]))))
            except OSError:
                pdev = None
        try:
            driver: str | None = os.path.basename(
                os.readlink(os.path.join(root, dev[1:], "driver"))
            )
        except OSError:
            driver = uevent.get("DRIVER") or None
        name: str | None
        try:
            name = _read(root, f"{dev}/product_name").strip() or None
        except OSError:
            name = None
        vendor_id, device_id = _hex(root, f"{dev}/vendor"), _hex(root, f"{dev}/device")
        if name is None and vendor_id is not None and device_id is not None:
            name = pci_ids_name(root, vendor_id, device_id)
        cards.append(
            DrmCard(
                card=card,
                pdev=pdev,
                vendor_id=vendor_id,
                device_id=device_id,
                driver=driver,
                name=name,
            )
        )
    return tuple(cards)


PCI_IDS: Final = ("usr/share/hwdata/pci.ids", "usr/share/misc/pci.ids", "usr/share/pci.ids")


@functools.lru_cache(maxsize=64)
def pci_ids_name(root: str, vendor_id: int, device_id: int) -> str | None:
    """The device's name in the system's ``pci.ids`` (hwdata), or None.

    Format: a vendor line ``vvvv  Name``, then its devices as ``<tab>dddd  Name``
    (subsystems, two tabs, are skipped). Read once per device and cached.
    """
    vendor_tag, device_tag = f"{vendor_id:04x}  ", f"\t{device_id:04x}  "
    for rel in PCI_IDS:
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                in_vendor = False
                for line in f:
                    if line.startswith(("#", "\t\t")) or not line.strip():
                        continue
                    if not line.startswith("\t"):
                        if in_vendor:
                            return None  # past the vendor's block: unknown device
                        in_vendor = line.lower().startswith(vendor_tag)
                    elif in_vendor and line.lower().startswith(device_tag):
                        return line[len(device_tag) :].strip() or None
        except OSError:
            continue
        return None
    return None


# --------------------------------------------------------------------------- readings


def read_reading(
    root: str, rel: str, parse: Callable[[str], float | int | None], kind: Kind = Kind.MEASURED
) -> Reading:
    """One sysfs file as a Reading; `parse` returns the value or None if the text is bad."""
    source = f"sysfs:{rel}"
    try:
        text = _read(root, rel)
    except FileNotFoundError:
        return Reading.missing(Reason.NOT_SUPPORTED, source, "no such file", kind)
    except PermissionError:
        return Reading.missing(Reason.DENIED, source, "permission denied", kind)
    except OSError as exc:
        # amdgpu answers EPERM/EINVAL/EOPNOTSUPP while suspended or on ASICs without the file
        return Reading.missing(Reason.UNAVAILABLE, source, exc.strerror or str(exc), kind)
    try:
        value = parse(text)
    except (ValueError, OverflowError):
        value = None
    if value is None:
        return Reading.missing(Reason.QUERY_FAILED, source, f"unreadable {text[:40]!r}", kind)
    return Reading(value, kind, source)


def parse_int(text: str) -> int:
    return int(text.strip())


def scaled(factor: float) -> Callable[[str], float]:
    """Parser for an integer file in a small unit (µW, m°C, µJ) scaled to the model's unit."""
    return lambda text: int(text.strip()) * factor


def parse_dpm_current(text: str) -> int | None:
    """The MHz of the ``*``-marked level of ``pp_dpm_sclk``/``pp_dpm_mclk``; None if none."""
    for line in text.splitlines():
        m = _DPM_LEVEL.fullmatch(line)
        if m and m.group(2):
            return int(m.group(1))
    return None


def parse_largest_prefetchable_bar(text: str) -> int | None:
    """Size in bytes of the largest prefetchable memory BAR in a PCI ``resource`` file.

    Each of the first six lines is ``start end flags`` in hex (BAR 0-5); an unused BAR is all
    zeros. None when no prefetchable memory BAR has a non-zero size (unknown, not 0).
    """
    best = 0
    for line in text.splitlines()[:6]:
        parts = line.split()
        if len(parts) != 3:
            continue
        start, end, flags = (int(p, 16) for p in parts)
        if flags & _IORESOURCE_MEM and flags & _IORESOURCE_PREFETCH and end > start:
            best = max(best, end - start + 1)
    return best or None


def hwmon_dir(root: str, card: DrmCard) -> str | None:
    """``device/hwmon/hwmonN`` of the card, relative to root; None if it has none."""
    rel = card.sys_path("device", "hwmon")
    try:
        names = sorted(n for n in os.listdir(os.path.join(root, rel[1:])) if n.startswith("hwmon"))
    except OSError:
        return None
    return f"{rel}/{names[0]}" if names else None


def _first_present(
    root: str, candidates: list[str], parse: Callable[[str], float | int | None]
) -> Reading:
    """The first candidate file that exists, else the first one's 'not supported'."""
    first: Reading | None = None
    for rel in candidates:
        r = read_reading(root, rel, parse)
        if r.reason is not Reason.NOT_SUPPORTED:
            return r
        first = first or r
    assert first is not None
    return first


def _not_supported(source: str, detail: str) -> Reading:
    return Reading.missing(Reason.NOT_SUPPORTED, source, detail)


def hwmon_readings(root: str, card: DrmCard) -> tuple[Reading, Reading, Reading]:
    """(power_w, power_limit_w, temperature_c) from the card's hwmon, each with its reason."""
    hw = hwmon_dir(root, card)
    if hw is None:
        missing = _not_supported(f"sysfs:{card.sys_path('device', 'hwmon')}", "card has no hwmon")
        return missing, missing, missing
    power = _first_present(root, [f"{hw}/power1_average", f"{hw}/power1_input"], scaled(1e-6))
    limit = _first_present(root, [f"{hw}/power1_cap", f"{hw}/power1_max"], scaled(1e-6))
    temp = read_reading(root, f"{hw}/temp1_input", scaled(1e-3))
    return power, limit, temp


@dataclass(frozen=True, slots=True)
class CardReadings:
    """Device readings of one card: the model's `DeviceMetrics` plus what only DRM has."""

    metrics: DeviceMetrics
    gtt_used_bytes: Reading
    gtt_total_bytes: Reading
    throttle_reasons: tuple[str, ...] | None  # None: the card exposes no throttle status
    throttle_source: str | None
    energy_uj: Reading  # hwmon energy1_input (µJ) for a power rate between samples
    throttle_active: bool = False  # a status file says throttled now


def read_amdgpu(root: str, card: DrmCard) -> CardReadings:
    """Device readings of an amdgpu card."""
    dev = card.sys_path("device")
    power, limit, temp = hwmon_readings(root, card)
    vendor_only = "no such counter on amdgpu"
    metrics = DeviceMetrics(
        memory_total_bytes=read_reading(root, f"{dev}/mem_info_vram_total", parse_int),
        memory_used_bytes=read_reading(root, f"{dev}/mem_info_vram_used", parse_int),
        memory_reserved_bytes=_not_supported(f"sysfs:{dev}", vendor_only),
        util_gpu_percent=read_reading(root, f"{dev}/gpu_busy_percent", parse_int),
        util_memory_percent=read_reading(root, f"{dev}/mem_busy_percent", parse_int),
        encoder_percent=_not_supported(f"sysfs:{dev}", vendor_only),
        decoder_percent=_not_supported(f"sysfs:{dev}", vendor_only),
        temperature_c=temp,
        power_w=power,
        power_limit_w=limit,
        clock_graphics_mhz=read_reading(root, f"{dev}/pp_dpm_sclk", parse_dpm_current),
        clock_sm_mhz=_not_supported(f"sysfs:{dev}", vendor_only),
        clock_memory_mhz=read_reading(root, f"{dev}/pp_dpm_mclk", parse_dpm_current),
    )
    return CardReadings(
        metrics=metrics,
        gtt_used_bytes=read_reading(root, f"{dev}/mem_info_gtt_used", parse_int),
        gtt_total_bytes=read_reading(root, f"{dev}/mem_info_gtt_total", parse_int),
        throttle_reasons=None,
        throttle_source=None,
        energy_uj=_not_supported(f"sysfs:{dev}/hwmon", "power comes from power1_*"),
    )


def _gt_dirs(root: str, rel: str, pattern: str) -> list[str]:
    try:
        names = os.listdir(os.path.join(root, rel[1:]))
    except OSError:
        return []
    rx = re.compile(pattern)
    return [f"{rel}/{n}" for n in sorted(names, key=_natural) if rx.fullmatch(n)]


def _natural(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(\D*)(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)


def intel_throttle(root: str, card: DrmCard) -> tuple[tuple[str, ...] | None, str | None, bool]:
    """Throttle state over all GTs: ``(active reasons, source, any status is 1)``.

    ``(None, None, False)`` when the card exposes no throttle status at all. Reasons are
    read only from GTs whose status says throttled.

    i915: ``cardN/gt/gtM/throttle_reason_status`` and ``throttle_reason_<r>``; xe:
    ``device/tileN/gtM/freq0/throttle/status`` and ``reason_<r>``. Each file holds 0 or 1.
    """
    # (directory, status file, prefix of the per-reason files)
    dirs = [
        (d, "throttle_reason_status", "throttle_reason_")
        for d in _gt_dirs(root, card.sys_path("gt"), r"gt[0-9]+")
    ]
    for tile in _gt_dirs(root, card.sys_path("device"), r"tile[0-9]+"):
        dirs += [
            (f"{g}/freq0/throttle", "status", "reason_") for g in _gt_dirs(root, tile, r"gt[0-9]+")
        ]
    found = throttled = False
    active: set[str] = set()
    source = None
    for d, status, prefix in dirs:
        try:
            files = os.listdir(os.path.join(root, d[1:]))
        except OSError:
            continue
        if status not in files:
            continue
        found = True
        source = source or f"sysfs:{d}/{status}"
        try:
            if _read(root, f"{d}/{status}").strip() != "1":
                continue  # this GT is not throttled; its reason bits are all clear
        except OSError:
            continue
        throttled = True
        for f in files:
            if not f.startswith(prefix) or f == status:
                continue
            try:
                if _read(root, f"{d}/{f}").strip() == "1":
                    active.add(f[len(prefix) :])
            except OSError:
                continue
    return (tuple(sorted(active)), source, throttled) if found else (None, None, False)


def intel_gt_freq(root: str, card: DrmCard) -> Reading:
    """Actual GT frequency (MHz) of the first GT: i915 ``gt_act_freq_mhz``, xe ``act_freq``."""
    candidates = [card.sys_path("gt_act_freq_mhz"), card.sys_path("gt_cur_freq_mhz")]
    tiles = _gt_dirs(root, card.sys_path("device"), r"tile[0-9]+")
    for tile in tiles[:1]:
        for gt in _gt_dirs(root, tile, r"gt[0-9]+")[:1]:
            candidates = [f"{gt}/freq0/act_freq", f"{gt}/freq0/cur_freq", *candidates]
    return _first_present(root, candidates, parse_int)


def read_intel(root: str, card: DrmCard, clients_used_bytes: int | None) -> CardReadings:
    """Device readings of an i915 or xe card.

    `clients_used_bytes` is the caller's sum of resident bytes over the visible DRM clients
    of this card (None when it could not be summed), reported as inferred "used".
    """
    dev = card.sys_path("device")
    power, limit, temp = hwmon_readings(root, card)
    hw = hwmon_dir(root, card)
    energy = (
        read_reading(root, f"{hw}/energy1_input", parse_int)
        if hw
        else _not_supported(f"sysfs:{dev}/hwmon", "card has no hwmon")
    )
    total = read_reading(root, f"{dev}/resource", parse_largest_prefetchable_bar, Kind.INFERRED)
    if total.reason is Reason.QUERY_FAILED:
        total = Reading.missing(
            Reason.UNAVAILABLE, total.source, "no sized prefetchable BAR", Kind.INFERRED
        )
    total = _with_detail(total, INTEL_MEMORY_NOTE)
    used_source = "drm-fdinfo:sum(drm-resident-*) over visible clients"
    used = (
        Reading(clients_used_bytes, Kind.INFERRED, used_source, detail=INTEL_MEMORY_NOTE)
        if clients_used_bytes is not None
        else Reading.missing(
            Reason.UNAVAILABLE, used_source, "no visible DRM client reports memory", Kind.INFERRED
        )
    )
    reasons, throttle_source, throttled = intel_throttle(root, card)
    intel_only = "Intel exposes no device-wide counter for this"
    metrics = DeviceMetrics(
        memory_total_bytes=total,
        memory_used_bytes=used,
        memory_reserved_bytes=_not_supported(f"sysfs:{dev}", intel_only),
        util_gpu_percent=_not_supported(f"sysfs:{dev}", intel_only + "; see per-process engines"),
        util_memory_percent=_not_supported(f"sysfs:{dev}", intel_only),
        encoder_percent=_not_supported(f"sysfs:{dev}", intel_only),
        decoder_percent=_not_supported(f"sysfs:{dev}", intel_only),
        temperature_c=temp,
        power_w=power,
        power_limit_w=limit,
        clock_graphics_mhz=intel_gt_freq(root, card),
        clock_sm_mhz=_not_supported(f"sysfs:{dev}", intel_only),
        clock_memory_mhz=_not_supported(f"sysfs:{dev}", intel_only),
    )
    gtt = _not_supported(f"sysfs:{dev}", "no GTT counter on Intel")
    return CardReadings(metrics, gtt, gtt, reasons, throttle_source, energy, throttled)


def _with_detail(r: Reading, note: str) -> Reading:
    detail = note if r.detail is None else f"{r.detail}; {note}"
    return Reading(r.value, r.kind, r.source, r.reason, detail)
