"""Fake /sys and /proc trees in the kernel's formats, for the DRM backend's tests and demos.

Nothing here was measured on hardware. The text is printed the way the kernel prints it
(torvalds/linux mainline of 2025: amdgpu_fdinfo.c at 11aaec35, xe_drm_client.c at 0739b8ba,
i915_drm_client.c with memory stats): the common ``drm_show_fdinfo`` lines (``drm-driver``,
``drm-client-id``, ``drm-pdev``), ``drm_print_memory_stats`` sizes (bytes, ``KiB`` or
``MiB``, the largest unit that loses nothing), amdgpu's extra ``drm-memory-*`` aliases (with
the stray space in ``drm-memory-gtt: \\t``), i915's ``drm-engine-<class>: N ns`` and xe's
``drm-cycles-*``/``drm-total-cycles-*`` pairs. The sysfs layout mirrors a real PCI device:
``/sys/class/drm/cardN`` links into ``/sys/devices/pci0000:00/<pdev>/drm/cardN`` whose
``device`` link points back at the PCI device directory.

`write_demo_tree` lays out a laptop-like machine (an amdgpu dGPU and an Intel iGPU) with
private, dup'd and shared clients, for ``gputaskman --once``-style demos and tests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def print_size(n: int) -> str:
    """A size as the kernel's fdinfo ``print_size`` writes it: no unit, ``KiB`` or ``MiB``."""
    units = ("", " KiB", " MiB")
    u = 0
    while u < len(units) - 1 and n and not n % KIB:
        n //= KIB
        u += 1
    return f"{n}{units[u]}"


def _header(ino: int) -> str:
    return f"pos:\t0\nflags:\t02100002\nmnt_id:\t25\nino:\t{ino}\n"


def _common(driver: str, client_id: int, pdev: str | None, name: str | None) -> str:
    text = f"drm-driver:\t{driver}\ndrm-client-id:\t{client_id}\n"
    if pdev is not None:
        text += f"drm-pdev:\t{pdev}\n"
    if name is not None:
        text += f"drm-client-name:\t{name}\n"
    return text


@dataclass(frozen=True)
class Region:
    """One region's ``drm_memory_stats`` (bytes); shared counts inside total."""

    private: int = 0
    shared: int = 0
    resident: int = 0
    purgeable: int = 0
    active: int = 0


def _memory_stats(region: str, r: Region, *, active: bool, purgeable: bool) -> str:
    text = f"drm-total-{region}:\t{print_size(r.private + r.shared)}\n"
    text += f"drm-shared-{region}:\t{print_size(r.shared)}\n"
    if active:
        text += f"drm-active-{region}:\t{print_size(r.active)}\n"
    text += f"drm-resident-{region}:\t{print_size(r.resident)}\n"
    if purgeable:
        text += f"drm-purgeable-{region}:\t{print_size(r.purgeable)}\n"
    return text


def amdgpu_fdinfo(
    client_id: int,
    pdev: str,
    *,
    vram: Region = Region(),
    gtt: Region = Region(),
    engines_ns: Mapping[str, int] | None = None,
    legacy: bool = False,
    ino: int = 1047,
) -> str:
    """amdgpu's fdinfo (amdgpu_fdinfo.c). `legacy`: older kernels (memory-only keys)."""
    text = _header(ino)
    if legacy:
        text += f"drm-driver:\tamdgpu\ndrm-pdev:\t{pdev}\ndrm-client-id:\t{client_id}\n"
    else:
        text += _common("amdgpu", client_id, pdev, None)
    text += f"pasid:\t{32768 + client_id}\n"
    if not legacy:
        for name, r in (("vram", vram), ("gtt", gtt), ("cpu", Region())):
            text += _memory_stats(name, r, active=False, purgeable=True)
        for name in ("gds", "gws", "oa", "doorbell", "mmioremap"):
            text += _memory_stats(name, Region(), active=False, purgeable=True)
    text += f"drm-memory-vram:\t{vram.resident // KIB} KiB\n"
    text += f"drm-memory-gtt: \t{gtt.resident // KIB} KiB\n"
    text += "drm-memory-cpu: \t0 KiB\n"
    text += "amd-evicted-vram:\t0 KiB\n"
    text += f"amd-requested-vram:\t{(vram.private + vram.shared) // KIB} KiB\n"
    text += f"amd-requested-gtt:\t{(gtt.private + gtt.shared) // KIB} KiB\n"
    for engine, ns in (engines_ns or {}).items():
        if ns:  # amdgpu skips engines whose busy time is still 0
            text += f"drm-engine-{engine}:\t{ns} ns\n"
    return text


def i915_fdinfo(
    client_id: int,
    pdev: str,
    *,
    regions: Mapping[str, Region] | None = None,
    engines_ns: Mapping[str, int] | None = None,
    capacity: Mapping[str, int] | None = None,
    ino: int = 2048,
) -> str:
    """i915's fdinfo (i915_drm_client.c): memory per region, then busy ns per engine class."""
    text = _header(ino) + _common("i915", client_id, pdev, None)
    for name, r in (regions or {"system0": Region(), "stolen-system0": Region()}).items():
        text += _memory_stats(name, r, active=True, purgeable=True)
    caps = capacity or {}
    for engine, ns in (engines_ns or {}).items():
        text += f"drm-engine-{engine}:\t{ns} ns\n"
        if caps.get(engine, 1) > 1:
            text += f"drm-engine-capacity-{engine}:\t{caps[engine]}\n"
    return text


def xe_fdinfo(
    client_id: int,
    pdev: str,
    *,
    regions: Mapping[str, Region] | None = None,
    cycles: Mapping[str, int] | None = None,
    total_cycles: int = 0,
    capacity: Mapping[str, int] | None = None,
    ino: int = 685,
) -> str:
    """xe's fdinfo (xe_drm_client.c): memory per region, then cycles and total cycles."""
    text = _header(ino) + _common("xe", client_id, pdev, None)
    for name, r in (regions or {"system": Region(), "gtt": Region()}).items():
        text += _memory_stats(name, r, active=True, purgeable=name == "system")
    caps = capacity or {}
    for engine, n in (cycles or {}).items():
        text += f"drm-cycles-{engine}:\t{n}\n"
        text += f"drm-total-cycles-{engine}:\t{total_cycles}\n"
        if caps.get(engine, 1) > 1:
            text += f"drm-engine-capacity-{engine}:\t{caps[engine]}\n"
    return text


@dataclass
class FakeTree:
    """Writes a fake ``sys`` and ``proc`` below `root` (a temporary directory)."""

    root: Path
    btime: int = 1796000000
    clk_tck: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))

    def __post_init__(self) -> None:
        proc = self.root / "proc"
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "stat").write_text(f"cpu  1 2 3 4\nbtime {self.btime}\n")
        (self.root / "sys/class/drm").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ sysfs
    def _pci_dir(self, pdev: str) -> Path:
        return self.root / "sys/devices/pci0000:00" / pdev

    def card(
        self,
        card: str,
        pdev: str,
        *,
        driver: str,
        vendor: int,
        device: int,
        render: str | None = None,
        files: Mapping[str, str] | None = None,
        card_files: Mapping[str, str] | None = None,
    ) -> Path:
        """A PCI DRM card; `files` go in the PCI device dir, `card_files` in the card dir.

        Keys may contain ``/`` for subdirectories. Returns the PCI device directory.
        """
        dev = self._pci_dir(pdev)
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "vendor").write_text(f"0x{vendor:04x}\n")
        (dev / "device").write_text(f"0x{device:04x}\n")
        (dev / "uevent").write_text(
            f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={vendor:04X}:{device:04X}\n"
            f"PCI_SLOT_NAME={pdev}\nMODALIAS=pci:v0000{vendor:04X}d0000{device:04X}\n"
        )
        drivers = self.root / "sys/bus/pci/drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        if not (dev / "driver").is_symlink():
            (dev / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")
        for rel, text in (files or {}).items():
            (dev / rel).parent.mkdir(parents=True, exist_ok=True)
            (dev / rel).write_text(text)
        for node in [card, *([render] if render else [])]:
            node_dir = dev / "drm" / node
            node_dir.mkdir(parents=True, exist_ok=True)
            (node_dir / "device").symlink_to(f"../../../{pdev}")
            (self.root / "sys/class/drm" / node).symlink_to(
                f"../../devices/pci0000:00/{pdev}/drm/{node}"
            )
        for rel, text in (card_files or {}).items():
            path = dev / "drm" / card / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return dev

    def connector(self, card: str, pdev: str, name: str) -> None:
        """A connector entry such as ``card0-DP-1`` (not a card; must be skipped)."""
        d = self._pci_dir(pdev) / "drm" / card / f"{card}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "status").write_text("disconnected\n")
        (self.root / "sys/class/drm" / f"{card}-{name}").symlink_to(
            f"../../devices/pci0000:00/{pdev}/drm/{card}/{card}-{name}"
        )

    # ------------------------------------------------------------------ procfs
    def process(
        self,
        pid: int,
        comm: str,
        fds: Mapping[int, tuple[str, str | None]],
        *,
        start_ticks: int = 1000,
        argv: tuple[str, ...] | None = None,
        rss_pages: int = 2560,
    ) -> None:
        """A process whose descriptors are ``fd -> (link target, fdinfo text or None)``.

        ``cmdline`` (NUL-separated `argv`, default the comm), ``statm`` (`rss_pages`
        resident) and an empty ``maps`` are written too, so host and procinfo readers see a
        whole process."""
        d = self.root / "proc" / str(pid)
        (d / "fd").mkdir(parents=True, exist_ok=True)
        (d / "fdinfo").mkdir(exist_ok=True)
        (d / "comm").write_text(comm + "\n")
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in (argv or (comm,))))
        (d / "statm").write_text(f"{rss_pages * 4} {rss_pages} 0 1 0 {rss_pages} 0\n")
        if not (d / "maps").exists():
            (d / "maps").write_text("")  # no mapped files (a real process always has maps)
        rest = " ".join(["0"] * 30)
        fields = f"S 1 {pid} {pid} 0 -1 4194304 0 0 0 0 5 3 0 0 20 0 1 0 {start_ticks} 0 100"
        (d / "stat").write_text(f"{pid} ({comm}) {fields} {rest}\n")
        for fd, (target, info) in fds.items():
            link = d / "fd" / str(fd)
            if link.is_symlink():
                link.unlink()
            link.symlink_to(target)
            text = info if info is not None else _header(fd)
            (d / "fdinfo" / str(fd)).write_text(text)

    def create_time(self, start_ticks: int) -> float:
        return start_ticks / self.clk_tck + self.btime


AMD_PDEV = "0000:03:00.0"
INTEL_PDEV = "0000:00:02.0"


def bar_line(start: int, size: int, flags: int) -> str:
    end = start + size - 1 if size else 0
    return f"0x{start:016x} 0x{end:016x} 0x{flags:016x}\n"


def intel_resource(bar2_size: int) -> str:
    """An Intel GPU's ``resource``: BAR0 64-bit MMIO, BAR2 64-bit prefetchable window."""
    unused = bar_line(0, 0, 0)
    return (
        bar_line(0x6000000000, 16 * MIB, 0x140204)
        + unused
        + (bar_line(0x4000000000, bar2_size, 0x14220C) if bar2_size else unused)
        + unused
        + bar_line(0x4000, 64, 0x40101)
        + unused
        + unused
    )


def write_demo_tree(root: Path, *, step: int = 0) -> FakeTree:
    """A laptop-like machine: amdgpu dGPU at 03:00.0 and an i915 iGPU at 00:02.0.

    Processes: 4100 ``llama-server`` (one private amdgpu render client, fd 5 dup'd as fd 9),
    4200 ``Xorg`` (amdgpu primary-node client), 4300/4301 ``steam``/``steamwebhelper``
    (one amdgpu client inherited across fork: shared, credited to nobody), 4400 ``firefox``
    (a private i915 client). `step` advances engine counters so two trees taken one second
    apart give rates; call it again with ``step=1`` on the same root to advance.
    """
    tree = FakeTree(root)
    if not (root / "sys/class/drm/card0").exists():
        dpm = "0: 500Mhz\n1: 1800Mhz *\n2: 2400Mhz\n"
        tree.card(
            "card0",
            AMD_PDEV,
            driver="amdgpu",
            vendor=0x1002,
            device=0x7550,
            render="renderD128",
            files={
                "mem_info_vram_total": str(16 * GIB) + "\n",
                "mem_info_vram_used": str(5 * GIB) + "\n",
                "mem_info_gtt_total": str(12 * GIB) + "\n",
                "mem_info_gtt_used": str(300 * MIB) + "\n",
                "gpu_busy_percent": "37\n",
                "mem_busy_percent": "12\n",
                "pp_dpm_sclk": dpm,
                "pp_dpm_mclk": "0: 96Mhz\n1: 1258Mhz *\n",
                "product_name": "\n",
                "hwmon/hwmon4/name": "amdgpu\n",
                "hwmon/hwmon4/power1_average": "123000000\n",
                "hwmon/hwmon4/power1_cap": "220000000\n",
                "hwmon/hwmon4/temp1_input": "61000\n",
            },
        )
        tree.connector("card0", AMD_PDEV, "DP-1")
        tree.card(
            "card1",
            INTEL_PDEV,
            driver="i915",
            vendor=0x8086,
            device=0x4680,
            render="renderD129",
            files={"resource": intel_resource(256 * MIB)},
            card_files={
                "gt_act_freq_mhz": "1100\n",
                "gt_cur_freq_mhz": "1150\n",
                "gt/gt0/throttle_reason_status": "1\n",
                "gt/gt0/throttle_reason_pl1": "1\n",
                "gt/gt0/throttle_reason_thermal": "0\n",
            },
        )
    gfx = 400_000_000 * step  # 40% of one second per step
    llama = amdgpu_fdinfo(
        11,
        AMD_PDEV,
        vram=Region(private=4 * GIB, resident=4 * GIB),
        gtt=Region(private=64 * MIB, resident=64 * MIB),
        engines_ns={"gfx": 1_000_000_000 + gfx, "compute": 5_000_000_000 + 2 * gfx},
    )
    tree.process(
        4100,
        "llama-server",
        {
            5: ("/dev/dri/renderD128", llama),
            9: ("/dev/dri/renderD128", llama),
            3: ("/tmp/model.gguf", None),
        },
    )
    xorg = amdgpu_fdinfo(
        2,
        AMD_PDEV,
        vram=Region(private=96 * MIB, resident=96 * MIB),
        engines_ns={"gfx": 7_000_000_000 + gfx // 4},
    )
    tree.process(4200, "Xorg", {12: ("/dev/dri/card0", xorg)}, start_ticks=500)
    steam = amdgpu_fdinfo(
        20,
        AMD_PDEV,
        vram=Region(private=200 * MIB, resident=200 * MIB),
        engines_ns={"gfx": 2_000_000_000 + gfx // 8},
    )
    tree.process(4300, "steam", {30: ("/dev/dri/renderD128", steam)}, start_ticks=2000)
    tree.process(4301, "steamwebhelper", {30: ("/dev/dri/renderD128", steam)}, start_ticks=2100)
    firefox = i915_fdinfo(
        7,
        INTEL_PDEV,
        regions={
            "system0": Region(private=150 * MIB, resident=150 * MIB),
            "stolen-system0": Region(),
        },
        engines_ns={"render": 3_000_000_000 + gfx // 2, "copy": 0, "video": 0, "video-enhance": 0},
        capacity={"video": 2},
    )
    tree.process(4400, "firefox", {40: ("/dev/dri/renderD129", firefox)}, start_ticks=3000)
    return tree


def main(argv: list[str] | None = None) -> int:
    """``python -m gputaskman.drm_fixtures DIR [STEP]``: write (or advance) the demo tree."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) > 2 or (len(args) == 2 and not args[1].isdigit()):
        print("usage: python -m gputaskman.drm_fixtures DIR [STEP]", file=sys.stderr)
        return 2
    write_demo_tree(Path(args[0]), step=int(args[1]) if len(args) == 2 else 0)
    print(f"demo DRM tree written under {args[0]} (not measured on hardware)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
