"""Pure functions from a `Snapshot` (plus the host sample) to JSON and to text.

Theory of operation
-------------------
`to_json_dict` is the single source of the ``--json`` object; record files store exactly
this object, one per line, and replay/diff/summary read it back through its one reader,
`reader.read_document`. `render_text` is the
``--once`` report. Neither function samples anything or imports a UI library.

JSON shape (``schema_version`` 1)
---------------------------------
Every number is a *reading object*, always with all five keys::

    {"value": 123 | 1.5 | null, "kind": "measured" | "inferred" | "estimated" | "runtime",
     "source": "nvml:nvmlDeviceGetMemoryInfo", "reason": null | "<reason>", "detail": null | "..."}

``value`` is null exactly when ``reason`` is set (reasons: ``denied``, ``not supported``,
``process gone``, ``unavailable``, ``hidden by driver``, ``library not found``,
``driver not loaded``, ``no gpu``, ``gpu lost``, ``query failed``, ``not listed``,
``not scanned yet``, ``shared``). A measured zero is ``0``; unknown is never ``0``.
The same rules as a JSON Schema (draft 2020-12): ``snapshot.schema.json`` in this package
(`gputaskman.base.schema`); the tests validate every document kind against it.
Plain integers outside reading objects are identities (pid, index, schema_version), times,
sums of measured readings (``attributed_bytes``, null when nothing was measured), and two
facts about a model file or its settings (``parameter_count``, ``n_ctx``) that are not
byte counts. The ``system`` object follows the same rule: its numbers are reading objects
of kind ``measured`` whose ``source`` names the OS file (``/proc/meminfo``, ``/proc/stat``,
``/proc/swaps``, ``os.getloadavg``): the OS's own counters for exactly that quantity. On
Windows and macOS (no /proc) the sources are PDH counters and ``sysctl:hw.memsize``, and
what those systems do not report is null with reason ``not supported`` (see hostplat.py).

Top level::

    {
      "schema": "gputaskman.snapshot", "schema_version": 1,
      "tool": {"name": "gputaskman", "version": "0.1.0"},
      "taken": 1796000000.25,                 # Unix seconds when sampling began
      "taken_iso": "2026-11-29T18:30:00.250Z" | null,  # null: no calendar date for taken
      "backend": "nvml",
      "available": true | false,              # did the backend answer at all
      "unavailable": null | PROBLEM,          # why not, when available is false
      "driver_version": "550.54" | null,
      "selected_gpu": 0 | null,               # index the caller selected (--gpu), else null
      "adapters": [ADAPTER, ...],             # [] when none (see "unavailable"/"problems")
      "processes": [PROCESS, ...],
      "attributed_bytes": int | null,         # sum of measured process VRAM, all adapters
      "attributed_complete": bool,            # false: a memory was hidden or a list failed
      "problems": [PROBLEM, ...],
      "notes": ["...", ...],
      "system": SYSTEM | null,                # RAM, swap, CPU as the OS reports them; never GPU
      "owner_totals": [OWNER_TOTAL, ...]      # measured VRAM by user, pod and job (derived
                                              # from the rows: a reader derives it again)
    }

    OWNER_TOTAL = {"by": "user" | "pod" | "job",
                   "owner": str | null,       # the user, pod UID or Slurm job ID
                   "state": "named" | "none" | "unknown",  # none: the cgroup names no pod
                                              # (job); unknown: the owner was not readable,
                                              # counted apart, never folded into another
                   "attributed_bytes": int | null,   # measured VRAM only; null: none measured
                   "attributed_complete": bool,      # false: a row's VRAM unknown, a list
                                                     # failed (the sum is a lower bound)
                   "pids": [int, ...], "pod_namespace": str | null, "pod_name": str | null}

    SYSTEM = {"taken": 1796000000.2, "kind": "measured",
              "memory": {"total_bytes": R, "available_bytes": R, "used_bytes": R, ...},
              "swap": {"total_bytes": R, "free_bytes": R, "used_bytes": R,
                       "devices": [{"filename": str, "type": str, "size_bytes": R,
                                    "used_bytes": R, "priority": R, "deleted": bool}] | null,
                       "devices_reason": str | null, "problems": [str, ...]},
              "cpu": {"percent": R, "load_1": R, "load_5": R, "load_15": R,
                      "logical_cpus": R},
              "processes_reason": str,           # only when the process list failed
              "duvm": DUVM}                      # only when duvm's sockets were looked for

    DUVM = {"kind": "runtime", "looked": "/run/duvm/*.ctl" | "$GTM_DUVM_SOCKETS",
            "daemons": [{"socket": str, "pid": int | null,
                         "health": "ok" | "degraded" | "failing", "reasons": [str, ...],
                         "size_bytes": R, "replicas": R, "pages_written": R,
                         "degraded_slabs": R, "pages_lost": R,
                         "peers": [{"peer": "host:port", "connected": bool | null,
                                    "pages": R,        # this node's pages held there
                                    "reserved_pages": R, "slabs": R}]}],
            "lending": [{"socket": str, "capacity_bytes": R, "used_bytes": R,
                         "reserved_bytes": R, "borrowers_listed_of": R,
                         "borrowers": [{"client_id": str, "stored_bytes": R,
                                        "reserved_bytes": R, "connections": R}]}],
            "errors": {"<socket path>": "why it gave no status"}}
    (DUVM readings are kind "runtime", source "duvm daemon:<socket>" or "duvm memserver:...";
    see duvmpool.py. Nothing in it is GPU memory or part of any total.)

    PROBLEM = {"where": "backend.init" | "processes.compute" | ..., "reason": "<reason>",
               "detail": str | null, "adapter": "<pci bus id>" | null}

    ADAPTER = {"index": 0, "vendor": "nvidia", "name": str | null, "uuid": str | null,
               "pci_bus_id": "00000000:01:00.0", "backend": "nvml",
               "metrics": {"memory_total_bytes": R, "memory_used_bytes": R,
                           "memory_reserved_bytes": R, "util_gpu_percent": R,
                           "util_memory_percent": R, "encoder_percent": R,
                           "decoder_percent": R, "temperature_c": R, "power_w": R,
                           "power_limit_w": R, "clock_graphics_mhz": R, "clock_sm_mhz": R,
                           "clock_memory_mhz": R} | null,
               "extra_metrics": {"gtt_used_bytes": R, "gtt_total_bytes": R},  # amdgpu GTT;
                                                      # {} when the backend has none
               "attributed_bytes": int | null, "attributed_complete": bool,
               "process_list": {"compute": "ok" | PROBLEM, "graphics": "ok" | PROBLEM},
               "health": {"xid_critical_errors": R, ...},   # {}: the backend reads none
               "health_state": HEALTH_STATE | null,         # derived from "health"
               "mig": MIG | null}                           # null: the backend reads none
    (HEALTH, HEALTH_STATE and MIG: `report_health`; the health keys `gpuhealth.HEALTH_FIELDS`.)

    PROCESS = {"pid": 123, "started_at": 1795999000.5 | null, "name": str | null,
               "gpu": "<pci bus id>" | null,          # null: no GPU context known
               "contexts": ["compute", "graphics"],
               "vram_bytes": R,                       # driver-measured, the only summed one
               "vram_inferred_bytes": R | null,
               "inferred_unique": bool,               # the inference admits one explanation
               "shown_vram": R | null,                # display/sort only, never summed
               "paged_bytes": R | null,               # non-local / compressed memory (Windows
                                                      # Non Local Usage, macOS); never summed
               "footprint_bytes": R | null,           # macOS physical footprint (unified
                                                      # memory, not VRAM); never summed
               "host": "windows" | null,              # pid is that OS's (WSL: a host row)
               "parent_pid": int | null,              # host row whose total counts this one
               "engines": {"gpu_percent": R, ...},    # {} when the backend has none
               "mig": {"gpu_instance_id": int,        # the MIG instance NVML lists it on
                       "compute_instance_id": int} | null,   # (null: none)
               "ram_bytes": R, "cpu_percent": R,      # from the host sample (OS-reported)
               "swapped_bytes": R | null,             # /proc/PID/status VmSwap (null: not
                                                      # read, e.g. another OS's process)
               "swapped_to": "pool" | "swap" | null,  # pool: duvm's device is the only
                                                      # active swap device (detail: why)
               "locked_bytes": R | null,              # VmLck (mlock: never swapped)
               "pinned_bytes": R | null,              # VmPin (pinned for a device, RDMA,
                                                      # io_uring: never swapped)
               "owner": null | OWNER,                 # what /proc/PID/cgroup names
               "cmdline": [str, ...] | null,          # secrets redacted by procinfo
               "runtimes": [str, ...], "model_files": [str, ...],
               "category": str | null,                # "?" suffix: names only (heuristic)
               "scanned": bool, "scan_reason": "<reason>" | null, "scan_detail": str | null,
               "exe": str | null,
               "user": str | null, "ppid": int | null,  # from /proc (procinfo's scan)
               "model_evidence": [{"evidence": "mapped" | "cmdline" | "path-arg",
                                   "path": str | null}, ...],
               "model": null | MODEL,
               "breakdown": null | BREAKDOWN,         # never summed into any total
               "app_model": null | APP}

    MODEL = {"name": str, "evidence": "api" | "mapped" | "cmdline" | "path-arg",
             "confirmed": bool,                       # two of api/mapped/cmdline agree
             "status": "confirmed" | "single source" | "informational" | null,
             "sources": ["api", "mapped", ...], "path": str | null,
             "store": "ollama" | "lmstudio" | "huggingface" | null,  # supplied the name only
             "pending": bool,                         # API/header/log look still running
             "api": null | {"runtime": str | null, "endpoint": "host:port" | null,
                            "errors": [str, ...]},    # what the local GET probe answered
             "header_error": str | null}

    BREAKDOWN = {"model": str | null, "path": str | null, "evidence": str,
                 "status": "confirmed" | "single source",
                 "owner_marker": "?" | null,          # heuristic model-to-process link
                 "runtime": str | null, "architecture": str | null,
                 "file_type": str | null, "parameter_count": int | null,
                 "n_ctx": int | null, "n_ctx_source": "api" | "cmdline" | ... | null,
                 "parts": {"weights": PART, "kv_cache": PART, "compute": PART,
                           "other": PART},
                 "reported_total": R,                 # runtime-reported parts only
                 "estimated_total": R,                # estimated parts only
                 "notes": [str, ...],
                 "format": "gguf" | "safetensors" | null,   # the header that was read
                 "kv_cache_dtype": str | null,        # the runtime's KV cache dtype
                 "runtime_figures": {"model_vram_bytes": R, "model_size_bytes": R,
                                     "kv_pool_tokens": R, "kv_used_percent": R,
                                     "kv_used_bytes": R,
                                     "gpu_memory_fraction_percent": R} | null}
                                                      # kind runtime, each only when the
                                                      # runtime gave it; null when no runtime
                                                      # answered for the model; never summed
    PART = {"reading": R,                             # runtime beats estimated
            "marker": "*" | null,                     # only one explanation fits
            "alternatives": [R, ...]}                 # the other explanations

    OWNER = {"cgroup": str | null,                   # the path parsed; null: not readable
             "user": str | null,                     # effective uid (/proc/PID/status), named
             "pod_uid": str | null, "pod_namespace": str | null, "pod_name": str | null,
             "pod_source": str | null,               # where name/namespace came from
             "qos": "guaranteed" | "burstable" | "besteffort" | null,
             "container_id": str | null,
             "container_runtime": "containerd" | "cri-o" | "docker" | "podman" | ... | null,
             "slurm_job": str | null, "slurm_step": str | null,
             "unit": str | null, "user_unit": bool,  # a systemd unit (a user manager's)
             "session": str | null,                  # a logind session (session-N.scope)
             "reason": "<reason>" | null, "detail": str | null}
    (Each is set only where the path names it as kubelet, the container runtime, slurmd or
    systemd write it: `base.cgroupname`; never guessed from a process's name.)

    APP = {"app": "Handy", "selected": str | null, "evidence": "settings",
           "last_event": str | null, "last_event_model": str | null,
           "last_event_time": str | null, "reasons": [str, ...]}

Compatibility: new keys may be added within schema_version 1; removing or renaming a key,
or changing a value's meaning, bumps it.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from typing import Any

from gputaskman import __version__
from gputaskman.base import schema
from gputaskman.base.fmt import KIND_MARK, NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import (
    DeviceMetrics,
    Kind,
    Problem,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.render.report_health import adapter_json, mig_ref_json
from gputaskman.render.report_models import (
    BREAKDOWN_PARTS,
    app_json,
    breakdown_json,
    gtt_text,
    model_cell,
    model_json,
    model_lines,
    model_mark,
    system_json,
)
from gputaskman.render.report_owners import memory_json, owner_json, totals_json
from gputaskman.sampling import host

SCHEMA = schema.NAME
SCHEMA_VERSION = schema.VERSION

HOST_SOURCE = "host"

# Looks up the host's per-process readings (ram_bytes, cpu_percent) for (pid, create_time).
ProcHostLookup = Callable[[int, float | None], Mapping[str, Reading]]


# ---------------------------------------------------------------------------- JSON


def problem_json(p: Problem) -> dict[str, Any]:
    return {"where": p.where, "reason": str(p.reason), "detail": p.detail, "adapter": p.adapter}


def _metrics_json(m: DeviceMetrics | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {name: reading_json(r) for name, r in fields_of(m).items()}


def system_document(system: host.HostSample | None) -> Any:
    """The ``system`` object of the JSON document, from whichever host sample was given."""
    if system is None:
        return None
    if isinstance(system, host.SystemInfo):
        return system_json(system)
    return system.to_json_dict()


# Two create times closer than this belong to the same process (both come from the same
# /proc/PID/stat arithmetic, so in practice they are equal; the slack absorbs float noise).
SAME_PROCESS_SECS = 0.5


def _usage_readings(system: host.SystemInfo, pid: int, ct: float | None) -> Mapping[str, Reading]:
    u = system.processes.get(pid)
    if u is None:
        return {}
    if ct is not None and u.create_time is not None and abs(u.create_time - ct) > SAME_PROCESS_SECS:
        return {}  # the PID was reused between the GPU sample and the host sample
    src = f"/proc/{pid}/stat"
    ram = (
        Reading.measured(u.rss_bytes, f"{src} (rss)")
        if u.rss_bytes is not None
        else Reading.missing(u.rss_reason or Reason.UNAVAILABLE, src)
    )
    cpu = (
        Reading.measured(round(u.cpu_percent, 1), f"{src} (utime+stime delta)")
        if u.cpu_percent is not None
        else Reading.missing(u.cpu_reason or Reason.UNAVAILABLE, src, u.cpu_detail)
    )
    return {"ram_bytes": ram, "cpu_percent": cpu}


def proc_host_lookup(system: host.HostSample | None) -> ProcHostLookup:
    """The per-process host readings provider for `system` (a live `SystemInfo`, or a
    `host.HostView`'s ``process_readings``). A process the host sample does not have yields
    nothing, and the caller shows a missing reading, never zeros."""
    if system is None:
        return _no_host_readings
    if isinstance(system, host.SystemInfo):
        sysinfo = system
        return lambda pid, ct: _usage_readings(sysinfo, pid, ct)
    return system.process_readings


__all__ = [
    "BREAKDOWN_PARTS",
    "KIND_MARK",
    "NA",
    "app_json",
    "breakdown_json",
    "fmt_bytes",
    "fmt_reading",
    "gtt_text",
    "model_cell",
    "model_json",
    "model_lines",
    "model_mark",
    "null_rule_violations",
    "reading_json",
    "system_json",
    "to_json_dict",
]


def _no_host_readings(pid: int, create_time: float | None) -> Mapping[str, Reading]:
    return {}


def _host_readings(
    lookup: ProcHostLookup, p: ProcGpu, system: host.HostSample | None
) -> dict[str, Any]:
    # a row of another OS (the Windows host seen from WSL) must not pick up the readings
    # of whatever process has the same PID here
    got = (lookup(p.pid, p.create_time) or {}) if p.host is None else {}
    out: dict[str, Any] = {}
    for key in ("ram_bytes", "cpu_percent"):
        r = got.get(key)
        if r is None:
            detail = "host not sampled" if system is None else "process not in host sample"
            if p.host is not None:
                detail = f"a {p.host} process: not in this machine's host sample"
            r = Reading.missing(Reason.UNAVAILABLE, HOST_SOURCE, detail)
        out[key] = reading_json(r)
    return out


def process_json(
    p: ProcGpu, lookup: ProcHostLookup, system: host.HostSample | None
) -> dict[str, Any]:
    d = p.detail
    row: dict[str, Any] = {
        "pid": p.pid,
        "started_at": p.create_time,
        "name": p.name,
        "gpu": p.adapter,
        "contexts": list(p.contexts),
        "vram_bytes": reading_json(p.dedicated),
        "vram_inferred_bytes": reading_json(p.inferred),
        "inferred_unique": p.unique,
        "shown_vram": reading_json(p.shown_vram),
        "paged_bytes": reading_json(p.paged),
        "footprint_bytes": reading_json(p.footprint),
        "host": p.host,
        "parent_pid": p.parent_pid,
        "engines": {k: reading_json(v) for k, v in p.engines.items()},
        "mig": mig_ref_json(p.mig),
    }
    row.update(_host_readings(lookup, p, system))
    row.update(memory_json(p.memory))
    row["owner"] = owner_json(p.owner)
    row.update(
        {
            "cmdline": None if d.cmdline is None else list(d.cmdline),
            "runtimes": list(d.runtimes),
            "model_files": list(d.model_files),
            "category": d.category,
            "scanned": d.scanned,
            "scan_reason": None if d.reason is None else str(d.reason),
            "scan_detail": d.reason_detail,
            "exe": d.exe,
            "user": d.user,
            "ppid": d.ppid,
            "model_evidence": [{"evidence": e, "path": path} for e, path in d.model_evidence],
            "model": model_json(p.model),
            "breakdown": breakdown_json(p.breakdown),
            "app_model": app_json(p.app_model),
        }
    )
    return row


def _process_list_status(snapshot: Snapshot, pci: str) -> dict[str, Any]:
    status: dict[str, Any] = {"compute": "ok", "graphics": "ok"}
    for pr in snapshot.problems:
        if pr.is_process_list and pr.adapter == pci:
            status[pr.where.split(".", 1)[1]] = problem_json(pr)
    return status


def utc_of(taken: float) -> _dt.datetime | None:
    """`taken` as a UTC datetime; None for a time no calendar date holds (a replayed file
    may carry any number, and bad input must never crash the report)."""
    try:
        return _dt.datetime.fromtimestamp(taken, tz=_dt.UTC)
    except (ValueError, OverflowError, OSError):
        return None


def _iso(taken: float) -> str | None:
    when = utc_of(taken)
    return None if when is None else when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_json_dict(
    snapshot: Snapshot, system: host.HostSample | None = None, selected_gpu: int | None = None
) -> dict[str, Any]:
    """The ``--json`` object for one snapshot and the host sample taken beside it."""
    lookup = proc_host_lookup(system)
    taken_iso = _iso(snapshot.taken)
    adapters = []
    for a in snapshot.adapters:
        adapters.append(
            {
                "index": a.index,
                "vendor": a.vendor,
                "name": a.name,
                "uuid": a.uuid,
                "pci_bus_id": a.pci_bus_id,
                "backend": a.backend,
                "metrics": _metrics_json(snapshot.metrics.get(a.pci_bus_id)),
                "extra_metrics": {
                    k: reading_json(r)
                    for k, r in snapshot.extra_metrics.get(a.pci_bus_id, {}).items()
                },
                "attributed_bytes": snapshot.attributed_on(a.pci_bus_id),
                "attributed_complete": snapshot.attributed_complete_on(a.pci_bus_id),
                "process_list": _process_list_status(snapshot, a.pci_bus_id),
                **adapter_json(snapshot, a.pci_bus_id),
            }
        )
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "gputaskman", "version": __version__},
        "taken": snapshot.taken,
        "taken_iso": taken_iso,
        "backend": snapshot.backend,
        "available": snapshot.available,
        "unavailable": None
        if snapshot.backend_problem is None
        else problem_json(snapshot.backend_problem),
        "driver_version": snapshot.driver_version,
        "selected_gpu": selected_gpu,
        "adapters": adapters,
        "processes": [process_json(p, lookup, system) for p in snapshot.processes],
        "attributed_bytes": snapshot.attributed,
        "attributed_complete": snapshot.attributed_complete,
        "problems": [problem_json(p) for p in snapshot.problems],
        "notes": list(snapshot.notes),
        "system": system_document(system),
        "owner_totals": totals_json(snapshot),
    }


# ---------------------------------------------------------------------------- checking

_READING_KEYS = frozenset({"value", "kind", "source", "reason", "detail"})
_KINDS = frozenset(str(k) for k in Kind)
_REASONS = frozenset(str(r) for r in Reason)
# Bare numbers allowed outside reading objects: identities, times and measured sums.
PLAIN_NUMBER_KEYS = frozenset(
    {
        "schema_version",
        "taken",
        "index",
        "pid",
        "parent_pid",  # a PID, an identity
        "ppid",  # the parent's PID, an identity
        "started_at",
        "attributed_bytes",
        "selected_gpu",
        "parameter_count",  # a fact of the model file, not a reading of memory
        "n_ctx",  # the context the runtime was set to (n_ctx_source says where from)
        "gpu_instance_id",  # a MIG instance's identity
        "compute_instance_id",
        "pids",  # an owner's processes (owner_totals), identities
    }
)


def null_rule_violations(doc: Mapping[str, Any]) -> list[str]:
    """Every place a ``--json`` object breaks the null rules (empty when it keeps them).

    Checks that each reading object has a known kind and a source, that its value is null
    exactly when it carries a known reason, and that no bare number appears outside a
    reading except identities, times, measured sums and model facts. The whole document is
    checked, ``system`` included.
    """
    out: list[str] = []

    def visit(node: Any, path: str, key: str | None) -> None:
        if isinstance(node, Mapping):
            if set(node) == _READING_KEYS:
                v, reason, kind = node["value"], node["reason"], node["kind"]
                if not isinstance(reason, str | None):
                    out.append(f"{path}: reason {reason!r} is not a string")
                    reason = "?"
                if not isinstance(kind, str) or kind not in _KINDS:
                    out.append(f"{path}: unknown kind {node['kind']!r}")
                if not isinstance(node["source"], str) or not node["source"]:
                    out.append(f"{path}: no source")
                if v is None and reason not in _REASONS:
                    out.append(f"{path}: null without a known reason")
                if v is not None and reason is not None:
                    out.append(f"{path}: value {v!r} with reason {reason!r}")
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    out.append(f"{path}: value {v!r} is not a number")
                return
            for k, child in node.items():
                visit(child, f"{path}.{k}", str(k))
        elif isinstance(node, list):
            for i, child in enumerate(node):
                visit(child, f"{path}[{i}]", key)
        elif (
            isinstance(node, (int, float))
            and not isinstance(node, bool)
            and key not in PLAIN_NUMBER_KEYS
        ):
            out.append(f"{path}: bare number {node!r} outside a reading")

    visit(doc, "$", None)
    return out
