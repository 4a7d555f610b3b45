"""Windows backends: DXGI adapters, PDH counters, NVIDIA TCC/MCDM GPUs through NVML.

Theory of operation
-------------------
`backend.WddmBackend` is what the collector samples on Windows. It lists adapters through
`dxgi` (keyed by LUID), reads per-process and per-adapter counters through `pdh`, and
appends NVIDIA TCC/MCDM GPUs, which DXGI does not list and PDH does not count, from
`tcc` (NVML). Each module keeps its ctypes layer behind a small interface (`DxgiApi`,
`PdhApi`, an NVML module object) so tests replace it; only the ctypes classes touch
``ctypes.windll``, and only when called. Importing this package on Linux loads nothing
from Windows.

Vendor and system DLLs are loaded by absolute path from the system directory
(`system_dll`), never by bare name, so a DLL planted in the working directory or on PATH
is never picked up. Not validated on Windows hardware.
"""

from __future__ import annotations

import ntpath
import os
from collections.abc import Callable, Mapping


def system_directory(
    environ: Mapping[str, str] | None = None,
    get_system_directory: Callable[[], str | None] | None = None,
) -> str:
    """The Windows system directory (``C:\\Windows\\System32``), as an absolute path.

    Asks the OS (GetSystemDirectoryW) when it can; falls back to %SystemRoot%\\System32,
    and to ``C:\\Windows\\System32`` when even that is unset. A relative answer is refused.
    """
    env = os.environ if environ is None else environ
    path = None
    if get_system_directory is not None:
        path = get_system_directory()
    if not path:
        root = env.get("SystemRoot") or env.get("SYSTEMROOT") or env.get("windir") or r"C:\Windows"
        path = ntpath.join(root, "System32")
    if not ntpath.isabs(path) or not ntpath.splitdrive(path)[0]:
        raise ValueError(f"system directory is not an absolute path: {path!r}")
    return path


def system_dll(name: str, **kw: object) -> str:
    """Absolute path of a DLL in the system directory, e.g. ``nvml.dll``, ``pdh.dll``."""
    if ntpath.basename(name) != name or not name.lower().endswith(".dll"):
        raise ValueError(f"expected a bare DLL file name, got {name!r}")
    return ntpath.join(system_directory(**kw), name)  # type: ignore[arg-type]


def _windows_system_directory() -> str | None:
    """GetSystemDirectoryW through ctypes (Windows only; None elsewhere or on failure)."""
    try:
        import ctypes

        buf = ctypes.create_unicode_buffer(260)
        n = ctypes.windll.kernel32.GetSystemDirectoryW(buf, 260)  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return None
    return buf.value if 0 < n < 260 else None
