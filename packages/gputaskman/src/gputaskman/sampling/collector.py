"""One refresh: GPU backend + host sample + budgeted process scan -> `Snapshot`.

Theory of operation
-------------------
`Collector.sample_with_system()` does, in order:

1. **GPU backend**, a `gpusource.GpuSource` (built once at construction by
   `registry.gpu_source`; the collector knows backends only through that contract).
   `registry.BACKEND` is chosen from the platform: ``wddm`` on Windows (DXGI + PDH, TCC/MCDM
   GPUs from NVML), ``metal`` on macOS (IOKit), ``wsl`` under WSL (NVML + the Windows
   host's counters), else ``nvml``: on Linux `linux.LinuxGpus` (NVML for NVIDIA plus DRM
   sysfs/fdinfo for amdgpu, i915 and xe, merged by PCI address, with Huawei Ascend NPUs
   appended when ``npu-smi`` is installed). Each gives a `GpuSample`: adapters, device
   metrics, the processes the driver lists per adapter, notes and probes. A missing driver
   or library yields a snapshot with `backend_problem` set, never an exception.
   `Collector.backend` is the source's `backend_for` the selected GPU: the sample's
   backend, or ``drm`` / ``ascend`` when the selected GPU is an AMD/Intel card or an NPU.
   Non-Linux backends are not validated on hardware.

   Rows a backend marks with ``host`` (Windows processes seen from WSL) carry PIDs of
   another OS: they keep the backend's name, get no create time, and are never scanned
   or joined with this machine's /proc. Their ``paged``, ``footprint``, ``inferred``,
   ``parent_pid`` and ``unique`` fields pass through to `ProcGpu` unchanged.
2. **Host** (`host.HostSampler`): system RAM, swap, CPU and every process's RSS/CPU%,
   from one read of ``/proc/PID/stat`` each. It is returned *beside* the snapshot (the
   JSON ``system`` key) and never enters GPU totals. The same pass supplies each process's
   name and create time, so ``(pid, create_time)`` identifies a process everywhere.
   On Windows and macOS (no /proc) `hostplat.default_sampler` gives a
   `hostplat.PlatformHostSampler` instead: what PDH / sysctl can read, the rest unknown.
3. **Process scan** (`procinfo`, budgeted by `procscan`): runtime libraries and mapped model
   files from ``/proc/PID/maps``, the redacted command line and a category. Scans are cached
   per ``(pid, create_time)`` inside the scanner and bounded by `scan_budget` seconds per
   refresh; GPU-listed processes go first (largest shown VRAM first), then the rest. With
   ``scan_budget=None`` (one-shot output) everything is scanned.

Rows of the snapshot are every process NVML lists (one row per adapter it uses) plus
every other process whose scan found a GPU/AI runtime library or a mapped model file;
those rows have no adapter and VRAM ``n/a (not listed)``. A process the budget has not
reached yet carries ``ProcDetail(scanned=False)`` until a later refresh gets to it.

   Then, for the rows only (`procfacts.RowFacts`, where there is /proc): what of each
   process is swapped out, locked or pinned (``/proc/PID/status``; swapped bytes labelled
   as held by duvm's pool only when its device is the only active swap device) and who owns
   it (``/proc/PID/cgroup``: pod, container, Slurm job, unit, session; the real user).
4. **Models** (`modelinfo.ModelResolver`): for every row with a procinfo scan, which model
   it holds (`ProcGpu.model`), the weights / KV cache / compute view (`ProcGpu.breakdown`)
   and an app adapter's selection (`ProcGpu.app_model`). The costly part (API probes, GGUF
   headers, logs) runs inline for one-shot output and on a background pool otherwise, so it
   never enters the scan budget; a row shows the cheap evidence-only model until then.

`sysroot_collector(DIR)` reads /sys and /proc below DIR (a fixture tree written by
``python -m gputaskman.fixtures.drm_fixtures DIR``) and does not ask NVML, whose processes live in
the real PID namespace.

The collector is not thread-safe; the TUI runs `sample_with_system` in one worker thread
at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from gputaskman.backends import registry
from gputaskman.base.gpusource import GpuProcess, GpuSource
from gputaskman.base.readings import (
    Adapter,
    Kind,
    Problem,
    ProcDetail,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.sampling import host as host_mod
from gputaskman.sampling import hostplat, procfacts

if TYPE_CHECKING:
    from gputaskman.intel.procinfo import ProcInfo

SCAN_BUDGET = 0.150  # seconds of /proc/PID/maps scanning per refresh (TUI, record)

ScanKey = tuple[int, float | None]

_DEFAULT_MODELS: Any = object()  # "build the default ModelResolver" (None means none)


class ProcScanner(Protocol):
    """What the collector needs from procinfo's scanner."""

    #: True when `info` gives the `procinfo.ProcInfo` behind a scan, which model resolution
    #: reads: the collector builds its default `ModelResolver` only for such a scanner.
    gives_procinfo: bool

    def scan(self, keys: Sequence[ScanKey], budget: float | None) -> Mapping[ScanKey, ProcDetail]:
        """Details of the processes the budget reached (cached per key)."""
        ...

    def scan_one(self, pid: int, create_time: float | None) -> ProcDetail | None:
        """Scan one process now, ignoring budget and cache; None when this scanner cannot."""
        ...

    def info(self, key: ScanKey) -> ProcInfo | None:
        """The `procinfo.ProcInfo` behind the last scan's detail for `key` (what model
        resolution reads), or None."""
        ...


class NullScanner:
    """No process scanning: every process reads as not scanned (a seam for tests)."""

    gives_procinfo = False

    def scan(self, keys: Sequence[ScanKey], budget: float | None) -> Mapping[ScanKey, ProcDetail]:
        return {}

    def scan_one(self, pid: int, create_time: float | None) -> ProcDetail | None:
        return None

    def info(self, key: ScanKey) -> ProcInfo | None:
        return None


class ProcinfoScanner:
    """`procscan.Scanner` (budgeted, cached per (pid, create_time)) seen as a `ProcScanner`."""

    gives_procinfo = True

    def __init__(self, root: str | None = None) -> None:
        from gputaskman.intel import procscan

        self.scanner = procscan.Scanner() if root is None else procscan.Scanner(root=root)
        self.last_result: Any = None
        # key -> (the ProcInfo object converted, its ProcDetail): a cached scan returns the
        # same object every refresh, so the conversion is done once per scan, not per refresh.
        self._details: dict[ScanKey, tuple[ProcInfo, ProcDetail]] = {}

    def scan(self, keys: Sequence[ScanKey], budget: float | None) -> Mapping[ScanKey, ProcDetail]:
        res = self.scanner.scan(keys, budget)
        self.last_result = res
        old = self._details
        new: dict[ScanKey, tuple[ProcInfo, ProcDetail]] = {}
        for info in res.infos.values():
            key = info.key
            hit = old.get(key)
            new[key] = (
                hit if hit is not None and hit[0] is info else (info, detail_from_procinfo(info))
            )
        self._details = new  # entries for processes that left are dropped here
        return {k: d for k, (_, d) in new.items()}

    def scan_one(self, pid: int, create_time: float | None) -> ProcDetail:
        return detail_from_procinfo(self.scanner.scan_one(pid, create_time))

    def info(self, key: ScanKey) -> ProcInfo | None:
        """The `procinfo.ProcInfo` behind the last scan's detail for `key`, or None."""
        hit = self._details.get(key)
        return None if hit is None else hit[0]


def detail_from_procinfo(info: ProcInfo) -> ProcDetail:
    """Convert a `procinfo.ProcInfo` into the snapshot's `ProcDetail`."""
    reason = None
    reason_detail = None
    why = info.reason("maps") or info.reason("stat") or info.reason("cmdline")
    if info.gone:
        reason, reason_detail = Reason.PROCESS_GONE, None
    elif why is not None:
        reason, reason_detail = why.reason, f"{why.field}: {why.detail}"
    return ProcDetail(
        cmdline=info.cmdline,
        runtimes=tuple(r.label for r in info.runtimes),
        model_files=tuple(m.path for m in info.models if m.evidence == "mapped" and m.path),
        category=info.category,
        scanned=not info.gone,
        reason=reason,
        exe=info.exe,
        model_evidence=tuple((m.evidence, m.path) for m in info.models),
        reason_detail=reason_detail,
        user=info.user,
        ppid=info.ppid,
    )


def default_scanner() -> ProcScanner:
    return ProcinfoScanner()


def is_candidate(d: ProcDetail) -> bool:
    """A process worth a row without a GPU context: a GPU/AI runtime is mapped, a model
    file is mapped, or a model flag names one. A ``path-arg`` alone is informational."""
    return bool(
        d.runtimes or d.model_files or any(e in ("mapped", "cmdline") for e, _ in d.model_evidence)
    )


class Collector:
    """Samples the GPU backend, the host and the processes; see the module docstring.

    `gpu` is the adapter index the caller selected (display and ``selected_gpu`` in JSON;
    every adapter is still sampled so the UI can switch). `scan_budget` bounds process
    scanning per refresh in seconds; None scans everything (one-shot output).
    """

    SCAN_BUDGET = SCAN_BUDGET

    def __init__(
        self,
        gpu: int | None = None,
        scan_budget: float | None = SCAN_BUDGET,
        *,
        source: GpuSource | None = None,
        host: host_mod.HostSampler | hostplat.PlatformHostSampler | None = None,
        scanner: ProcScanner | None = None,
        models: Any = _DEFAULT_MODELS,
        facts: procfacts.RowFacts | None = None,
    ) -> None:
        self.gpu = gpu
        self.scan_budget = scan_budget
        self._source = source if source is not None else registry.gpu_source()
        self._host = host if host is not None else hostplat.default_sampler()
        self._scanner = scanner if scanner is not None else default_scanner()
        # each row's swapped / locked / pinned memory and cgroup owner, where there is /proc
        if facts is None and isinstance(self._host, host_mod.HostSampler):
            facts = procfacts.RowFacts(self._host.proc_root)
        self._facts = facts
        if models is _DEFAULT_MODELS:
            # Model resolution needs procinfo's ProcInfo; a test's scanner seam has none.
            models = None
            if self._scanner.gives_procinfo:
                from gputaskman.intel.modelinfo import ModelResolver

                models = ModelResolver(background=scan_budget is not None)
        self.models = models
        self.extra_notes: tuple[str, ...] = ()  # shown in every snapshot (e.g. --sysroot)
        self.backend = registry.BACKEND
        self.last_timing: dict[str, float] = {}

    def close(self) -> None:
        self._source.close()
        if self.models is not None:
            self.models.close()

    def rescan(self, pid: int, create_time: float | None) -> ProcDetail | None:
        """Scan one process now, ignoring budget and cache (the inspector's refresh key).
        None when the scanner cannot scan on demand."""
        return self._scanner.scan_one(pid, create_time)

    def prime(self) -> None:
        """Take a host sample whose only use is to give CPU% (a rate) its first point,
        so one-shot output can show rates instead of "first sample"."""
        # the real sample reports a failure with its reason; priming stays quiet
        with contextlib.suppress(Exception):
            self._host.sample()

    def sample(self) -> Snapshot:
        return self.sample_with_system()[0]

    def sample_with_system(self) -> tuple[Snapshot, host_mod.SystemInfo | None]:
        taken = time.time()
        t0 = time.perf_counter()
        gpu = self._source.sample()
        t1 = time.perf_counter()
        system: host_mod.SystemInfo | None
        try:
            system = self._host.sample()
        except Exception as exc:  # the host panel degrades; the GPU part still shows
            system = None
            host_problem: Problem | None = Problem(
                "host", Reason.QUERY_FAILED, f"{type(exc).__name__}: {exc}"
            )
        else:
            host_problem = None
        t2 = time.perf_counter()
        procs_by_pid: Mapping[int, host_mod.ProcessUsage] = (
            system.processes if system is not None else {}
        )

        def ident(pid: int) -> tuple[str | None, float | None]:
            u = procs_by_pid.get(pid)
            return (None, None) if u is None else (u.name, u.create_time)

        # Scan order: GPU-listed processes (largest measured memory first), then the rest.
        gpu_rows = sorted(gpu.processes, key=_vram_desc)
        keys: list[ScanKey] = []
        seen: set[int] = set()
        for r in gpu_rows:
            # a row of another OS (Windows host seen from WSL) is not a process here
            if r.host is None and r.pid not in seen:
                seen.add(r.pid)
                keys.append((r.pid, ident(r.pid)[1]))
        for pid, u in procs_by_pid.items():
            if pid not in seen and u.create_time is not None:
                keys.append((pid, u.create_time))
        details = self._scanner.scan(keys, self.scan_budget)
        t3 = time.perf_counter()

        rows: list[ProcGpu] = []
        for r in gpu_rows:
            if r.host is not None:
                rows.append(_row(r, None, None, None))
                continue
            name, ct = ident(r.pid)
            rows.append(_row(r, name, ct, details.get((r.pid, ct))))
        for key, d in details.items():
            pid, ct = key
            if pid in seen or not is_candidate(d):
                continue
            name = ident(pid)[0]
            not_listed = _not_listed(gpu.backend_problem is None)
            rows.append(ProcGpu(pid, ct, name, None, (), not_listed, detail=d))

        t4 = time.perf_counter()
        if self._facts is not None:
            swap, pool = (None, None) if system is None else (system.swap, system.duvm)
            rows = self._facts.annotate(rows, swap, pool)
        t4b = time.perf_counter()
        rows = self._add_models(rows, gpu.adapters)
        t5 = time.perf_counter()

        notes: list[str] = [*self.extra_notes, *gpu.notes]
        # a part that answered and found nothing says what it looked for (DRM: no card)
        notes.extend(n for p in gpu.parts if (n := p.note()) is not None)
        if gpu.backend_problem is None and not gpu.adapters and registry.BACKEND == "nvml":
            notes.append("NVML answered but lists no GPU")
        self.backend = self._source.backend_for(gpu, self.gpu)
        self.last_timing = {
            "gpu_s": t1 - t0,
            "host_s": t2 - t1,
            "scan_s": t3 - t2,
            "facts_s": t4b - t4,
            "model_s": t5 - t4b,
            "total_s": time.perf_counter() - t0,
        }
        snap = Snapshot(
            taken=taken,
            backend=self.backend,
            adapters=gpu.adapters,
            metrics=gpu.metrics,
            processes=tuple(rows),
            problems=gpu.problems + ((host_problem,) if host_problem else ()),
            notes=tuple(notes),
            driver_version=gpu.driver_version,
            backend_problem=gpu.backend_problem,
            extra_metrics=gpu.extra_metrics,
            health=gpu.health,
            mig=gpu.mig,
        )
        return snap, system

    def _add_models(self, rows: list[ProcGpu], adapters: Sequence[Adapter]) -> list[ProcGpu]:
        """Rows with `model`, `breakdown` and `app_model` filled (see `modelinfo`)."""
        if self.models is None:
            return rows
        nvidia = [a for a in adapters if a.vendor == "nvidia"]
        out = []
        live = []
        for r in rows:
            # a host row's PID is another OS's: never look it up in this machine's scans
            info = self._scanner.info(r.key) if r.host is None else None
            if info is None or info.gone:
                out.append(r)
                continue
            live.append(r.key)
            d = r.dedicated
            measured = int(d.value) if d.kind is Kind.MEASURED and d.value is not None else None
            # llama.cpp names devices CUDA0, CUDA1... in CUDA's order, which equals NVML's
            # only for a single NVIDIA GPU; elsewhere sum all devices and skip "other".
            device = None
            if r.adapter is not None and len(nvidia) == 1 and nvidia[0].pci_bus_id == r.adapter:
                device = "CUDA0"
            res = self.models.resolve(
                info, measured_bytes=measured if device else None, device=device
            )
            out.append(replace(r, model=res.ref, breakdown=res.view, app_model=res.app))
        self.models.forget(live)
        return out


def sysroot_collector(
    root: str, gpu: int | None = None, scan_budget: float | None = SCAN_BUDGET
) -> Collector:
    """A collector that reads ``root/sys`` and ``root/proc`` only (fixture trees)."""
    import os

    from gputaskman.intel.modelinfo import ModelResolver
    from gputaskman.intel.stores import StoreIndex, StoreRoots

    proc = os.path.join(root, "proc")
    scanner = ProcinfoScanner(root=proc)
    models = ModelResolver(
        background=scan_budget is not None, proc=proc, index=StoreIndex(StoreRoots())
    )
    c = Collector(
        gpu,
        scan_budget,
        source=registry.sysroot_gpu_source(root),
        host=host_mod.HostSampler(proc_root=proc),
        scanner=scanner,
        models=models,
        facts=procfacts.RowFacts(
            proc,
            pods_dir=os.path.join(root, "var", "log", "pods"),
            swaps=os.path.join(proc, "swaps"),  # the tree's own, never this machine's
        ),
    )
    c.extra_notes = (
        f"--sysroot {root}: GPUs and processes come from the tree under it; NVML is not "
        "asked; RAM, swap and CPU totals are this machine's",
    )
    return c


def _vram_desc(r: GpuProcess) -> tuple[int, int]:
    v = r.dedicated.value
    return (0 if v is not None else 1, -int(v or 0))


def _not_listed(backend_ok: bool) -> Reading:
    if backend_ok:
        return Reading.missing(
            Reason.NOT_LISTED, "nvml:running processes", "no GPU context on any adapter"
        )
    return Reading.missing(Reason.UNAVAILABLE, "nvml", "no GPU backend on this machine")


def _row(r: GpuProcess, name: str | None, ct: float | None, d: ProcDetail | None) -> ProcGpu:
    """A snapshot row for one backend row, with this machine's identity and scan."""
    if r.host is not None:
        d = ProcDetail(
            scanned=False,
            reason=Reason.UNAVAILABLE,
            reason_detail=f"a {r.host} process (its PID is not one of this machine's)",
        )
        name = r.name
    elif d is None and ct is None:
        # The backend lists the PID but /proc here has no such process: it runs in another
        # PID namespace (we are in a container) or exited between the two reads. Windows
        # and macOS have no /proc: the process scanner is Linux-only, and their host
        # sampler (hostplat) lists no processes yet.
        why = "no /proc entry for this PID here (another PID namespace, or exited)"
        if registry.BACKEND in ("wddm", "metal"):
            why = "process details come from /proc, which this OS does not have"
        d = ProcDetail(scanned=False, reason=Reason.UNAVAILABLE, reason_detail=why)
    elif d is None:
        d = ProcDetail(scanned=False, reason=Reason.NOT_SCANNED)
    if name is None:
        name = r.name  # the backend's own name (PDH, IOKit, npu-smi) as fallback
    return ProcGpu(
        r.pid,
        ct,
        name,
        r.adapter,
        r.contexts,
        r.dedicated,
        inferred=r.inferred,
        engines=r.engines,
        detail=d,
        paged=r.paged,
        footprint=r.footprint,
        host=r.host,
        parent_pid=r.parent_pid,
        unique=r.unique,
        mig=r.mig,
    )
