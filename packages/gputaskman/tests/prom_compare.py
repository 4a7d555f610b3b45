"""One host's snapshot document as its serve answered it, against the one the fleet built
from the series that serve exported to Prometheus (`fleet.promseries`): every field serve
exports must agree (lower bounds, process rows without a GPU and the driver version
included), and every field it does not export must be unknown on the Prometheus side,
saying so ("not exported to Prometheus"), never a made-up value.

Unknown and absent are one thing here: serve exports no series for either, so a reading
that is ``null`` on one side and unknown on the other agree, whatever their reasons. The
one thing Prometheus cannot tell apart is "no swap device" from "unknown" (serve exports no
device series for either): a host without devices reads ``null`` with "no series in
Prometheus" there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NOT_EXPORTED = "not exported to Prometheus"
NO_SERIES = "no series in Prometheus"
NA = "n/a"

# the system panel's readings serve exports, by section
SYSTEM_EXPORTED = {
    "memory": ("total_bytes", "available_bytes", "used_bytes", "cached_bytes"),
    "swap": ("total_bytes", "used_bytes"),
    "cpu": ("percent",),
}
SYSTEM_NOT_EXPORTED = {
    "memory": ("free_bytes", "buffers_bytes", "shared_bytes"),
    "swap": ("free_bytes",),
    "cpu": ("logical_cpus", "load_1", "load_5", "load_15"),
}
# a process row's readings serve exports
PROCESS_READINGS = (
    "vram_bytes",
    "vram_inferred_bytes",
    "shown_vram",
    "paged_bytes",
    "footprint_bytes",
    "ram_bytes",
    "cpu_percent",
    "swapped_bytes",
    "locked_bytes",
    "pinned_bytes",
)
# an owner's fields serve exports (gputaskman_process_owner_info's labels)
OWNER_EXPORTED = (
    "cgroup",
    "user",
    "pod_uid",
    "pod_namespace",
    "pod_name",
    "qos",
    "container_id",
    "container_runtime",
    "slurm_job",
    "slurm_step",
    "unit",
    "user_unit",
    "session",
)
# a process row's fields serve does not export, and what the Prometheus side has for each
PROCESS_NOT_EXPORTED: dict[str, Any] = {
    "started_at": None,
    "cmdline": None,
    "runtimes": [],
    "model_files": [],
    "category": None,
    "scanned": False,
    "scan_reason": "unavailable",
    "scan_detail": NOT_EXPORTED,
    "exe": None,
    "user": None,
    "ppid": None,
    "model_evidence": [],
    "breakdown": None,
    "app_model": None,
}
MODEL_NOT_EXPORTED: dict[str, Any] = {
    "path": None,
    "store": None,
    "sources": [],
    "api": None,
    "header_error": None,
}


def reading(r: Mapping[str, Any] | None) -> object:
    """A reading as (value, kind); unknown and absent alike as ``n/a``."""
    if r is None or r["value"] is None:
        return NA
    return (r["value"], r["kind"])


def _readings(rs: Mapping[str, Any] | None) -> dict[str, object]:
    """The known readings of a set (an unknown one has no series, like an absent one)."""
    out = {k: reading(r) for k, r in (rs or {}).items()}
    return {k: v for k, v in out.items() if v != NA}


def problem(p: Mapping[str, Any] | None) -> object:
    """A problem as (where, reason, adapter): its detail text is not exported."""
    if p is None:
        return None
    return (p["where"], p["reason"], p["adapter"] or "")


def _state(v: Mapping[str, Any] | None) -> object:
    """A health verdict; of the checks not made, which (why is not exported)."""
    if v is None:
        return None
    return (v["state"], v["reasons"], sorted(u.split(":")[0] for u in v["unchecked"]))


def _mig(m: Mapping[str, Any] | None) -> object:
    """A GPU's MIG state: its mode and each instance whole (the sums derived again)."""
    if m is None or (reading(m["mode"]) == NA and not m["instances"]):
        return None  # a GPU without MIG exports no mode series
    return (
        reading(m["mode"]),
        [
            {**i, **{k: reading(i[k]) for k in ("memory_total_bytes", "memory_used_bytes")}}
            for i in m["instances"]
        ],
    )


def _owner(o: Mapping[str, Any] | None) -> object:
    """An owner as Prometheus has it: only one whose cgroup was read has an info series."""
    if o is None or o["cgroup"] is None:
        return None
    return tuple(o[k] for k in OWNER_EXPORTED)


def _model(m: Mapping[str, Any] | None) -> object:
    return None if m is None else (m["name"], m["evidence"], m["confirmed"])


def _system(s: Mapping[str, Any] | None) -> object:
    if s is None:
        return None
    out: dict[str, object] = {
        f"{section}.{k}": reading((s.get(section) or {}).get(k))
        for section, keys in SYSTEM_EXPORTED.items()
        for k in keys
    }
    devices = (s.get("swap") or {}).get("devices")
    # none listed and unknown look alike in Prometheus (see the module docstring)
    out["swap.devices"] = (
        {
            (d["filename"], d["type"]): (reading(d["size_bytes"]), reading(d["used_bytes"]))
            for d in devices
        }
        if devices
        else "none or n/a"
    )
    return out


def exported(doc: Mapping[str, Any]) -> dict[str, object]:
    """Every field of a snapshot document that ``serve`` exports to Prometheus."""
    out: dict[str, object] = {
        k: doc[k]
        for k in (
            "taken",
            "backend",
            "available",
            "driver_version",
            "attributed_bytes",
            "attributed_complete",
        )
    }
    out["unavailable"] = problem(doc["unavailable"])
    out["problems"] = sorted(problem(p) for p in doc["problems"])  # type: ignore[type-var]
    for a in doc["adapters"]:
        where = f"adapter {a['pci_bus_id']}"
        out[where] = {
            **{k: a[k] for k in ("index", "vendor", "name", "uuid", "backend")},
            **{k: a[k] for k in ("attributed_bytes", "attributed_complete")},
            "metrics": _readings(a["metrics"]),
            "extra_metrics": _readings(a["extra_metrics"]),
            "process_list": {
                k: v if v == "ok" else problem(v) for k, v in a["process_list"].items()
            },
            "health": _readings(a.get("health")),
            "health_state": _state(a.get("health_state")),
            "mig": _mig(a.get("mig")),
        }
    for p in doc["processes"]:
        where = f"process {p['host'] or ''}:{p['pid']} on {p['gpu']}"
        out[where] = {
            **{k: p[k] for k in ("name", "contexts", "parent_pid", "inferred_unique")},
            **{k: reading(p[k]) for k in PROCESS_READINGS},
            "engines": _readings(p["engines"]),
            "model": _model(p["model"]),
            "mig": p.get("mig"),
            "swapped_to": p.get("swapped_to"),
            "owner": _owner(p.get("owner")),
        }
    out["owner_totals"] = doc.get("owner_totals")
    out["system"] = _system(doc["system"])
    return out


def differences(direct: Mapping[str, Any], prom: Mapping[str, Any]) -> list[str]:
    """Where the two documents disagree on a field serve exports (empty: nowhere)."""
    a, b = exported(direct), exported(prom)
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            out.append(f"{key}: gone from the Prometheus side")
        elif key not in a:
            out.append(f"{key}: only on the Prometheus side")
        elif isinstance(a[key], dict) and isinstance(b[key], dict):
            for k in sorted(set(a[key]) | set(b[key]), key=str):  # type: ignore[arg-type]
                x, y = a[key].get(k, "absent"), b[key].get(k, "absent")  # type: ignore[union-attr]
                if x != y:
                    out.append(f"{key} {k}: direct {x!r}, Prometheus {y!r}")
        elif a[key] != b[key]:
            out.append(f"{key}: direct {a[key]!r}, Prometheus {b[key]!r}")
    return out


def not_exported_violations(prom: Mapping[str, Any]) -> list[str]:
    """Where a document built from series has a value for a field serve does not export
    (it must be unknown, saying "not exported to Prometheus")."""
    out = []
    for p in prom["processes"]:
        where = f"process {p['pid']} on {p['gpu']}"
        for k, want in PROCESS_NOT_EXPORTED.items():
            if p[k] != want:
                out.append(f"{where} {k}: {p[k]!r}, not {want!r}")
        m = p["model"]
        for k, want in MODEL_NOT_EXPORTED.items():
            if m is not None and m[k] != want:
                out.append(f"{where} model {k}: {m[k]!r}, not {want!r}")
    s = prom["system"]
    if s is not None:
        if s["taken"] is not None:
            out.append(f"system taken: {s['taken']!r}, not null")
        rs = [(f"{sec}.{k}", s[sec][k]) for sec, keys in SYSTEM_NOT_EXPORTED.items() for k in keys]
        rs += [
            (f"swap device {d['filename']} priority", d["priority"])
            for d in s["swap"]["devices"] or ()
        ]
        for where, r in rs:
            if r["value"] is not None or r["detail"] != NOT_EXPORTED:
                out.append(f"{where}: {r!r} is not unknown ({NOT_EXPORTED})")
    return out
