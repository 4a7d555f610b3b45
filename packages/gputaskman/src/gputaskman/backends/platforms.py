"""Which GPU backend this machine gets, and the sample type the non-Linux backends share.

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
Linux). This module imports none of them: they import its shared types.

Every non-Linux backend returns a `PlatformSample`. It has the fields the collector already
reads from `nvml.NvmlSample` (adapters, metrics, processes, problems, backend_problem,
driver_version), so it plugs into `Collector(nvml=...)` unchanged, plus:

* `notes`: lines for humans (what was not validated, why a pairing was refused);
* `probe`: a `ProbeResult` that tells ``--list-gpus`` whether the probe *succeeded and
  found nothing* (``empty``) or *failed* (``failed``, with a reason): the two must never
  look alike;
* processes are `PlatformProcess` rows: an `NvmlProcess` look-alike that also carries
  ``paged`` (non-local / compressed graphics memory, the "Paged" column), ``inferred`` (WSL
  context tracking), ``footprint`` (macOS), and, for rows that live on another OS (the
  Windows host seen from WSL), ``host`` and ``name``. A row with ``host`` set has a PID of
  *that* OS and must never be joined with this machine's /proc.

Nothing here is validated on Windows, WSL or macOS hardware; see `PLATFORM_TABLE`.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from gputaskman.base.readings import Adapter, DeviceMetrics, Problem, Reading, Reason

BACKENDS: Final = ("wddm", "nvml", "wsl", "metal")

ProbeStatus = Literal["ok", "empty", "failed"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of asking one backend for its GPUs.

    ``ok``: it answered and listed `count` > 0 GPUs. ``empty``: it answered and there is
    no GPU of its kind (a fact). ``failed``: it could not answer (library missing, query
    error, interop off); `reason`/`detail` say why, and nothing is known about GPUs.
    `partial` is true when it answered but some part failed (a device that could not be
    read, a process list that failed): the list may be incomplete.
    """

    backend: str
    status: ProbeStatus
    count: int = 0
    reason: Reason | None = None
    detail: str | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        if self.status == "failed" and self.reason is None:
            raise ValueError("a failed probe needs a reason")
        if self.status == "ok" and self.count <= 0:
            raise ValueError("an ok probe lists at least one GPU")
        if self.status == "empty" and self.count != 0:
            raise ValueError("an empty probe lists no GPU")

    @classmethod
    def of(
        cls,
        backend: str,
        adapters: tuple[Adapter, ...],
        backend_problem: Problem | None,
        problems: tuple[Problem, ...] = (),
    ) -> ProbeResult:
        """Derive the probe outcome from what a sample holds."""
        if backend_problem is not None:
            return cls(backend, "failed", 0, backend_problem.reason, backend_problem.detail)
        partial = any(p.where.startswith(("device", "processes", "adapter")) for p in problems)
        if not adapters:
            return cls(backend, "empty", 0, partial=partial)
        return cls(backend, "ok", len(adapters), partial=partial)

    def line(self) -> str:
        """One line for ``--list-gpus`` when nothing (or not everything) could be listed."""
        if self.status == "failed":
            why = f"{self.reason}: {self.detail}" if self.detail else str(self.reason)
            return f"{self.backend}: probe failed ({why})"
        tail = " (incomplete: some queries failed, see problems)" if self.partial else ""
        if self.status == "empty":
            return f"{self.backend}: probe succeeded, 0 GPUs{tail}"
        return f"{self.backend}: probe succeeded, {self.count} GPU(s){tail}"


@dataclass(frozen=True, slots=True)
class PlatformProcess:
    """One process on one adapter, as a non-Linux backend sees it.

    Duck-compatible with `nvml.NvmlProcess` (pid, adapter, contexts, dedicated, engines).
    `dedicated` is the measured per-process VRAM (Windows ``Local Usage``) or missing with a
    reason; `paged` is measured non-local memory (Windows ``Non Local Usage``, macOS
    compressed graphics memory), never added to VRAM totals; `inferred` is a derived value
    (WSL context tracking) shown when nothing was measured and never summed.
    """

    pid: int
    adapter: str
    contexts: tuple[str, ...]
    dedicated: Reading
    engines: Mapping[str, Reading] = field(default_factory=dict)
    paged: Reading | None = None
    inferred: Reading | None = None
    footprint: Reading | None = None
    name: str | None = None
    host: str | None = None  # "windows" for a Windows host process seen from WSL
    parent_pid: int | None = None  # WSL: the vmwp.exe whose total this row sits under
    unique: bool = False  # the inference admits one explanation only (the "*" marker)


@dataclass(frozen=True, slots=True)
class PlatformSample:
    """One pass of a non-Linux backend; `metrics` is keyed by `Adapter.pci_bus_id`."""

    backend: str
    adapters: tuple[Adapter, ...] = ()
    metrics: Mapping[str, DeviceMetrics] = field(default_factory=dict)
    processes: tuple[PlatformProcess, ...] = ()
    problems: tuple[Problem, ...] = ()
    backend_problem: Problem | None = None
    driver_version: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def probe(self) -> ProbeResult:
        return ProbeResult.of(self.backend, self.adapters, self.backend_problem, self.problems)


def probes(source: Any, sample: Any, backend: str) -> list[ProbeResult]:
    """What ``--list-gpus`` reports: the main probe, then each sub-probe a source ran
    (``last_tcc`` on Windows, ``last_ascend`` beside NVML on Linux). Works for any sample
    with adapters/backend_problem/problems (an `nvml.NvmlSample` too)."""
    main = getattr(sample, "probe", None)
    if not isinstance(main, ProbeResult):
        main = ProbeResult.of(
            backend, tuple(sample.adapters), sample.backend_problem, tuple(sample.problems)
        )
    out = [main]
    for attr in ("last_tcc", "last_ascend"):
        sub = getattr(source, attr, None)
        if sub is not None and isinstance(getattr(sub, "probe", None), ProbeResult):
            out.append(sub.probe)
    return out


def failed_sample(backend: str, where: str, reason: Reason, detail: str) -> PlatformSample:
    """A sample that says the backend as a whole could not answer, and why."""
    p = Problem(where, reason, detail)
    return PlatformSample(backend, problems=(p,), backend_problem=p)


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
