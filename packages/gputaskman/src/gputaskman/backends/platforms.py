"""Which GPU backend this machine gets, and what each platform's backend measures.

Theory of operation
-------------------
The backend is chosen once, from facts about the running system, by `detect_backend`:
``wddm`` on Windows, ``metal`` on macOS, ``wsl`` on Linux under WSL (the kernel release
names Microsoft, or ``WSL_DISTRO_NAME`` is set) and ``nvml`` on native Linux. The function
takes those facts as arguments so tests decide them; `current_backend` reads them from the
running process.

`collector.gpu_source(backend)` builds the matching source *lazily*: platform modules (and
through them ``ctypes.windll``, IOKit, PDH) are imported only there, so every module of the
package imports cleanly on every platform (tests/test_platform_imports.py checks this on
Linux). Every backend returns the same `base.gpusource.GpuSample`.

Nothing here is validated on Windows, WSL or macOS hardware; see `PLATFORM_TABLE`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Final

BACKENDS: Final = ("wddm", "nvml", "wsl", "metal")


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
    """`detect_backend` for this process (called once, at import, by the collector)."""
    return detect_backend(sys.platform, platform.release(), os.environ)


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
