"""The one place a GPU backend is chosen and built: `REGISTRY` names each backend and the
function that builds it, `detect_backend` picks one from facts about the running system, and
`gpu_source` builds the one asked for (default: this machine's, `BACKEND`).

Theory of operation
-------------------
The backend is chosen once, at import, from facts about the running system: ``wddm`` on
Windows, ``metal`` on macOS, ``wsl`` on Linux under WSL (the kernel release names Microsoft,
or ``WSL_DISTRO_NAME`` is set) and ``nvml`` elsewhere. `detect_backend` takes those facts as
arguments so tests decide them; `current_backend` reads them from the running process.

Each entry of `REGISTRY` builds its source *lazily*: platform modules (and through them
``ctypes.windll``, IOKit, PDH) are imported only when that entry is built, so every module of
the package imports cleanly on every platform (tests/test_platform_imports.py checks this on
Linux). ``nvml`` on Linux is `linux.LinuxGpus`: NVML for NVIDIA plus DRM sysfs/fdinfo for
amdgpu, i915 and xe, merged by PCI address, with Huawei Ascend NPUs appended when ``npu-smi``
is installed; on other systems it is NVML alone. `sysroot_gpu_source` is the one source not
chosen by platform: the DRM cards of a fixture tree (``--sysroot``). Every backend returns the
same `base.gpusource.GpuSample`; to add one, write its module and add an entry here.

Nothing here is validated on Windows, WSL or macOS hardware; see `PLATFORM_TABLE`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Final

from gputaskman.base.gpusource import GpuSource


def _wddm() -> GpuSource:
    from gputaskman.backends.win.backend import WddmBackend

    return WddmBackend()


def _wsl() -> GpuSource:
    from gputaskman.backends.wsl import WslBackend

    return WslBackend()


def _metal() -> GpuSource:
    from gputaskman.backends.macos import MacCounters

    return MacCounters()


def _nvml() -> GpuSource:
    from gputaskman.backends.nvml import NvmlBackend

    if not sys.platform.startswith("linux"):
        return NvmlBackend()
    from gputaskman.backends.ascend import AscendBackend
    from gputaskman.backends.drm import DrmBackend
    from gputaskman.backends.linux import LinuxGpus

    npu = AscendBackend()
    return LinuxGpus(NvmlBackend(), DrmBackend(), npu if npu.available() else None)


#: Backend name -> the function that builds its source (importing its platform module only
#: then). `detect_backend` returns one of these names.
REGISTRY: Final[Mapping[str, Callable[[], GpuSource]]] = {
    "wddm": _wddm,
    "nvml": _nvml,
    "wsl": _wsl,
    "metal": _metal,
}
BACKENDS: Final = tuple(REGISTRY)


def is_wsl(kernel_release: str, environ: Mapping[str, str]) -> bool:
    """WSL 1 and 2 kernels name Microsoft in their release; WSL also sets WSL_DISTRO_NAME."""
    return "microsoft" in kernel_release.lower() or bool(environ.get("WSL_DISTRO_NAME"))


def detect_backend(sys_platform: str, kernel_release: str, environ: Mapping[str, str]) -> str:
    """``wddm``, ``metal``, ``wsl`` or ``nvml`` for the given platform facts."""
    if sys_platform.startswith(("win32", "cygwin")):
        return "wddm"
    if sys_platform == "darwin":
        return "metal"
    if sys_platform.startswith("linux") and is_wsl(kernel_release, environ):
        return "wsl"
    return "nvml"


def current_backend() -> str:
    """`detect_backend` for this process (`BACKEND` holds it, read once at import)."""
    return detect_backend(sys.platform, platform.release(), os.environ)


#: This machine's backend, chosen once from platform facts. The collector reports "drm" or
#: "ascend" instead when the selected GPU is an amdgpu or Intel card or an Ascend NPU (see
#: `linux.LinuxGpus.backend_for`).
BACKEND: Final = current_backend()


def gpu_source(backend: str | None = None) -> GpuSource:
    """A new source for `backend` (default `BACKEND`), built by its `REGISTRY` entry."""
    name = BACKEND if backend is None else backend
    build = REGISTRY.get(name)
    if build is None:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    return build()


def sysroot_gpu_source(root: str) -> GpuSource:
    """DRM cards under ``root/sys`` and ``root/proc``; NVML is not asked (``--sysroot``)."""
    from gputaskman.backends.drm import DrmBackend
    from gputaskman.backends.linux import LinuxGpus, NotAsked

    nvml = NotAsked("nvml", f"NVML not asked: reading the tree under --sysroot {root}")
    return LinuxGpus(nvml, DrmBackend(root))


#: The README's platform table: (platform, backend, what it measures, validated on hardware).
PLATFORM_TABLE: Final[tuple[tuple[str, str, str, str], ...]] = (
    (
        "Linux, NVIDIA",
        "nvml",
        "device metrics; per-process VRAM (NVML used memory), engine use",
        "not validated (mocked NVML)",
    ),
    (
        "Linux, AMD / Intel",
        "drm",
        "sysfs device metrics; per-process VRAM from DRM fdinfo when private",
        "not validated (fake sysfs/proc)",
    ),
    (
        "Linux, Huawei Ascend",
        "ascend",
        "npu-smi: HBM used/total, AI core %, per-process memory (MB)",
        "not validated (npu-smi output samples)",
    ),
    (
        "Windows (WDDM)",
        "wddm",
        "DXGI adapters; PDH Local Usage (VRAM), Non Local Usage (Paged), engine %",
        "not validated (recorded counter names, mocked ctypes)",
    ),
    (
        "Windows, NVIDIA TCC/MCDM",
        "tcc",
        "NVML only: device metrics, per-process memory (n/a when hidden)",
        "not validated (mocked NVML)",
    ),
    (
        "WSL2",
        "wsl",
        "host PDH via powershell.exe; vmwp.exe total measured, WSL rows inferred",
        "not validated (synthetic replays)",
    ),
    (
        "macOS, Apple Silicon",
        "metal",
        "IOKit Metal clients, device use; footprint; compressed graphics (Paged)",
        "not validated (mocked IOKit)",
    ),
)
