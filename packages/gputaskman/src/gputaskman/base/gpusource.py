"""The backend contract: what every GPU backend returns (`GpuSample`) and implements
(`GpuSource`). The collector knows backends only through this module.

Theory of operation
-------------------
A backend is an object with ``sample() -> GpuSample`` and ``close()`` (see `GpuSource`).
Each sample is one pass over the backend's devices, in types shared by every backend:

* a device is a `readings.Adapter` (identity; `Adapter.backend` names the backend that
  serves that GPU, e.g. ``tcc`` for a TCC GPU inside the ``wddm`` sample) plus its
  `readings.DeviceMetrics`, keyed by `Adapter.pci_bus_id` (or the backend's own stable
  key where there is no PCI address: a LUID, an IOKit registry id);
* a process is a `GpuProcess`: one process on one adapter. Every field past `engines` has
  a default that means "this backend does not know" (None, or False for `unique`), so a
  backend sets only what it measures;
* what went wrong is a `readings.Problem` each; `backend_problem` is set when the backend
  could not answer at all, and then the sample lists nothing;
* `notes` are lines for humans (what was not validated, why a pairing was refused);
* `probe` says whether the backend *answered and found nothing* or *failed* (the two
  must never look alike), and `parts` gives the probes of the sources a composite backend
  merged (NVML inside the Linux source, TCC inside the Windows one) that `probe` does not
  show on its own.

Every number is a `readings.Reading`: unknown is a missing reading with a reason, never 0.
A backend never raises for a driver error; it returns a sample that says what failed.

Adding a backend: write a module in ``backends/`` with a class that subclasses
`GpuSource`, implements `sample` and `close` (idempotent), and, only when the snapshot's
backend name depends on which GPU is selected, `backend_for`. `backends/macos.py` is a
small complete example; ``tests/test_backend_contract.py`` runs every backend through the
same checks, so add yours there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    MigState,
    Problem,
    Reading,
    Reason,
)

ProbeStatus = Literal["ok", "empty", "failed"]


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The outcome of asking one backend for its GPUs.

    ``ok``: it answered and listed `count` > 0 GPUs. ``empty``: it answered and there is
    no GPU of its kind (a fact). ``failed``: it could not answer (library missing, query
    error, interop off); `reason`/`detail` say why, and nothing is known about GPUs.
    `partial` is true when it answered but some part failed (a device that could not be
    read, a process list that failed): the list may be incomplete. An empty probe's
    `detail`, when given, says what was looked for ("no amdgpu, i915 or xe card in ...").
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
            if self.detail:
                return f"{self.backend}: {self.detail}{tail}"
            return f"{self.backend}: probe succeeded, 0 GPUs{tail}"
        return f"{self.backend}: probe succeeded, {self.count} GPU(s){tail}"

    def note(self) -> str | None:
        """The snapshot note for an empty probe that says what it looked for, else None."""
        if self.status == "empty" and self.detail:
            return f"{self.backend.upper()}: {self.detail}"
        return None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process on one adapter, as a backend sees it (the collector adds identity,
    host readings and the scan to make a `readings.ProcGpu` of it).

    `dedicated` is the measured per-process memory on `adapter` (NVML used memory, DRM
    private resident bytes, Windows ``Local Usage``, macOS graphics footprint, npu-smi
    process memory), or missing with the reason. The rest is what only some backends know,
    each None (False for `unique`) where unknown, and none of it is ever summed:
    `engines` per-process engine use (``gpu_percent``, ``<engine>_percent``); `paged`
    measured non-local memory (Windows ``Non Local Usage``, macOS compressed graphics
    memory, the "Paged" column); `inferred` a derived value (WSL context tracking) shown
    when nothing was measured; `footprint` the macOS physical footprint (unified memory,
    not VRAM); `name` the backend's own name for the process (PDH, IOKit, npu-smi), used
    when this machine's /proc has none; `host` the OS the PID belongs to when it is not
    this machine's (``"windows"`` for a Windows host process seen from WSL: never joined
    with /proc); `parent_pid` the row whose measured total already counts this one's bytes
    (WSL: ``vmwp.exe``); `unique` that the inference admits one explanation only.
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
    host: str | None = None
    parent_pid: int | None = None
    unique: bool = False
    # the MIG instance NVML lists it on: (gpu_instance_id, compute_instance_id); None: none
    mig: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One pass of a backend. `backend` names it (``nvml``, ``wddm``, ``wsl``, ``metal``,
    ``drm``, ``ascend``, ``tcc``); `metrics` is keyed by `Adapter.pci_bus_id`;
    `extra_metrics` holds device readings beyond `DeviceMetrics`, by the same key (amdgpu's
    GTT: ``gtt_used_bytes``, ``gtt_total_bytes``); `parts` the sub-probes (see the module
    docstring); `health` and `mig` the GPU's health readings and MIG state (NVML only), by
    the same key."""

    backend: str
    adapters: tuple[Adapter, ...] = ()
    metrics: Mapping[str, DeviceMetrics] = field(default_factory=dict)
    processes: tuple[GpuProcess, ...] = ()
    problems: tuple[Problem, ...] = ()
    backend_problem: Problem | None = None
    driver_version: str | None = None
    notes: tuple[str, ...] = ()
    extra_metrics: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)
    parts: tuple[ProbeResult, ...] = ()
    health: Mapping[str, Mapping[str, Reading]] = field(default_factory=dict)  # as Snapshot's
    mig: Mapping[str, MigState] = field(default_factory=dict)  # as Snapshot's

    @property
    def probe(self) -> ProbeResult:
        """This sample's own probe outcome (derived, so it can never disagree with it)."""
        return ProbeResult.of(self.backend, self.adapters, self.backend_problem, self.problems)

    @property
    def probes(self) -> tuple[ProbeResult, ...]:
        """`probe`, then every part's: what ``--list-gpus`` reports."""
        return (self.probe, *self.parts)

    @classmethod
    def failed(cls, backend: str, where: str, reason: Reason, detail: str | None) -> GpuSample:
        """A sample that says the backend as a whole could not answer, and why."""
        p = Problem(where, reason, detail)
        return cls(backend, problems=(p,), backend_problem=p)


class GpuSource(Protocol):
    """What the collector needs from a GPU backend. Backends subclass it (so they inherit
    the default `backend_for`); a test fake may too."""

    def sample(self) -> GpuSample:
        """One pass over the devices. Never raises for a driver or OS error: the sample
        says what failed (`GpuSample.problems`, `GpuSample.backend_problem`)."""
        ...

    def close(self) -> None:
        """Release what `sample` opened. Safe to call more than once."""
        ...

    def backend_for(self, sample: GpuSample, selected: int | None) -> str:
        """The snapshot's backend name while GPU `selected` (an `Adapter.index`; None for
        the first) is shown. The Linux source answers ``drm`` or ``ascend`` for those GPUs;
        every other backend names itself."""
        return sample.backend
