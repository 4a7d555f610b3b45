"""A fixed, synthetic snapshot for tests, layout snapshots and screenshots.

Nothing here was measured: it is hand-written data that exercises every case the UI and
the JSON must handle (measured zero, memory hidden by the driver, a failed process list, a
counter the device does not support, an inferred value, a CPU-only runtime candidate).
`DemoSystem` stands in for host.py's sample with the same duck-typed surface the report
uses (`to_json_dict`, `process_readings`, `render_lines`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputaskman.model import (
    Adapter,
    DeviceMetrics,
    ModelRef,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)

GIB = 1024**3
MIB = 1024**2
BUS0 = "00000000:01:00.0"
BUS1 = "00000000:41:00.0"
TAKEN = 1796000000.0  # fixed so rendered output is stable


def _m(v: int | float, api: str) -> Reading:
    return Reading.measured(v, f"nvml:{api}")


def _metrics(total: int, used: int, util: int, enc: Reading) -> DeviceMetrics:
    return DeviceMetrics(
        memory_total_bytes=_m(total, "nvmlDeviceGetMemoryInfo"),
        memory_used_bytes=_m(used, "nvmlDeviceGetMemoryInfo"),
        memory_reserved_bytes=_m(300 * MIB, "nvmlDeviceGetMemoryInfo"),
        util_gpu_percent=_m(util, "nvmlDeviceGetUtilizationRates"),
        util_memory_percent=_m(util // 2, "nvmlDeviceGetUtilizationRates"),
        encoder_percent=enc,
        decoder_percent=_m(0, "nvmlDeviceGetDecoderUtilization"),
        temperature_c=_m(61, "nvmlDeviceGetTemperature"),
        power_w=_m(182.5, "nvmlDeviceGetPowerUsage"),
        power_limit_w=_m(320.0, "nvmlDeviceGetEnforcedPowerLimit"),
        clock_graphics_mhz=_m(2520, "nvmlDeviceGetClockInfo"),
        clock_sm_mhz=_m(2520, "nvmlDeviceGetClockInfo"),
        clock_memory_mhz=_m(10501, "nvmlDeviceGetClockInfo"),
    )


def demo_snapshot() -> Snapshot:
    a0 = Adapter(0, "nvidia", "NVIDIA GeForce RTX 4080 SUPER", "GPU-demo-0", BUS0, "nvml")
    a1 = Adapter(1, "nvidia", "NVIDIA RTX A4000", "GPU-demo-1", BUS1, "nvml")
    unsupported = Reading.missing(
        Reason.NOT_SUPPORTED, "nvml:nvmlDeviceGetEncoderUtilization", "Not Supported"
    )
    procs = (
        ProcGpu(
            4242,
            TAKEN - 3600,
            "llama-server",
            BUS0,
            ("compute",),
            _m(9 * GIB + 512 * MIB, "nvmlDeviceGetComputeRunningProcesses"),
            engines={"gpu_percent": _m(87, "nvmlDeviceGetProcessUtilization")},
            detail=ProcDetail(
                cmdline=(
                    "llama-server",
                    "-m",
                    "/models/qwen2.5-7b-q4_k_m.gguf",
                    "--api-key",
                    "***",
                ),
                runtimes=("CUDA runtime", "cuBLAS", "ggml-cuda"),
                model_files=("/models/qwen2.5-7b-q4_k_m.gguf",),
                category="LLM inference",
                scanned=True,
            ),
            model=ModelRef("qwen2.5-7b-q4_k_m", "mapped", False, "/models/qwen2.5-7b-q4_k_m.gguf"),
        ),
        ProcGpu(
            5151,
            TAKEN - 120,
            "python3",
            BUS0,
            ("compute",),
            Reading.missing(
                Reason.HIDDEN,
                "nvml:nvmlDeviceGetComputeRunningProcesses",
                "usedGpuMemory not available (container or permissions)",
            ),
            inferred=Reading.inferred(2 * GIB, "demo:rule"),
            detail=ProcDetail(
                runtimes=("CUDA runtime", "PyTorch"), category="training", scanned=True
            ),
        ),
        ProcGpu(
            777,
            TAKEN - 86400,
            "Xorg",
            BUS0,
            ("graphics",),
            _m(0, "nvmlDeviceGetGraphicsRunningProcesses"),
            detail=ProcDetail(category="compositor", scanned=False),
        ),
        ProcGpu(
            9001,
            TAKEN - 30,
            "whisper",
            BUS1,
            ("compute",),
            _m(1536 * MIB, "nvmlDeviceGetComputeRunningProcesses"),
            detail=ProcDetail(
                runtimes=("CUDA runtime", "ONNX Runtime"), category="speech", scanned=True
            ),
        ),
        ProcGpu(
            3131,
            TAKEN - 5,
            "llama-cli",
            None,
            (),
            Reading.missing(
                Reason.NOT_LISTED, "nvml:running processes", "no GPU context on any adapter"
            ),
            detail=ProcDetail(
                runtimes=("ggml-cpu",),
                model_files=("/tmp/tiny.gguf",),
                category="LLM inference",
                scanned=True,
            ),
        ),
    )
    return Snapshot(
        taken=TAKEN,
        backend="nvml",
        adapters=(a0, a1),
        metrics={
            BUS0: _metrics(16 * GIB, 12 * GIB, 91, unsupported),
            BUS1: _metrics(16 * GIB, 2 * GIB, 12, _m(0, "nvmlDeviceGetEncoderUtilization")),
        },
        processes=procs,
        problems=(Problem("processes.graphics", Reason.QUERY_FAILED, "Unknown Error", BUS1),),
        notes=("demo data: synthetic, not measured",),
        driver_version="550.54.14",
    )


def unavailable_snapshot() -> Snapshot:
    """What the NVML backend reports on a machine without the library."""
    p = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
    return Snapshot(taken=TAKEN, backend="nvml", problems=(p,), backend_problem=p)


class DemoSystem:
    """Fixed host sample (RAM, swap, CPU) with per-process readings for the demo PIDs."""

    def to_json_dict(self) -> dict[str, Any]:
        """The shape `host.SystemInfo` writes (report.py's SYSTEM), with fixed numbers."""
        return {
            "taken": TAKEN,
            "kind": "measured",
            "memory": {
                "total_bytes": _host(32 * GIB),
                "available_bytes": _host(20 * GIB),
                "used_bytes": _host(12 * GIB),
            },
            "swap": {
                "total_bytes": _host(8 * GIB),
                "free_bytes": _host(8 * GIB),
                "used_bytes": _host(0),
                "devices": [
                    {
                        "filename": "/dev/zram0",
                        "type": "partition",
                        "size_bytes": _host(8 * GIB),
                        "used_bytes": _host(0),
                        "priority": _host(100),
                        "deleted": False,
                    }
                ],
                "devices_reason": None,
                "problems": [],
            },
            "cpu": {"percent": _host(37.5), "logical_cpus": _host(16)},
        }

    def render_lines(self) -> list[str]:
        return ["ram 12.0 GiB used / 32.0 GiB", "swap /dev/zram0 0 B / 8.0 GiB", "cpu 37.5%"]

    def process_readings(self, pid: int, create_time: float | None) -> Mapping[str, Reading]:
        table = {4242: (6 * GIB, 112.0), 5151: (3 * GIB, 99.5), 777: (180 * MIB, 1.0)}
        if pid not in table:
            return {}
        ram, cpu = table[pid]
        return {
            "ram_bytes": Reading.measured(ram, "procfs"),
            "cpu_percent": Reading.measured(cpu, "procfs"),
        }


def _host(v: int | float) -> dict[str, Any]:
    return {"value": v, "kind": "measured", "source": "procfs", "reason": None, "detail": None}
