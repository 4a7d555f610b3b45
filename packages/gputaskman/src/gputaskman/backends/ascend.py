"""Huawei Ascend NPUs on Linux, from the text tables ``npu-smi info`` prints.

Theory of operation
-------------------
``npu-smi info`` prints two box-drawn tables (format as seen in public samples from
npu-smi 23.0 to 25.5, e.g. the test fixtures of youyve/nputop ``tests/test_libascend.py``):

* the device table, two rows per chip::

  | NPU   Name     | Health  | Power(W)    Temp(C)           Hugepages-Usage(page)|
  | Chip           | Bus-Id  | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
  | 0     910B2C   | OK      | 88.6        51                0    / 0             |
  | 0              | 0000:5A:00.0  | 0     0    / 0          20701/ 65536         |

  (the first two columns narrowed here; npu-smi pads them wider)

  dual-die cards (``Chip  Phy-ID``) print one such pair per die, the second die's power
  as ``-``; boards without HBM (310B) print no HBM column and ``NA`` as bus id;
* the process table: ``| NPU Chip | Process id | Process name | Process memory(MB) |``,
  with ``No running processes found in NPU N`` for an idle NPU.

`parse_npu_smi` is sans-io and tolerant: cells are split on ``|``, numbers are read with
patterns, and a row it cannot read is counted in `NpuSmiInfo.unparsed`, never guessed.
Memory is printed in "MB"; like other Ascend tools we take that as MiB (2^20 bytes), and
the source names the column. Memory used/total is the HBM pair when present, else the
Memory-Usage pair. A chip whose NPU has neither process rows nor a "No running
processes" line has an unknown process list (a problem), not an empty one.

`AscendBackend` runs the command (found on PATH or in the driver's install locations) with
a timeout; no command, a failing one, or output without a device table make a failed
probe with the reason; it is a `gpusource.GpuSource` whose samples have backend
``ascend``. `append_npus` adds the NPUs to another Linux sample (NVML + DRM, in
`linux.LinuxGpus`): appended, so no index moves. Not validated on Ascend hardware.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from gputaskman.backends.drm_fdinfo import pci_bus_id
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, DeviceMetrics, Problem, Reading, Reason

BACKEND: Final = "ascend"
MIB: Final = 1024**2
SEARCH: Final = ("/usr/local/sbin/npu-smi", "/usr/local/bin/npu-smi", "/usr/bin/npu-smi")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")
_NUM = r"[-+]?\d+(?:\.\d+)?"
_IDLE = re.compile(r"No running processes found in NPU\s+(\d+)", re.IGNORECASE)
_BUS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


@dataclass(frozen=True, slots=True)
class Chip:
    npu: int
    chip: int
    name: str
    health: str
    bus_id: str | None  # as printed (None for "NA")
    phy_id: int | None = None
    power_w: float | None = None
    temp_c: int | None = None
    aicore_percent: float | None = None
    memory_mb: tuple[int, int] | None = None  # (used, total)
    hbm_mb: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class NpuProcess:
    npu: int
    chip: int
    pid: int
    name: str
    memory_mb: int


@dataclass(slots=True)
class NpuSmiInfo:
    version: str | None = None
    chips: list[Chip] = field(default_factory=list)
    processes: list[NpuProcess] = field(default_factory=list)
    idle_npus: set[int] = field(default_factory=set)
    has_device_table: bool = False
    has_process_table: bool = False
    unparsed: int = 0


def _cells(line: str) -> list[str] | None:
    s = line.strip()
    if not s.startswith("|"):
        return None
    return [c.strip() for c in s.strip("|").split("|")]


def _float(tok: str) -> float | None:
    return float(tok) if re.fullmatch(_NUM, tok) else None


def parse_npu_smi(text: str) -> NpuSmiInfo:
    """Both tables of ``npu-smi info`` output. Pure: never raises on bad input."""
    info = NpuSmiInfo()
    section = None  # "devices" | "processes"
    first: list[str] | None = None  # the first row of a chip's pair
    for line in text.splitlines():
        if "npu-smi" in line.lower() and info.version is None:
            m = re.search(r"Version:\s*(\S+)", line)
            info.version = m[1] if m else None
        cells = _cells(line)
        if cells is None:
            continue
        joined = " ".join(cells)
        if "Process id" in joined:
            section, first, info.has_process_table = "processes", None, True
            continue
        if cells[0].startswith("NPU") and "Health" in joined:
            section, first, info.has_device_table = "devices", None, True
            continue
        if cells[0].startswith("Chip") and "Bus-Id" in joined:
            continue  # second header row
        idle = _IDLE.search(joined)
        if idle:
            info.idle_npus.add(int(idle[1]))
            continue
        if section == "devices":
            if first is None:
                first = cells
                continue
            chip = _chip(first, cells)
            first = None
            if chip is None:
                info.unparsed += 1
            else:
                info.chips.append(chip)
        elif section == "processes":
            p = _process(cells)
            if p is None:
                info.unparsed += 1
            else:
                info.processes.append(p)
    if first is not None:
        info.unparsed += 1  # a chip's first row without its second
    return info


def _chip(a: list[str], b: list[str]) -> Chip | None:
    if len(a) < 3 or len(b) < 3:
        return None
    head = a[0].split(None, 1)
    ids = b[0].split()
    if len(head) != 2 or not head[0].isdigit() or not ids or not all(i.isdigit() for i in ids):
        return None
    pairs = [(int(x), int(y)) for x, y in _PAIR.findall(b[2])]
    # A chip's second row has a Bus-Id and its memory "used / total"; a process row (a PID,
    # a name) that follows a lone first row when lines are missing must not pass for one.
    if b[1].strip().isdigit() or not pairs:
        return None
    tokens = a[2].split()
    power = _float(tokens[0]) if tokens else None
    temp = _float(tokens[1]) if len(tokens) > 1 else None
    aicore_tok = b[2].split()[0] if b[2].split() else ""
    bus = b[1] if _BUS.match(b[1]) else None
    return Chip(
        npu=int(head[0]),
        chip=int(ids[0]),
        name=head[1].strip(),
        health=a[1],
        bus_id=bus,
        phy_id=int(ids[1]) if len(ids) > 1 else None,
        power_w=power,
        temp_c=int(temp) if temp is not None else None,
        aicore_percent=_float(aicore_tok),
        memory_mb=pairs[0] if pairs else None,
        hbm_mb=pairs[1] if len(pairs) > 1 else None,
    )


def _process(cells: list[str]) -> NpuProcess | None:
    if len(cells) < 4:
        return None
    ids = cells[0].split()
    if len(ids) != 2 or not all(i.isdigit() for i in ids):
        return None
    if not cells[1].isdigit() or not re.fullmatch(r"\d+", cells[3]):
        return None
    return NpuProcess(int(ids[0]), int(ids[1]), int(cells[1]), cells[2], int(cells[3]))


def chip_key(c: Chip) -> str:
    """The pairing key: NVML-style PCI address, or a stable name when npu-smi says NA."""
    key = pci_bus_id(c.bus_id)
    return key if key is not None else f"ascend:npu{c.npu}-chip{c.chip}"


def to_sample(info: NpuSmiInfo, start_index: int = 0) -> GpuSample:
    """The contract's types from one parse."""
    if not info.has_device_table:
        return GpuSample.failed(
            BACKEND, "backend.init", Reason.QUERY_FAILED, "npu-smi printed no device table"
        )
    adapters: list[Adapter] = []
    metrics: dict[str, DeviceMetrics] = {}
    by_chip: dict[tuple[int, int], str] = {}
    problems: list[Problem] = []
    for c in info.chips:
        key = chip_key(c)
        if key in metrics:
            problems.append(Problem("device", Reason.QUERY_FAILED, f"{key} listed twice"))
            continue
        by_chip[(c.npu, c.chip)] = key
        adapters.append(Adapter(start_index + len(adapters), "huawei", c.name, None, key, BACKEND))
        metrics[key] = _metrics(c)
    procs: list[GpuProcess] = []
    src = "npu-smi:Process memory(MB)"
    for p in info.processes:
        where = by_chip.get((p.npu, p.chip))
        if where is None:
            problems.append(
                Problem(
                    "processes.npu-smi",
                    Reason.QUERY_FAILED,
                    f"process {p.pid} on NPU {p.npu} chip {p.chip}, which the device table "
                    "does not list",
                )
            )
            continue
        procs.append(
            GpuProcess(
                pid=p.pid,
                adapter=where,
                contexts=("npu",),
                dedicated=Reading.measured(p.memory_mb * MIB, src),
                name=p.name or None,
            )
        )
    listed = {p.npu for p in info.processes} | info.idle_npus
    for c in info.chips:
        if c.npu not in listed:
            why = (
                "npu-smi printed no process table"
                if not info.has_process_table
                else f"the process table says nothing about NPU {c.npu}"
            )
            problems.append(Problem("processes.npu-smi", Reason.UNAVAILABLE, why, chip_key(c)))
    notes = (f"npu-smi: {info.unparsed} rows not understood",) if info.unparsed else ()
    return GpuSample(
        BACKEND,
        tuple(adapters),
        metrics,
        tuple(procs),
        tuple(problems),
        driver_version=info.version,
        notes=notes,
    )


def _metrics(c: Chip) -> DeviceMetrics:
    pair, col = (
        (c.hbm_mb, "HBM-Usage(MB)") if c.hbm_mb is not None else (c.memory_mb, "Memory-Usage(MB)")
    )
    src = f"npu-smi:{col}"
    if pair is None:
        used = total = Reading.missing(Reason.UNAVAILABLE, src, "no memory column")
    else:
        used, total = Reading.measured(pair[0] * MIB, src), Reading.measured(pair[1] * MIB, src)
    power = (
        Reading.measured(c.power_w, "npu-smi:Power(W)")
        if c.power_w is not None
        else Reading.missing(
            Reason.NOT_SUPPORTED, "npu-smi:Power(W)", "printed as '-' for this chip"
        )
    )
    temp = (
        Reading.measured(c.temp_c, "npu-smi:Temp(C)")
        if c.temp_c is not None
        else Reading.missing(Reason.UNAVAILABLE, "npu-smi:Temp(C)", "not a number")
    )
    util = (
        Reading.measured(c.aicore_percent, "npu-smi:AICore(%)")
        if c.aicore_percent is not None
        else Reading.missing(Reason.UNAVAILABLE, "npu-smi:AICore(%)", "not a number")
    )
    return DeviceMetrics.partial(
        "npu-smi info",
        "not printed",
        memory_total_bytes=total,
        memory_used_bytes=used,
        util_gpu_percent=util,
        temperature_c=temp,
        power_w=power,
    )


def find_npu_smi(which: Callable[[str], str | None] = shutil.which) -> str | None:
    found = which("npu-smi")
    if found:
        return found
    return next((p for p in SEARCH if os.access(p, os.X_OK)), None)


class AscendBackend(GpuSource):
    """Runs ``npu-smi info`` each sample. `command` overrides the program (tests)."""

    def __init__(self, command: Sequence[str] | None = None, timeout: float = 10.0) -> None:
        self.command = list(command) if command is not None else None
        self.timeout = timeout

    def close(self) -> None:
        pass

    def available(self) -> bool:
        return self.command is not None or find_npu_smi() is not None

    def sample(self, start_index: int = 0) -> GpuSample:
        cmd = self.command
        if cmd is None:
            exe = find_npu_smi()
            if exe is None:
                return GpuSample.failed(
                    BACKEND,
                    "backend.init",
                    Reason.NO_LIBRARY,
                    "npu-smi not found (no Ascend driver installed)",
                )
            cmd = [exe, "info"]
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=self.timeout, check=False)
        except FileNotFoundError as exc:
            return GpuSample.failed(BACKEND, "backend.init", Reason.NO_LIBRARY, str(exc))
        except subprocess.TimeoutExpired:
            return GpuSample.failed(
                BACKEND,
                "backend.init",
                Reason.QUERY_FAILED,
                f"npu-smi did not answer within {self.timeout:g}s",
            )
        except OSError as exc:
            return GpuSample.failed(BACKEND, "backend.init", Reason.QUERY_FAILED, str(exc))
        out = r.stdout.decode("utf-8", "replace")
        if r.returncode != 0:
            # the error text: stderr's last line, else stdout's (npu-smi prints to both)
            err = r.stderr.decode("utf-8", "replace").strip().splitlines()
            lines = err or out.strip().splitlines()
            tail = lines[-1].strip() if lines else ""
            detail = f"npu-smi exited with {r.returncode}: {tail}".rstrip(": ")
            return GpuSample.failed(BACKEND, "backend.init", Reason.QUERY_FAILED, detail)
        return to_sample(parse_npu_smi(out), start_index)


def append_npus(base: GpuSample, npus: GpuSample, indices: dict[str, int]) -> GpuSample:
    """`base` (another Linux source's sample) with the NPUs of `npus` appended after its
    adapters. `indices` (bus id -> index) is the caller's, kept across samples, so an NPU
    keeps its index and no other adapter's moves. When `base` is unusable (no NVML) but
    NPUs answer, the result is usable and `base`'s problem stays listed; when the NPUs
    failed or there are none, `base` is returned as it is."""
    if npus.backend_problem is not None or not npus.adapters:
        return base
    taken = {x.index for x in base.adapters}
    adapters = list(base.adapters)
    for x in npus.adapters:
        if x.pci_bus_id not in indices:
            used = taken | set(indices.values())
            indices[x.pci_bus_id] = max(used, default=-1) + 1
        adapters.append(dataclasses.replace(x, index=indices[x.pci_bus_id]))
    metrics = dict(base.metrics)
    metrics.update(npus.metrics)
    return dataclasses.replace(
        base,
        adapters=tuple(adapters),
        metrics=metrics,
        processes=base.processes + npus.processes,
        problems=base.problems + npus.problems,
        backend_problem=None,
    )
