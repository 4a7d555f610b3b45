"""The Windows (WDDM) backend: DXGI adapters + PDH counters + TCC GPUs, as one `GpuSample`.

Theory of operation
-------------------
One `WddmBackend` lives as long as the monitor; each `sample()`:

1. Lists adapters with DXGI (`dxgi.DxgiApi`), keyed by LUID. Indices come from a registry
   that hands out the next free index the first time a key is seen and never reuses or
   moves one, so DXGI adapters come first, TCC GPUs after them, and a GPU that appears
   later (hot-plug, re-enable) never shifts another.
2. **Disable and re-enable.** An adapter listed before and missing now (disabled in Device
   Manager, driver reset, removed) stays in the sample with every metric missing
   (``gpu lost``: "DXGI no longer lists it") and a failed process list, so it is shown
   unavailable with a reason instead of vanishing. Re-enabling gives the GPU a new LUID;
   when a new LUID has the same vendor/device/subsystem/revision *and* the same PCI
   address as a lost one (pairing by PCI address, never by name or index), it takes the
   lost adapter's index and the old entry is dropped. Until PDH publishes counters for the
   new LUID its readings are ``unavailable`` with that reason.
3. Reads PDH (`pdh.PdhApi`) and aggregates (`pdh.aggregate`): adapter memory used is
   ``GPU Adapter Memory\\Dedicated Usage`` (the reference total), total is DXGI's
   DedicatedVideoMemory, utilisation is the busiest engine; per process, VRAM is
   ``Local Usage`` and the Paged column is ``Non Local Usage``. Temperature, power and
   clocks are not in PDH: ``not supported`` with that reason.
4. Appends NVIDIA TCC/MCDM GPUs from `tcc.TccCounters` (NVML only); the sample's `parts`
   hold TCC's own probe, so ``--list-gpus`` can say why no TCC GPU was found.

Not validated on Windows hardware.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from gputaskman.backends.win import dxgi as dxgi_mod
from gputaskman.backends.win import pdh as pdh_mod
from gputaskman.backends.win import tcc as tcc_mod
from gputaskman.base.gpusource import GpuSample, GpuSource, ProbeResult
from gputaskman.base.readings import Adapter, DeviceMetrics, Problem, Reading, Reason

BACKEND = dxgi_mod.BACKEND
LOST_DETAIL = "adapter disabled or removed: DXGI no longer lists it"


@dataclass(slots=True)
class _Known:
    index: int
    desc: dxgi_mod.AdapterDesc
    lost: bool = False


class WddmBackend(GpuSource):
    """Samples DXGI + PDH (+ NVML for TCC). Pass fakes for `dxgi`, `pdh` and `tcc` in
    tests; `tcc=False` turns TCC discovery off."""

    def __init__(
        self,
        dxgi: dxgi_mod.DxgiApi | None = None,
        pdh: pdh_mod.PdhApi | None = None,
        tcc: tcc_mod.TccCounters | bool | None = None,
    ) -> None:
        self._dxgi = dxgi if dxgi is not None else dxgi_mod.CtypesDxgi()
        self._pdh = pdh if pdh is not None else pdh_mod.CtypesPdh()
        self._tcc: tcc_mod.TccCounters | None
        if tcc is False:
            self._tcc = None
        elif tcc is None or tcc is True:
            self._tcc = tcc_mod.TccCounters()
        else:
            self._tcc = tcc
        self._known: dict[str, _Known] = {}  # LUID key -> index, last desc
        self._indices: dict[str, int] = {}  # every key ever given an index (DXGI and TCC)

    def _index_for(self, key: str) -> int:
        if key not in self._indices:
            self._indices[key] = max(self._indices.values(), default=-1) + 1
        return self._indices[key]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken query must not raise
            self._pdh.close()
        if self._tcc is not None:
            self._tcc.close()

    def _track(self, descs: list[dxgi_mod.AdapterDesc]) -> list[str]:
        """Update the registry for this enumeration; returns notes (re-enabled GPUs)."""
        notes: list[str] = []
        present = {d.luid for d in descs}
        for key, k in self._known.items():
            k.lost = key not in present
        for d in descs:
            if d.luid in self._known:
                self._known[d.luid].desc = d
                continue
            old = next(
                ((key, k) for key, k in self._known.items() if k.lost and _same_device(k.desc, d)),
                None,
            )
            if old is not None:
                key, k = old
                del self._known[key]
                self._indices[d.luid] = k.index
                del self._indices[key]
                notes.append(
                    f"GPU {k.index} ({d.description}) is back with a new LUID "
                    f"({key} -> {d.luid}): re-enabled or reset"
                )
            self._known[d.luid] = _Known(self._index_for(d.luid), d)
        return notes

    def sample(self) -> GpuSample:
        try:
            descs = dxgi_mod.hardware_adapters(self._dxgi.enum_adapters())
        except OSError as exc:
            return GpuSample.failed(BACKEND, "backend.init", Reason.QUERY_FAILED, f"DXGI: {exc}")
        notes = self._track(descs)
        problems: list[Problem] = []
        try:
            view = pdh_mod.aggregate(self._pdh.read(pdh_mod.COUNTERS))
        except OSError as exc:
            why = Reading.missing(Reason.QUERY_FAILED, "pdh", str(exc))
            view = pdh_mod.PdhView(failures={p: why for p in pdh_mod.COUNTERS})
        if view.unparsed:
            notes.append(f"PDH: {view.unparsed} counter instance names not understood")
        if view.bad_values:
            notes.append(f"PDH: {view.bad_values} counter values out of range, ignored")

        adapters: list[Adapter] = []
        metrics: dict[str, DeviceMetrics] = {}
        known = sorted(self._known.items(), key=lambda kv: kv[1].index)
        for key, k in known:
            a = dxgi_mod.to_adapter(k.desc, k.index)
            adapters.append(a)
            if k.lost:
                metrics[key] = DeviceMetrics.all_missing(Reason.GPU_LOST, "dxgi", LOST_DETAIL)
                problems.append(Problem("adapter", Reason.GPU_LOST, LOST_DETAIL, key))
                problems.append(Problem("processes.pdh", Reason.GPU_LOST, LOST_DETAIL, key))
                continue
            metrics[key] = _metrics(k.desc, view.adapters.get(key), view)
            local_fail = view.failures.get(pdh_mod.LOCAL)
            if local_fail is not None:
                problems.append(
                    Problem(
                        "processes.pdh",
                        local_fail.reason or Reason.QUERY_FAILED,
                        local_fail.detail,
                        key,
                    )
                )

        live = {key for key, k in self._known.items() if not k.lost}
        procs = [
            pdh_mod.process_row(pid, luid, c)
            for (pid, luid), c in sorted(view.processes.items())
            if luid in live
        ]
        stray = {luid for _, luid in view.processes} - set(self._known)
        if stray:
            notes.append(
                f"PDH counts {len(stray)} adapter(s) DXGI does not list; their processes are "
                "not shown"
            )

        driver = None
        parts: tuple[ProbeResult, ...] = ()
        if self._tcc is not None:
            t = self._tcc.sample()
            parts = (t.probe,)
            if t.backend_problem is None:
                extra, tcc_notes = tcc_mod.merge_tcc(
                    adapters,
                    [k.desc.pci_text for _, k in known],
                    t,
                    self._tcc.modes,
                    self._index_for,
                )
                notes.extend(tcc_notes)
                keep = {a.pci_bus_id for a in extra}
                adapters.extend(extra)
                metrics.update({b: m for b, m in t.metrics.items() if b in keep})
                procs.extend(p for p in t.processes if p.adapter in keep)
                problems.extend(p for p in t.problems if p.adapter in keep)
                driver = t.driver_version
                if keep:
                    notes.append("TCC/MCDM GPUs: NVML only (Windows has no PDH counters for them)")
            elif t.backend_problem.reason is not Reason.NO_LIBRARY:
                problems.append(t.backend_problem)  # NVML present but broken: say so
        adapters.sort(key=lambda a: a.index)  # display order; indices never move
        return GpuSample(
            backend=BACKEND,
            adapters=tuple(adapters),
            metrics=metrics,
            processes=tuple(procs),
            problems=tuple(problems),
            driver_version=driver,
            notes=tuple(notes),
            parts=parts,
        )


def _same_device(old: dxgi_mod.AdapterDesc, new: dxgi_mod.AdapterDesc) -> bool:
    """The same physical GPU under a new LUID: same ids and the same known PCI address."""
    ids = (old.vendor_id, old.device_id, old.subsys_id, old.revision)
    return (
        ids == (new.vendor_id, new.device_id, new.subsys_id, new.revision)
        and old.pci is not None
        and old.pci == new.pci
    )


def _metrics(
    desc: dxgi_mod.AdapterDesc, c: pdh_mod.AdapterCounters | None, view: pdh_mod.PdhView
) -> DeviceMetrics:
    if c is None:
        # No counter instance for this LUID: PDH has not published it yet (new or just
        # re-enabled adapter), or a counter set failed as a whole.
        fail = view.failures.get(pdh_mod.ADAPTER_DEDICATED)
        why = fail or Reading.missing(
            Reason.UNAVAILABLE,
            "pdh",
            "no counter instance for this adapter yet (new or re-enabled adapter)",
        )
        used = util = why
        enc = dec = why
    else:
        used, util = c.dedicated_usage, c.util_percent
        enc = c.engines.get("videoencode_percent") or Reading.missing(
            Reason.NOT_LISTED, "pdh", "no VideoEncode engine instance"
        )
        dec = c.engines.get("videodecode_percent") or Reading.missing(
            Reason.NOT_LISTED, "pdh", "no VideoDecode engine instance"
        )
    # An integrated GPU may report 0 dedicated bytes: a measured zero stays 0.
    total = Reading.measured(desc.dedicated_video_memory, "dxgi:DedicatedVideoMemory")
    return DeviceMetrics.partial(
        "pdh",
        "not a PDH counter",
        memory_total_bytes=total,
        memory_used_bytes=used,
        util_gpu_percent=util,
        encoder_percent=enc,
        decoder_percent=dec,
    )
