"""The Linux source: NVML for NVIDIA, DRM for amdgpu/i915/xe, and Ascend NPUs, as one.

Theory of operation
-------------------
`LinuxGpus.sample()` asks each part and merges their samples into one `GpuSample`
(backend ``nvml``):

1. NVML's sample (`nvml.NvmlBackend`, or `NotAsked` under ``--sysroot``, whose fixture PIDs
   are not NVML's);
2. plus DRM's cards, paired with NVML's by PCI address so no GPU is listed twice
   (`drm.combine_with_nvml`); NVML keeps its indices;
3. plus, when ``npu-smi`` is installed, the Ascend NPUs appended after them
   (`ascend.append_npus`), each keeping the index it was first given.

A part that answers makes the sample usable even when NVML cannot (an AMD or NPU machine
without the NVIDIA library): NVML's failure stays among the problems, and its own probe is
one of the sample's `parts`, so ``--list-gpus`` still says why NVML found nothing. The other
parts are Ascend's probe (when asked) and DRM's when it found no card (a card it found is in
the main probe). `backend_for` names the snapshot ``drm`` or ``ascend`` while an AMD/Intel
card or an NPU is selected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gputaskman.backends import drm as drm_mod
from gputaskman.backends.ascend import BACKEND as ASCEND
from gputaskman.backends.ascend import AscendBackend, append_npus
from gputaskman.base.gpusource import GpuSample, GpuSource, ProbeResult
from gputaskman.base.readings import Adapter, Problem, Reason


class NotAsked(GpuSource):
    """A part that asks no driver and says why (``--sysroot``: NVML is not asked)."""

    def __init__(self, backend: str, why: str) -> None:
        self.backend = backend
        self.why = why

    def sample(self) -> GpuSample:
        return GpuSample(
            self.backend, backend_problem=Problem("backend.init", Reason.UNAVAILABLE, self.why)
        )

    def close(self) -> None:
        pass


class LinuxGpus(GpuSource):
    """NVML + DRM (+ Ascend) merged; see the module docstring. Keep one instance across
    samples (DRM's engine rates and the NPUs' indices need the previous one)."""

    def __init__(
        self, nvml: GpuSource, drm: drm_mod.DrmBackend, ascend: AscendBackend | None = None
    ) -> None:
        self.nvml = nvml
        self.drm = drm
        self.ascend = ascend
        self._npu_indices: dict[str, int] = {}

    def sample(self) -> GpuSample:
        nvml = self.nvml.sample()
        drm = self.drm.sample()
        merged = drm_mod.combine_with_nvml(nvml, drm)
        npus = None
        if self.ascend is not None:
            npus = self.ascend.sample()
            merged = append_npus(merged, npus, self._npu_indices)
            merged = dataclasses.replace(merged, notes=merged.notes + npus.notes)
        parts: list[ProbeResult] = []
        if merged.adapters:
            parts.append(nvml.probe)  # NVML's own: other parts may have made the sample usable
        if npus is not None:
            parts.append(npus.probe)
        if not drm.adapters:
            parts.append(ProbeResult(drm_mod.BACKEND, "empty", detail=drm_mod.NO_CARD))
        return dataclasses.replace(merged, parts=tuple(parts))

    def backend_for(self, sample: GpuSample, selected: int | None) -> str:
        chosen = _chosen(sample.adapters, selected)
        if chosen is not None and chosen.backend == ASCEND:
            return ASCEND
        return drm_mod.backend_for(chosen, sample.backend)

    def close(self) -> None:
        self.nvml.close()
        self.drm.close()
        if self.ascend is not None:
            self.ascend.close()


def _chosen(adapters: Sequence[Adapter], selected: int | None) -> Adapter | None:
    """The selected adapter (by index), else the first one when none is selected."""
    chosen = next((a for a in adapters if a.index == selected), None)
    if chosen is None and selected is None and adapters:
        chosen = adapters[0]
    return chosen
