"""Synthetic snapshots with mocked NVML-like GPU values (this machine has no GPU).

Nothing here was measured. The snapshots are built from the real model classes and turned
into ``--json`` objects by the real `report.to_json_dict`, so record, replay, diff and
summary tests read exactly the shape `gputaskman record` writes; only the GPU numbers are
made up. Loaded by the offline-tool tests with `load_helper` (tests are not a package).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.offline.record import encode_line
from gputaskman.render import report

GIB = 1024**3
MIB = 1024**2
BUS0 = "00000000:01:00.0"
BUS1 = "00000000:41:00.0"
T0 = 1796000000.0
SRC = "nvml:mocked"


def load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def r(v: int | float | None, reason: Reason = Reason.UNAVAILABLE) -> Reading:
    """Measured when `v` is a number, else missing with `reason`."""
    return Reading.measured(v, SRC) if v is not None else Reading.missing(reason, SRC)


def adapter(
    index: int = 0,
    bus: str = BUS0,
    name: str | None = "NVIDIA Mock GPU",
    vendor: str = "nvidia",
    uuid: str | None = None,
) -> Adapter:
    return Adapter(
        index, vendor, name, uuid if uuid is not None else f"GPU-mock-{bus}", bus, "nvml"
    )


def metrics(
    used: int | None = 4 * GIB,
    total: int | None = 16 * GIB,
    util: float | None = 50,
    power: float | None = 100.0,
    reserved: int | None = 300 * MIB,
    kind_used: str = "measured",
) -> DeviceMetrics:
    used_r = r(used)
    if kind_used == "inferred" and used is not None:
        used_r = Reading.inferred(used, "mock:rule")
    return DeviceMetrics(
        memory_total_bytes=r(total),
        memory_used_bytes=used_r,
        memory_reserved_bytes=r(reserved),
        util_gpu_percent=r(util),
        util_memory_percent=r(util),
        encoder_percent=r(None, Reason.NOT_SUPPORTED),
        decoder_percent=r(0),
        temperature_c=r(60),
        power_w=r(power),
        power_limit_w=r(300.0),
        clock_graphics_mhz=r(1800),
        clock_sm_mhz=r(1800),
        clock_memory_mhz=r(9000),
    )


def proc(
    pid: int,
    vram: int | None,
    *,
    start: float | None = T0 - 100,
    name: str | None = "llama-server",
    bus: str | None = BUS0,
    reason: Reason = Reason.HIDDEN,
    inferred: int | None = None,
) -> ProcGpu:
    return ProcGpu(
        pid,
        start,
        name,
        bus,
        ("compute",) if bus else (),
        r(vram, reason),
        inferred=None if inferred is None else Reading.inferred(inferred, "mock:rule"),
        detail=ProcDetail(runtimes=("CUDA runtime",), scanned=True),
    )


def snapshot(
    taken: float = T0,
    *,
    adapters: Iterable[Adapter] | None = None,
    metrics_by_bus: dict[str, DeviceMetrics] | None = None,
    procs: Iterable[ProcGpu] = (),
    backend: str = "nvml",
    unavailable: Reason | None = None,
) -> Snapshot:
    if unavailable is not None:
        p = Problem("backend.init", unavailable, "mocked failure")
        return Snapshot(taken, backend, problems=(p,), backend_problem=p)
    ads = tuple(adapters) if adapters is not None else (adapter(),)
    if metrics_by_bus is None:
        metrics_by_bus = {a.pci_bus_id: metrics() for a in ads}
    return Snapshot(
        taken,
        backend,
        adapters=ads,
        metrics=metrics_by_bus,
        processes=tuple(procs),
        driver_version="550.00",
    )


def doc(snap: Snapshot, system: object | None = None, gpu: int | None = None) -> dict[str, Any]:
    """The ``--json`` object, through a JSON round trip like a file."""
    return json.loads(json.dumps(report.to_json_dict(snap, system, gpu)))


def write_record(path: Path, docs: Iterable[dict[str, Any] | bytes | str]) -> Path:
    """A record file with one line per doc (bytes/str are written raw, for bad lines)."""
    with open(path, "ab") as f:
        for d in docs:
            if isinstance(d, dict):
                f.write(encode_line(d))
            elif isinstance(d, str):
                f.write(d.encode())
            else:
                f.write(d)
    return path


def save(path: Path, d: dict[str, Any]) -> Path:
    """A saved snapshot as ``gputaskman --json > FILE`` writes it (indented)."""
    path.write_text(json.dumps(d, indent=2) + "\n")
    return path
