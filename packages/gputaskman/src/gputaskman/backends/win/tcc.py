"""NVIDIA GPUs in TCC or MCDM mode on Windows, from NVML only.

Theory of operation
-------------------
A GPU in TCC (or MCDM) mode is not a display adapter: DXGI does not list it and Windows
publishes no GPU Engine / GPU Process Memory counters for it. NVML is the only source, so
`TccCounters` (a `gpusource.GpuSource`, backend ``tcc``) asks NVML (through
`nvml.NvmlBackend`, same error map, same "hidden is not zero" rule) and keeps the devices
whose current driver model is ``NVML_DRIVER_WDM`` (TCC) or ``NVML_DRIVER_MCDM``
(`TccCounters.modes` says which). A WDDM device is left to DXGI and PDH. The driver model
cannot change without a reboot, so it is asked once per device per process run.

`merge_tcc` appends these GPUs after the DXGI adapters, so no existing index moves. A TCC
GPU is *paired* with a DXGI adapter (treated as the same device, not listed twice) only
when the pairing is unambiguous: its PCI domain is 0 (DXGI's address, from the kernel
thunk, has no domain) and exactly one DXGI adapter has that bus/device/function. The full
NVML address, domain included, stays the TCC adapter's key, so two GPUs that differ only
by domain never merge.

A process whose memory NVML hides is ``n/a`` (Reason.HIDDEN), so the adapter's attributed
sum is a lower bound, never a 0 that looks complete. There is no model breakdown for TCC:
that needs the shared-memory counter, which does not exist here.

nvml.dll is loaded by absolute path from the system directory (the DCH driver location),
before pynvml could look anywhere else. Not validated on TCC hardware: tests use a mocked
NVML.
"""

from __future__ import annotations

import dataclasses
import ntpath
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from gputaskman.backends.nvml import NvmlBackend, normalise_bus_id, reason_for
from gputaskman.base.gpusource import GpuSample, GpuSource
from gputaskman.base.readings import Adapter, Problem, Reason

BACKEND: Final = "tcc"
NVML_DRIVER_WDDM: Final = 0
NVML_DRIVER_WDM: Final = 1  # TCC
NVML_DRIVER_MCDM: Final = 2
TCC_MODELS: Final = {NVML_DRIVER_WDM: "tcc", NVML_DRIVER_MCDM: "mcdm"}


def parse_bus_id(bus: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of ``00000000:3b:00.0`` (or ``0000:3b:00.0``)."""
    try:
        dom, b, rest = bus.strip().split(":")
        d, f = rest.split(".")
        return int(dom, 16), int(b, 16), int(d, 16), int(f, 16)
    except ValueError:
        return None


def load_windows_nvml(
    exists: Callable[[str], bool] = os.path.exists, dll_path: str | None = None
) -> Any:
    """pynvml with nvml.dll loaded from the system directory by absolute path.

    Raises FileNotFoundError (no NVIDIA driver) when the DLL is not there.
    """
    import ctypes

    if dll_path is None:
        from gputaskman.backends.win import _windows_system_directory, system_dll

        dll_path = system_dll("nvml.dll", get_system_directory=_windows_system_directory)
    if not ntpath.isabs(dll_path) or not exists(dll_path):
        raise FileNotFoundError(f"nvml.dll not found at {dll_path} (no NVIDIA driver)")
    import pynvml

    # pynvml.nvmlLib: the binding's module global holding the loaded library (None or unset)
    if getattr(pynvml, "nvmlLib", None) is None:
        # pynvml loads the library lazily into this global; setting it first means the
        # absolute path above is the only one ever tried.
        pynvml.nvmlLib = ctypes.CDLL(dll_path)
    return pynvml


class TccCounters(GpuSource):
    """NVML for TCC/MCDM GPUs. `lib` is a pynvml-like module (tests pass a mocked one);
    `loader` makes the real one on Windows. `modes` maps the bus id of each GPU the last
    sample listed to its driver model, ``tcc`` or ``mcdm``."""

    def __init__(self, lib: Any | None = None, loader: Callable[[], Any] | None = None) -> None:
        self._lib = lib
        self._loader = loader or load_windows_nvml
        self._nvml: NvmlBackend | None = None
        self._failed: Problem | None = None
        self._models: dict[str, int | None] = {}
        self.modes: dict[str, str] = {}

    def _backend(self) -> NvmlBackend | Problem:
        if self._failed is not None:
            return self._failed
        if self._nvml is None:
            if self._lib is None:
                if sys.platform != "win32":
                    self._failed = Problem("tcc.init", Reason.NOT_SUPPORTED, "TCC is Windows only")
                    return self._failed
                try:
                    self._lib = self._loader()
                except FileNotFoundError as exc:
                    self._failed = Problem("tcc.init", Reason.NO_LIBRARY, str(exc))
                    return self._failed
                except Exception as exc:  # a broken binding: degrade with the reason
                    self._failed = Problem("tcc.init", Reason.QUERY_FAILED, f"{exc}")
                    return self._failed
            self._nvml = NvmlBackend(self._lib)
        return self._nvml

    def _driver_models(self) -> dict[str, int | None]:
        """bus id -> current driver model, asked once per device."""
        lib: Any = self._lib
        try:
            count = int(lib.nvmlDeviceGetCount())
        except Exception:
            return self._models
        for i in range(count):
            try:
                h = lib.nvmlDeviceGetHandleByIndex(i)
                bus_raw = lib.nvmlDeviceGetPciInfo(h).busId
                bus = normalise_bus_id(
                    bus_raw.decode() if isinstance(bus_raw, bytes) else str(bus_raw)
                )
            except Exception:
                continue
            if bus in self._models:
                continue
            try:
                self._models[bus] = int(lib.nvmlDeviceGetCurrentDriverModel(h))
            except Exception as exc:
                # NotSupported (Linux, old drivers): not a TCC GPU as far as we can tell;
                # a transient error is asked again next time.
                if reason_for(exc) is Reason.NOT_SUPPORTED:
                    self._models[bus] = None
        return self._models

    def sample(self) -> GpuSample:
        self.modes = {}
        backend = self._backend()
        if isinstance(backend, Problem):
            return GpuSample(BACKEND, problems=(backend,), backend_problem=backend)
        s = backend.sample()
        if s.backend_problem is not None:
            return GpuSample(BACKEND, problems=s.problems, backend_problem=s.backend_problem)
        models = self._driver_models()
        modes = {b: TCC_MODELS[m] for b, m in models.items() if m in TCC_MODELS}
        adapters = tuple(
            dataclasses.replace(a, backend=BACKEND) for a in s.adapters if a.pci_bus_id in modes
        )
        keep = {a.pci_bus_id for a in adapters}
        self.modes = {b: m for b, m in modes.items() if b in keep}
        return GpuSample(
            BACKEND,
            adapters=adapters,
            metrics={k: v for k, v in s.metrics.items() if k in keep},
            processes=tuple(p for p in s.processes if p.adapter in keep),
            problems=tuple(p for p in s.problems if p.adapter is None or p.adapter in keep),
            driver_version=s.driver_version,
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()


def pair_with_dxgi(tcc_bus: str, dxgi_pci: Sequence[str | None]) -> int | None:
    """Index into `dxgi_pci` (domainless ``bb:dd.f`` per DXGI adapter) of the one adapter
    this TCC GPU is, or None when not provably the same (domain != 0, no match, or more
    than one match)."""
    parts = parse_bus_id(tcc_bus)
    if parts is None or parts[0] != 0:
        return None
    _, b, d, f = parts
    want = f"{b:02x}:{d:02x}.{f:x}"
    hits = [i for i, p in enumerate(dxgi_pci) if p is not None and p.lower() == want]
    return hits[0] if len(hits) == 1 else None


def merge_tcc(
    dxgi: Sequence[Adapter],
    dxgi_pci: Sequence[str | None],
    tcc: GpuSample,
    modes: Mapping[str, str],
    index_for: Callable[[str], int],
) -> tuple[list[Adapter], list[str]]:
    """TCC adapters to append after `dxgi`, and notes. `modes` is `TccCounters.modes`;
    `index_for(key)` gives an adapter its index (the caller's registry hands out the next
    free one, so nothing moves).

    A TCC GPU paired with a DXGI adapter is not appended (it is already listed)."""
    out: list[Adapter] = []
    notes: list[str] = []
    for a in tcc.adapters:
        mode = modes.get(a.pci_bus_id, "tcc").upper()
        hit = pair_with_dxgi(a.pci_bus_id, dxgi_pci)
        if hit is not None:
            notes.append(
                f"{mode} GPU {a.pci_bus_id} is DXGI adapter {dxgi[hit].index} (same PCI address)"
            )
            continue
        parts = parse_bus_id(a.pci_bus_id)
        if parts is not None and parts[0] != 0:
            notes.append(
                f"{mode} GPU {a.pci_bus_id}: PCI domain {parts[0]:x} cannot be compared with "
                "DXGI's domainless address; listed on its own"
            )
        out.append(dataclasses.replace(a, index=index_for(a.pci_bus_id)))
    return out, notes
