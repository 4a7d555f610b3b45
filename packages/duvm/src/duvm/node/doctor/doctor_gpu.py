"""`duvm doctor`'s checks for a node that runs GPU work: whether the NVIDIA driver has HMM
(heterogeneous memory management) active, read through NVML, and how much RAM processes keep
locked or pinned, which the pool can never hold.

Why these two (packages/duvm/README.md, "GPU workloads", has the sources): the kernel swaps
only ordinary pageable pages. Memory a GPU driver allocates or pins for the device (cudaMalloc,
cudaMallocManaged, cudaHostAlloc, cudaHostRegister, ``pin_memory=True``, RDMA registrations)
stays in RAM whatever the pool has room for. With HMM a GPU kernel reads
ordinary ``malloc``/NumPy/PyTorch CPU memory through the CPU's page tables, so that memory stays
pageable and its pages on the host can go to the pool.

The HMM check asks NVML's ``nvmlDeviceGetAddressingMode`` (NVML of the R580 drivers and later)
for each GPU. libnvidia-ml is loaded with ctypes only when present: duvm never depends on it,
and a node without an NVIDIA driver has the check skipped, not failed. What NVML is, is a
parameter (`check_gpu_hmm`'s ``load``), so tests hand it a fake library object. The pinned
check sums ``VmLck`` and ``VmPin`` of every process in ``/proc/*/status``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from duvm.node.doctor.doctor_check import OK, SKIP, WARN, Check

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERRORS = {
    1: "uninitialized",
    2: "invalid argument",
    3: "not supported",
    4: "no permission",
    9: "driver not loaded",
    13: "function not found",
    15: "GPU is lost",
    25: "struct version mismatch",
    999: "unknown error",
}
# nvmlDeviceAddressingModeType_t
ADDRESSING_NONE, ADDRESSING_HMM, ADDRESSING_ATS = 0, 1, 2
_MODE_NAMES = {ADDRESSING_NONE: "none", ADDRESSING_HMM: "HMM", ADDRESSING_ATS: "ATS"}
# nvmlDeviceAddressingMode_v1 = NVML_STRUCT_VERSION(DeviceAddressingMode, 1): the struct's size
# (two unsigned ints) with the version number in the top byte
ADDRESSING_MODE_V1 = 8 | (1 << 24)

HMM_FIX = (
    "for GPU kernels to read pageable memory (which the pool can hold), HMM needs: the NVIDIA "
    "open kernel modules (535 or later), a kernel built with CONFIG_DEVICE_PRIVATE (6.1.24+, "
    "6.2.11+ or 6.3+), a Turing or newer GPU, and nvidia_uvm loaded without uvm_disable_hmm=1"
)
PINNED_WARN_SHARE = 0.25  # of MemTotal
KERNEL_CONFIG = Path(f"/boot/config-{os.uname().release}")


class AddressingMode(ctypes.Structure):
    """nvmlDeviceAddressingMode_v1_t."""

    _fields_ = [("version", ctypes.c_uint), ("value", ctypes.c_uint)]


def load_nvml(name: str = NVML_LIBRARY) -> Any:
    """The NVML library, or None where it cannot be loaded (no NVIDIA driver)."""
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


class NvmlError(Exception):
    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call}: {_NVML_ERRORS.get(code, 'error')} ({code})")
        self.code = code


@dataclass
class GpuModes:
    """What NVML said: the driver version and each GPU's addressing mode (None: the call is
    missing from this driver; an int from NVML, or a string saying why there is none)."""

    driver: str | None = None
    has_call: bool = True
    modes: list[int | str] = field(default_factory=list)


def read_modes(lib: Any) -> GpuModes:
    """Ask NVML for each GPU's addressing mode (NvmlError when NVML cannot start)."""
    rc = lib.nvmlInit_v2()
    if rc != NVML_SUCCESS:
        raise NvmlError("nvmlInit_v2", rc)
    out = GpuModes()
    try:
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(len(buf))) == NVML_SUCCESS:
            out.driver = buf.value.decode("ascii", "replace") or None
        count = ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetCount_v2(ctypes.pointer(count))
        if rc != NVML_SUCCESS:
            raise NvmlError("nvmlDeviceGetCount_v2", rc)
        try:
            get_mode = lib.nvmlDeviceGetAddressingMode
        except AttributeError:  # a driver older than the call
            out.has_call = False
            get_mode = None
        for index in range(count.value):
            handle = ctypes.c_void_p()
            rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.pointer(handle))
            if rc != NVML_SUCCESS:
                out.modes.append(str(NvmlError("nvmlDeviceGetHandleByIndex_v2", rc)))
                continue
            if get_mode is None:
                continue
            mode = AddressingMode(version=ADDRESSING_MODE_V1, value=ADDRESSING_NONE)
            rc = get_mode(handle, ctypes.pointer(mode))
            out.modes.append(
                int(mode.value)
                if rc == NVML_SUCCESS
                else str(NvmlError("nvmlDeviceGetAddressingMode", rc))
            )
    finally:
        lib.nvmlShutdown()
    if not out.has_call:
        out.modes = []
    return out


def _read(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def why_no_hmm(sys_module: Path, driver_file: Path, kernel_config: Path | None) -> list[str]:
    """What this node shows of HMM's prerequisites that is missing or turned off."""
    why = []
    flag = _read(sys_module / "nvidia_uvm" / "parameters" / "uvm_disable_hmm")
    if flag is not None and flag.strip().upper() in ("Y", "1"):
        why.append("nvidia_uvm was loaded with uvm_disable_hmm=1")
    version = _read(driver_file)
    if version is not None and "Open Kernel Module" not in version:
        why.append("the driver runs the proprietary kernel modules, not the open ones")
    config = _read(kernel_config)
    if config is not None and "CONFIG_DEVICE_PRIVATE=y" not in config:
        why.append(f"{kernel_config} has no CONFIG_DEVICE_PRIVATE=y")
    return why


def check_gpu_hmm(
    load: Callable[[], Any] = load_nvml,
    sys_module: Path = Path("/sys/module"),
    driver_file: Path = Path("/proc/driver/nvidia/version"),
    kernel_config: Path | None = KERNEL_CONFIG,
) -> Check:
    """Whether HMM is active on this node's NVIDIA GPUs, as the driver reports it."""
    name = "gpu-hmm"
    lib = load()
    if lib is None:
        return Check(name, SKIP, False, f"no NVIDIA driver here ({NVML_LIBRARY} cannot be loaded)")
    try:
        got = read_modes(lib)
    except NvmlError as exc:
        if exc.code == NVML_ERROR_DRIVER_NOT_LOADED:
            return Check(name, SKIP, False, "the NVIDIA kernel driver is not loaded")
        return Check(name, WARN, False, f"NVML did not answer: {exc}", "check nvidia-smi")
    except (AttributeError, OSError, ValueError) as exc:  # a library that is not NVML
        return Check(name, WARN, False, f"{NVML_LIBRARY} is not usable: {exc}")
    driver = f"driver {got.driver or 'n/a'}"
    why = why_no_hmm(sys_module, driver_file, kernel_config)
    because = f" ({'; '.join(why)})" if why else ""
    if not got.has_call:
        return Check(
            name,
            WARN,
            False,
            f"{driver}: its NVML has no nvmlDeviceGetAddressingMode (added with the R580 "
            f"drivers), so whether HMM is active is not known{because}",
            "upgrade to an R580 or newer driver to have HMM reported; " + HMM_FIX,
        )
    if not got.modes:
        return Check(name, SKIP, False, f"{driver}, no NVIDIA GPU")
    by_mode: dict[str, list[str]] = {}
    for index, mode in enumerate(got.modes):
        key = _MODE_NAMES.get(mode, f"mode {mode}") if isinstance(mode, int) else mode
        by_mode.setdefault(key, []).append(str(index))
    seen = "; ".join(f"GPU {','.join(ids)}: {key}" for key, ids in by_mode.items())
    if set(by_mode) <= {"HMM", "ATS"}:
        return Check(
            name,
            OK,
            False,
            f"{driver}, addressing mode {seen}: GPU kernels read ordinary pageable memory, "
            "and its pages on the host can go to the pool",
        )
    if "none" in by_mode:
        return Check(
            name,
            WARN,
            False,
            f"{driver}, addressing mode {seen}: without HMM a GPU reaches only memory the "
            "driver allocates or pins (cudaMalloc, cudaMallocManaged, pinned buffers), none of "
            f"which the pool can hold; pageable buffers that are copied still swap{because}",
            HMM_FIX,
        )
    return Check(name, WARN, False, f"{driver}, addressing mode not known: {seen}{because}")


# --- locked and pinned memory ------------------------------------------------------------------


def parse_status(text: str) -> tuple[str, int]:
    """/proc/PID/status -> (Name, VmLck + VmPin in bytes); absent lines count 0."""
    name, total = "", 0
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == "Name":
            name = rest.strip()
        elif key in ("VmLck", "VmPin"):
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB" and parts[0].isascii() and parts[0].isdigit():
                total += int(parts[0]) * 1024
    return name, total


def locked_by_process(proc: Path = Path("/proc")) -> list[tuple[int, str, int]]:
    """(pid, name, locked + pinned bytes) of every process holding some, largest first."""
    out = []
    try:
        entries = list(proc.iterdir())
    except OSError:
        return out
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            name, held = parse_status((entry / "status").read_text(errors="replace"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if held:
            out.append((int(entry.name), name, held))
    return sorted(out, key=lambda e: -e[2])


def mem_total(meminfo: Path) -> int | None:
    text = _read(meminfo) or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "MemTotal:" and parts[1].isdigit():
            return int(parts[1]) * 1024
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def check_pinned(
    proc: Path = Path("/proc"),
    meminfo: Path = Path("/proc/meminfo"),
    max_share: float = PINNED_WARN_SHARE,
) -> Check:
    """Is much of RAM locked or pinned? Such pages never go to the pool."""
    name = "pinned-memory"
    total = mem_total(meminfo)
    if total is None:
        return Check(name, SKIP, False, f"cannot read MemTotal from {meminfo}")
    procs = locked_by_process(proc)
    held = sum(e[2] for e in procs)
    share = held / total
    what = (
        f"{_mib(held)} ({100 * share:.0f} % of {_mib(total)} RAM) is locked or pinned "
        "(VmLck + VmPin of every process)"
    )
    if share <= max_share:
        return Check(name, OK, False, what)
    largest = ", ".join(f"{n or '?'} (pid {pid}) {_mib(b)}" for pid, n, b in procs[:3])
    return Check(
        name,
        WARN,
        False,
        f"{what}, over {100 * max_share:.0f} %: the pool can relieve only the rest; "
        f"largest: {largest}",
        "if not meant: pin fewer buffers (PyTorch: DataLoader(pin_memory=False), no "
        ".pin_memory() on large tensors), or lower those processes' memlock limit "
        "(ulimit -l, systemd LimitMEMLOCK=)",
    )
