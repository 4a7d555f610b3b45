"""The WSL backend: Linux-side NVML, the Windows host's counters, and inferred WSL rows.

Theory of operation
-------------------
`WslBackend` is a `gpusource.GpuSource`; `sample()` builds a `GpuSample` (backend ``wsl``)
from three sources:

1. **NVML inside WSL** (`nvml.NvmlBackend`; the driver maps libnvidia-ml into the distro):
   device metrics by PCI address. NVML inside WSL does not give per-process memory; its
   rows, if any, keep their reasons.
2. **The host stream** (`wslhost.HostStream`), only when interop works (`interop_status`:
   ``/proc/sys/fs/binfmt_misc/WSLInterop`` (or ``WSLInterop-late``) enabled, and
   ``WSL_INTEROP`` set or ``powershell.exe`` reachable). Its latest frame is aggregated
   by `win.pdh.aggregate` into host adapters (keyed by LUID: inside WSL there is no key
   that pairs a LUID with NVML's PCI address, so the two views are listed side by side
   and a note says so) and host rows (Windows PIDs, ``host="windows"``, measured
   ``Local Usage`` and ``Non Local Usage``).
3. **Context tracking** (`wslhost.ContextTracker`): Linux processes that hold
   ``/dev/dxg`` open (`dxg_holders`) get an *inferred* share of the ``vmwp.exe`` row's
   measured total, on the one adapter where a single ``vmwp.exe`` has counters. These rows
   have ``dedicated`` missing (the host counts their bytes under vmwp.exe) and
   ``parent_pid`` = that vmwp.exe, so the bytes are summed once, as vmwp.exe's.

Interop off, powershell.exe missing, or the stream dying (it is restarted at most every
`RESTART_EVERY_S` seconds) each reduce what is shown and say why (a problem
``wsl.interop`` / ``wsl.host``); none of them is an error of the Linux side. Not
validated on WSL hardware.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gputaskman.backends.win import pdh
from gputaskman.backends.wslhost import ContextTracker, HostStream, Key, is_vm_worker
from gputaskman.base import procfs
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, DeviceMetrics, Problem, Reading, Reason

BACKEND: Final = "wsl"
DXG: Final = "/dev/dxg"
INTEROP_FILES: Final = ("WSLInterop", "WSLInterop-late")
POWERSHELL_FALLBACK: Final = "/mnt/c/Windows/System32/WindowsPowerShell/v1.0/powershell.exe"
RESTART_EVERY_S: Final = 30.0  # a dead host stream is restarted at most this often


@dataclass(frozen=True, slots=True)
class Interop:
    ok: bool
    reason: str | None = None  # why not, in words
    powershell: str | None = None


def interop_status(
    root: str = "/",
    environ: Mapping[str, str] | None = None,
    which: Any = shutil.which,
) -> Interop:
    """Whether Windows programs can be run from here, and why not."""
    env = os.environ if environ is None else environ
    binfmt = os.path.join(root, "proc/sys/fs/binfmt_misc")
    state = None
    for name in INTEROP_FILES:
        try:
            with open(os.path.join(binfmt, name), encoding="utf-8", errors="replace") as f:
                state = f.readline().strip()
            break
        except FileNotFoundError:
            continue
        except OSError as exc:
            return Interop(False, f"cannot read {binfmt}/{name}: {exc.strerror}")
    if state is None:
        return Interop(
            False,
            "WSL interop is off: no WSLInterop entry in /proc/sys/fs/binfmt_misc "
            "([interop] enabled=false in /etc/wsl.conf, or binfmt_misc not mounted)",
        )
    if state != "enabled":
        return Interop(False, f"WSL interop is {state or 'not enabled'} (binfmt_misc WSLInterop)")
    ps = which("powershell.exe")
    if ps is None and os.path.exists(os.path.join(root, POWERSHELL_FALLBACK.lstrip("/"))):
        ps = POWERSHELL_FALLBACK
    if ps is None:
        return Interop(
            False,
            "powershell.exe not found (Windows PATH not appended: "
            "[interop] appendWindowsPath=false, or C: not mounted at /mnt/c)",
        )
    if not env.get("WSL_INTEROP") and not os.path.exists(os.path.join(root, "run/WSL")):
        return Interop(False, "WSL_INTEROP is not set (a shell outside the WSL session?)")
    return Interop(True, None, ps)


def dxg_holders(proc_root: str = "/proc", device: str = DXG) -> tuple[dict[int, Key], int]:
    """Processes with `device` open: pid -> (pid, create_time), and how many were unreadable.

    Reads ``/proc/PID/fd`` links only (own-user processes without root; others count as
    denied and are never guessed)."""
    out: dict[int, Key] = {}
    denied = 0
    btime = procfs.boot_time(proc_root)
    for pid in procfs.list_pids(proc_root):
        fd_dir = os.path.join(proc_root, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            denied += 1
            continue
        except OSError:
            continue  # gone
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target == device:
                ct = None
                if btime is not None:
                    try:
                        ct = procfs.create_time(
                            procfs.read_stat(pid, root=proc_root).start_ticks, btime
                        )
                    except procfs.ProcError:
                        ct = None
                out[pid] = (pid, ct)
                break
    return out, denied


class WslBackend(GpuSource):
    """NVML + host stream + context tracking; pass fakes in tests."""

    def __init__(
        self,
        nvml: GpuSource | None = None,
        host: HostStream | None = None,
        interop: Interop | None = None,
        holders: Any | None = None,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            from gputaskman.backends.nvml import NvmlBackend

            nvml = NvmlBackend()
        self._nvml = nvml
        self.interop = interop if interop is not None else interop_status()
        self._host = host
        if self._host is None and self.interop.ok and self.interop.powershell:
            from gputaskman.backends.wslhost import powershell_command

            self._host = HostStream(powershell_command(interval, self.interop.powershell))
        self._holders = holders if holders is not None else dxg_holders
        self._tracker = ContextTracker()
        self._max_age = max(5.0, 5 * interval)
        self._clock = clock
        self._restarted = clock()

    def close(self) -> None:
        self._nvml.close()
        if self._host is not None:
            self._host.close()

    def sample(self) -> GpuSample:
        base = self._nvml.sample()
        adapters = list(base.adapters)
        metrics: dict[str, DeviceMetrics] = dict(base.metrics)
        procs: list[GpuProcess] = list(base.processes)
        problems: list[Problem] = list(base.problems)
        notes: list[str] = []
        # NVML missing inside WSL is not fatal when the host view works
        nvml_problem = base.backend_problem

        frame, why = (None, None)
        if not self.interop.ok:
            problems.append(Problem("wsl.interop", Reason.UNAVAILABLE, self.interop.reason))
        elif self._host is not None:
            self._host.start()
            frame, why = self._host.latest(self._max_age)
            if why is not None:
                problems.append(Problem("wsl.host", Reason.UNAVAILABLE, why))
                if self._host.exited and self._clock() - self._restarted >= RESTART_EVERY_S:
                    # powershell.exe can die (Windows sleep, interop reset): try again, rarely
                    self._restarted = self._clock()
                    self._host.restart()
        if frame is not None and why is None:
            self._add_host(frame, adapters, metrics, procs, problems, notes)
        if nvml_problem is not None and len(adapters) > len(base.adapters):
            nvml_problem = None  # the host view answered: the sample is usable
        return GpuSample(
            backend=BACKEND,
            adapters=tuple(adapters),
            metrics=metrics,
            processes=tuple(procs),
            problems=tuple(problems),
            backend_problem=nvml_problem,
            driver_version=base.driver_version,
            notes=tuple(notes),
        )

    def _add_host(
        self,
        frame: Any,
        adapters: list[Adapter],
        metrics: dict[str, DeviceMetrics],
        procs: list[GpuProcess],
        problems: list[Problem],
        notes: list[str],
    ) -> None:
        view = pdh.aggregate(frame.reads())
        start = len(adapters)
        for n, (luid, ac) in enumerate(sorted(view.adapters.items())):
            adapters.append(
                Adapter(start + n, "unknown", f"Windows host GPU {luid}", None, luid, "wsl-host")
            )
            metrics[luid] = _host_metrics(ac)
        if view.adapters and start:
            notes.append(
                "Windows host adapters (by LUID) are listed beside NVML's (by PCI address): "
                "inside WSL no key pairs the two"
            )
        vm: dict[str, list[int]] = {}
        for (pid, luid), c in sorted(view.processes.items()):
            name = frame.names.get(pid)
            if is_vm_worker(name):
                vm.setdefault(luid, []).append(pid)
            procs.append(pdh.process_row(pid, luid, c, name=name, host="windows"))
        holders, denied = self._holders()
        if denied:
            notes.append(f"/dev/dxg holders: {denied} processes' descriptors unreadable (not root)")
        if not holders:
            self._tracker.update(_vm_total(view, vm), [])
            return
        if len(vm) != 1 or len(next(iter(vm.values()))) != 1:
            detail = (
                "no vmwp.exe on any host adapter"
                if not vm
                else "several vmwp.exe rows or adapters: the WSL share cannot be told apart"
            )
            problems.append(Problem("wsl.context", Reason.UNAVAILABLE, detail))
            return
        ((luid, (vm_pid,)),) = vm.items()
        total = view.processes[(vm_pid, luid)].local.value
        inferred = self._tracker.update(
            int(total) if total is not None else None, list(holders.values())
        )
        hidden = Reading.missing(
            Reason.NOT_LISTED,
            "pdh:GPU Process Memory\\Local Usage",
            f"inside WSL the host counts these bytes under vmwp.exe (pid {vm_pid})",
        )
        for key, inf in sorted(inferred.items(), key=lambda kv: kv[0][0]):
            procs.append(
                GpuProcess(
                    pid=key[0],
                    adapter=luid,
                    contexts=("dxg",),
                    dedicated=hidden,
                    inferred=inf.reading,
                    parent_pid=vm_pid,
                    unique=inf.unique,
                )
            )


def _vm_total(view: pdh.PdhView, vm: Mapping[str, list[int]]) -> int | None:
    if len(vm) != 1:
        return None
    ((luid, pids),) = vm.items()
    if len(pids) != 1:
        return None
    v = view.processes[(pids[0], luid)].local.value
    return int(v) if v is not None else None


def _host_metrics(c: pdh.AdapterCounters) -> DeviceMetrics:
    engines = {
        field: c.engines[name]
        for field, name in (
            ("encoder_percent", "videoencode_percent"),
            ("decoder_percent", "videodecode_percent"),
        )
        if c.engines.get(name)
    }
    return DeviceMetrics.partial(
        "wsl:host stream",
        "not streamed",
        memory_used_bytes=c.dedicated_usage,
        util_gpu_percent=c.util_percent,
        **engines,
    )
