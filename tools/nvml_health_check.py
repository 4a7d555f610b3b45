"""The health and MIG part of ``tools/nvml_check.py``: what ``nvidia-smi -q -x`` says of each
GPU (`smi_health`, `smi_mig`), compared with gputaskman's readings of it (`compare_health`),
the XID two-sample check (`xid_two_samples`) and the cost of each health and MIG NVML call on
a real GPU (`nvml_costs`).

Sans-io where it can be: `compare_health` reads a document and the XML text it is given, so
``packages/gputaskman/tests/test_nvml_check_health.py`` runs it on an XML written in
nvidia-smi's format (not captured from a device). Look, don't touch: only Get calls and an
event set of this process's own; nothing is set or cleared, a MIG mode is never changed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

MIB = 1 << 20


class Checks(Protocol):
    """`nvml_check.Checks`: one PASS / FAIL / SKIP (None) row per call."""

    def add(
        self, name: str, ok: bool | None, gputaskman: Any, reference: Any, note: str = ""
    ) -> None: ...


def value(reading: Any) -> Any:
    return reading.get("value") if isinstance(reading, dict) else None


NA_WORDS = ("n/a", "[n/a]", "not supported", "[not supported]", "none", "unknown error", "")
# nvidia-smi's clock event reason names (clocks_event_reason_* / clocks_throttle_reason_*)
CLOCK_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks_setting": 0x100,
}
SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80


def smi_number(text: str | None) -> float | None:
    """``30 %``, ``0 KB/s``, ``9728 MiB``, ``12``: the number; N/A and the like: None."""
    if text is None or text.strip().lower() in NA_WORDS:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def smi_flag(text: str | None) -> int | None:
    word = (text or "").strip().lower()
    return {"yes": 1, "active": 1, "no": 0, "not active": 0}.get(word)


def _find(el: Any, path: str) -> str | None:
    got = el.find(path)
    return None if got is None or got.text is None else got.text.strip()


def _sum(el: Any, paths: list[str]) -> float | None:
    """The sum of the numbers at `paths` (None when none is a number)."""
    got = [smi_number(_find(el, p)) for p in paths]
    known = [g for g in got if g is not None]
    return sum(known) if known else None


def _ecc(gpu: Any, scope: str) -> tuple[float | None, float | None]:
    """(corrected, uncorrected) of ``volatile`` or ``aggregate``: the single/double-bit totals
    of older drivers, else the SRAM and DRAM counts of newer ones, summed."""
    base = f"ecc_errors/{scope}"
    if gpu.find(f"{base}/single_bit") is not None:
        return (
            smi_number(_find(gpu, f"{base}/single_bit/total")),
            smi_number(_find(gpu, f"{base}/double_bit/total")),
        )
    corrected = _sum(gpu, [f"{base}/sram_correctable", f"{base}/dram_correctable"])
    uncorrected = _sum(
        gpu,
        [
            f"{base}/sram_uncorrectable",
            f"{base}/sram_uncorrectable_parity",
            f"{base}/sram_uncorrectable_secded",
            f"{base}/dram_uncorrectable",
        ],
    )
    return corrected, uncorrected


def smi_health(gpu: Any) -> dict[str, Any]:
    """What ``nvidia-smi -q -x`` says of one ``<gpu>``, under gputaskman's health keys."""
    vc, vu = _ecc(gpu, "volatile")
    ac, au = _ecc(gpu, "aggregate")
    clocks = gpu.find("clocks_event_reasons")
    if clocks is None:
        clocks = gpu.find("clocks_throttle_reasons")
    mask = None
    if clocks is not None:
        mask = 0
        for child in clocks:
            name = child.tag.split("_reason_", 1)[-1]
            if name in CLOCK_BITS and smi_flag(child.text) == 1:
                mask |= CLOCK_BITS[name]
    pending = _find(gpu, "retired_pages/pending_retirement")
    if pending is None:
        pending = _find(gpu, "retired_pages/pending_blacklist")
    return {
        "ecc_volatile_corrected_errors": vc,
        "ecc_volatile_uncorrected_errors": vu,
        "ecc_aggregate_corrected_errors": ac,
        "ecc_aggregate_uncorrected_errors": au,
        "retired_pages_single_bit": smi_number(
            _find(gpu, "retired_pages/multiple_single_bit_retirement/retired_count")
        ),
        "retired_pages_double_bit": smi_number(
            _find(gpu, "retired_pages/double_bit_retirement/retired_count")
        ),
        "retired_pages_pending": smi_flag(pending),
        "remapped_rows_correctable": smi_number(_find(gpu, "remapped_rows/remapped_row_corr")),
        "remapped_rows_uncorrectable": smi_number(_find(gpu, "remapped_rows/remapped_row_unc")),
        "remapped_rows_pending": smi_flag(_find(gpu, "remapped_rows/remapped_row_pending")),
        "remapped_rows_failure": smi_flag(_find(gpu, "remapped_rows/remapped_row_failure")),
        "fan_speed_percent": smi_number(_find(gpu, "fan_speed")),
        "clocks_event_reasons": mask,
        "pcie_tx_kib_per_second": smi_number(_find(gpu, "pci/tx_util")),
        "pcie_rx_kib_per_second": smi_number(_find(gpu, "pci/rx_util")),
    }


def smi_mig(gpu: Any) -> dict[str, Any]:
    """The MIG mode (1, 0, None), each MIG device's ids and memory (MiB), and the instance of
    each process nvidia-smi lists on a MIG instance."""
    mode = {"enabled": 1, "disabled": 0}.get((_find(gpu, "mig_mode/current_mig") or "").lower())
    devices = {}
    for d in gpu.findall("mig_devices/mig_device"):
        gi, ci = (
            smi_number(_find(d, "gpu_instance_id")),
            smi_number(_find(d, "compute_instance_id")),
        )
        if gi is not None and ci is not None:
            devices[(int(gi), int(ci))] = (
                smi_number(_find(d, "fb_memory_usage/total")),
                smi_number(_find(d, "fb_memory_usage/used")),
            )
    procs = {}
    for pi in gpu.findall("processes/process_info"):
        pid = smi_number(_find(pi, "pid"))
        gi, ci = (
            smi_number(_find(pi, "gpu_instance_id")),
            smi_number(_find(pi, "compute_instance_id")),
        )
        if pid is not None and gi is not None and ci is not None:
            procs[int(pid)] = (int(gi), int(ci))
    return {"mode": mode, "instances": devices, "processes": procs}


def compare_health(doc: dict[str, Any], smi_xml: str, checks: Checks) -> None:
    """Each GPU's health and MIG readings in `doc` against ``nvidia-smi -q -x`` (`smi_xml`);
    GPUs are paired by PCI bus id."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(smi_xml)
    adapters = {(a.get("pci_bus_id") or "").lower(): a for a in doc.get("adapters", [])}
    for gpu in root.findall("gpu"):
        bus = (gpu.get("id") or "").lower()
        a = adapters.get(bus)
        tag = f"gpu {bus}"
        if a is None:
            checks.add(f"{tag} in gputaskman --json", False, sorted(adapters), bus)
            continue
        health = a.get("health") or {}
        ref = smi_health(gpu)
        for key in (
            "ecc_volatile_corrected_errors",
            "ecc_volatile_uncorrected_errors",
            "ecc_aggregate_corrected_errors",
            "ecc_aggregate_uncorrected_errors",
            "retired_pages_single_bit",
            "retired_pages_double_bit",
            "retired_pages_pending",
            "remapped_rows_correctable",
            "remapped_rows_uncorrectable",
            "remapped_rows_pending",
            "remapped_rows_failure",
        ):
            r = health.get(key) or {}
            got, want = r.get("value"), ref[key]
            ok = (got is None and want is None) or (got is not None and got == want)
            note = "both n/a" if got is None and want is None else (r.get("reason") or "")
            checks.add(f"{tag} {key}", ok, got, want, note)
        fan, want = value(health.get("fan_speed_percent")), ref["fan_speed_percent"]
        checks.add(
            f"{tag} fan speed % (within 10)",
            (fan is None and want is None) or (None not in (fan, want) and abs(fan - want) <= 10),
            fan,
            want,
        )
        mask, want = value(health.get("clocks_event_reasons")), ref["clocks_event_reasons"]
        checks.add(
            f"{tag} slowdown clock event reasons",
            (mask is None and want is None)
            or (None not in (mask, want) and int(mask) & SLOWDOWN == int(want) & SLOWDOWN),
            None if mask is None else hex(int(mask)),
            None if want is None else hex(int(want)),
            "the other reasons (idle, power cap) can change between the two reads",
        )
        for key, smi_key in (
            ("pcie_tx_bytes_per_second", "pcie_tx_kib_per_second"),
            ("pcie_rx_bytes_per_second", "pcie_rx_kib_per_second"),
        ):
            want = ref[smi_key]
            checks.add(
                f"{tag} {key}",
                None,
                value(health.get(key)),
                None if want is None else want * 1024,
                "listed, not judged: nvidia-smi samples 20 ms, gputaskman a refresh",
            )
        for key in (
            "nvlink_tx_bytes_per_second",
            "nvlink_rx_bytes_per_second",
            "xid_critical_errors",
        ):
            r = health.get(key) or {}
            checks.add(
                f"{tag} {key}", None, r.get("value"), None, r.get("detail") or r.get("reason") or ""
            )
        mig, smig = a.get("mig") or {}, smi_mig(gpu)
        mode = value(mig.get("mode"))
        checks.add(f"{tag} MIG mode", mode == smig["mode"], mode, smig["mode"])
        ours = {
            (i["gpu_instance_id"], i["compute_instance_id"]): i for i in mig.get("instances") or ()
        }
        checks.add(
            f"{tag} MIG instances",
            set(ours) == set(smig["instances"]),
            sorted(ours),
            sorted(smig["instances"]),
        )
        for ids, (total, used) in smig["instances"].items():
            i = ours.get(ids)
            if i is None:
                continue
            t = value(i["memory_total_bytes"])
            checks.add(
                f"{tag} MIG {ids} memory total (1 MiB)",
                None not in (t, total) and abs(t - total * MIB) < MIB,
                t,
                None if total is None else total * MIB,
            )
            u = value(i["memory_used_bytes"])
            checks.add(
                f"{tag} MIG {ids} memory used (64 MiB slack)",
                None not in (u, used) and abs(u - used * MIB) <= 64 * MIB,
                u,
                None if used is None else used * MIB,
            )
        rows = {
            p["pid"]: p.get("mig")
            for p in doc.get("processes", [])
            if (p.get("gpu") or "").lower() == bus
        }
        for pid, ids in smig["processes"].items():
            got = rows.get(pid)
            got_ids = None if got is None else (got["gpu_instance_id"], got["compute_instance_id"])
            checks.add(f"{tag} process {pid} MIG instance", got_ids == ids, got_ids, ids)


def xid_two_samples(checks: Checks) -> None:
    """One gputaskman backend samples twice: its XID count must then be a measured number
    (0 unless a critical XID happened in between) on every GPU that supports the events."""
    from gputaskman.backends.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        backend.sample()
        time.sleep(1.0)
        s = backend.sample()
    finally:
        backend.close()
    for bus, h in s.health.items():
        r = h.get("xid_critical_errors")
        measured = r is not None and r.value is not None and str(r.kind) == "measured"
        why = None if r is None else (r.detail or str(r.reason))
        ok = (
            True
            if measured
            else (None if r is not None and str(r.reason) == "not supported" else False)
        )
        checks.add(
            f"gpu {bus} XID count measured on the second sample",
            ok,
            None if r is None else r.value,
            "a count",
            why or "",
        )


def nvml_costs(out: Path, repeat: int = 200) -> list[dict[str, Any]]:
    """Each NVML call a refresh makes for health and MIG, timed on GPU 0 (median µs of
    `repeat`, errors timed too and named), beside two calls every refresh already made."""
    import pynvml
    from gputaskman.backends.nvml_health import EVENT_XID, REQUEST

    pynvml.nvmlInit()
    rows: list[dict[str, Any]] = []
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        es = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(h, EVENT_XID, es)
        except pynvml.NVMLError as err:
            rows.append({"call": "nvmlDeviceRegisterEvents", "error": str(err)})
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("nvmlDeviceGetMemoryInfo (existing)", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
            (
                "nvmlDeviceGetComputeRunningProcesses (existing)",
                lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h),
            ),
            (
                "nvmlDeviceGetFieldValues (15 health fields)",
                lambda: pynvml.nvmlDeviceGetFieldValues(h, REQUEST),
            ),
            (
                "nvmlDeviceGetCurrentClocksEventReasons",
                lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
            ),
            ("nvmlDeviceGetFanSpeed", lambda: pynvml.nvmlDeviceGetFanSpeed(h)),
            ("nvmlDeviceGetMigMode", lambda: pynvml.nvmlDeviceGetMigMode(h)),
            ("nvmlEventSetWait(set, 0)", lambda: pynvml.nvmlEventSetWait(es, 0)),
        ]
        for name, fn in calls:
            times, error = [], None
            for _ in range(repeat):
                t0 = time.perf_counter()
                try:
                    fn()
                except pynvml.NVMLError as err:
                    error = str(err)
                times.append(time.perf_counter() - t0)
            times.sort()
            rows.append(
                {"call": name, "median_us": round(times[len(times) // 2] * 1e6, 1), "error": error}
            )
            print(
                f"cost  {name}: {rows[-1]['median_us']} µs{f' ({error})' if error else ''}",
                flush=True,
            )
        pynvml.nvmlEventSetFree(es)
    finally:
        pynvml.nvmlShutdown()
    (out / "costs.json").write_text(json.dumps(rows, indent=1))
    return rows
