"""JSON and text for what modelinfo found: the model, its weights / KV / compute view, the
system object.

Theory of operation
-------------------
`model_json` and `breakdown_json` write `ProcGpu.model` and `ProcGpu.breakdown` (an
`llm.LlmView`) in the ``--json`` shape documented in `report`: every byte count is a reading
object, so estimates carry kind ``estimated`` and runtime reports kind ``runtime``, and none
of them is ever part of a measured sum. `model_lines` is the same information as text for
``--once`` and the TUI inspector; `model_cell` the table's MODEL column. `system_json` writes
host.py's `SystemInfo` with reading objects (kind ``measured``: the OS's own counters, the
source naming the file), so the whole document follows one null rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.readings import Kind, ModelRef, ProcGpu, Reading, Reason
from gputaskman.core import host


def system_json(info: host.SystemInfo) -> dict[str, Any]:
    """The ``system`` object: every number a reading object (OS-reported, kind measured)."""
    m, s, c = info.memory, info.swap, info.cpu
    devices = None
    if s.devices is not None:
        devices = []
        src = "/proc/swaps"
        for d in s.devices:
            devices.append(
                {
                    "filename": d.filename,
                    "type": d.type,
                    "size_bytes": reading_json(_os_reading(d.size_bytes, src)),
                    "used_bytes": reading_json(_os_reading(d.used_bytes, src)),
                    "priority": reading_json(_os_reading(d.priority, src)),
                    "deleted": d.deleted,
                }
            )
    out: dict[str, Any] = {
        "taken": info.taken,
        "kind": Kind.MEASURED.value,
        "memory": {n: reading_json(getattr(m, n)) for n in m.__slots__},
        "swap": {
            "total_bytes": reading_json(s.total_bytes),
            "free_bytes": reading_json(s.free_bytes),
            "used_bytes": reading_json(s.used_bytes),
            "devices": devices,
            "devices_reason": s.devices_reason,
            "problems": list(s.problems),
        },
        "cpu": {n: reading_json(getattr(c, n)) for n in c.__slots__},
    }
    if info.processes_reason:
        out["processes_reason"] = info.processes_reason
    if info.duvm is not None:  # duvm pool (duvmpool.PoolInfo): kind runtime, never summed
        from gputaskman.core import duvmpool

        out["duvm"] = duvmpool.pool_json(info.duvm)
    return out


def _os_reading(v: int | float | None, source: str) -> Reading:
    if v is None:
        return Reading.missing(Reason.UNAVAILABLE, source, "not in the file")
    return Reading.measured(v, source)


def model_json(m: ModelRef | None) -> dict[str, Any] | None:
    if m is None:
        return None
    api = None
    if m.api_runtime is not None or m.api_endpoint is not None or m.api_errors:
        api = {"runtime": m.api_runtime, "endpoint": m.api_endpoint, "errors": list(m.api_errors)}
    return {
        "name": m.name,
        "evidence": m.evidence,
        "confirmed": m.confirmed,
        "status": m.status,
        "sources": list(m.sources),
        "path": m.path,
        "store": m.store,
        "pending": m.pending,
        "api": api,
        "header_error": m.header_error,
    }


def app_json(obj: object | None) -> Any:
    """An app adapter's `AppModel` (or its recorded mapping) as JSON."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return dict(obj)
    fn = getattr(obj, "to_json", None)
    return fn() if callable(fn) else None


BREAKDOWN_PARTS = ("weights", "kv_cache", "compute", "other")


def breakdown_json(view: object | None) -> dict[str, Any] | None:
    """An `llm.LlmView` as reading objects (a recorded mapping passes through as is)."""
    if view is None:
        return None
    if isinstance(view, Mapping):
        return dict(view)
    parts = {}
    for part in getattr(view, "parts", ()):
        parts[part.name] = {
            "reading": reading_json(part.reading),
            "marker": part.marker or None,
            "alternatives": [reading_json(a) for a in part.alternatives],
        }
    v: Any = view
    return {
        "model": v.model,
        "path": v.path,
        "evidence": v.evidence,
        "status": v.status,
        "owner_marker": v.owner_marker or None,
        "runtime": v.runtime,
        "architecture": v.architecture,
        "file_type": v.file_type,
        "parameter_count": v.parameter_count,
        "n_ctx": v.n_ctx,
        "n_ctx_source": v.n_ctx_source,
        "parts": parts,
        "reported_total": reading_json(
            Reading.runtime(v.reported_total, "sum of runtime-reported parts")
            if v.reported_total is not None
            else Reading.missing(
                Reason.UNAVAILABLE,
                "sum of runtime-reported parts",
                "no part runtime-reported",
                Kind.RUNTIME,
            )
        ),
        "estimated_total": reading_json(
            Reading.estimated(v.estimated_total, "sum of estimated parts")
            if v.estimated_total is not None
            else Reading.missing(
                Reason.UNAVAILABLE, "sum of estimated parts", "no part estimated", Kind.ESTIMATED
            )
        ),
        "notes": list(v.notes),
    }


def gtt_text(extra: Mapping[str, Reading]) -> str:
    """amdgpu GTT (system memory the GPU has mapped) as one line."""
    return (
        "GTT (system memory mapped by the GPU) used "
        + fmt_reading(extra.get("gtt_used_bytes"), as_bytes=True, reason=True)
        + " / "
        + fmt_reading(extra.get("gtt_total_bytes"), as_bytes=True, reason=True)
    )


# The MODEL column's marks (the TUI's help screen explains each; its test reads them here).
CONFIRMED_MARK = "✓"  # two of api/mapped/cmdline agree
UNCONFIRMED_MARK = "?"  # one corroborating source only
PENDING_MARK = "…"  # the API/header/log look is still running
SELECTED_TAG = "[selected]"  # an app's selected model: a setting, not residency


def model_mark(m: ModelRef) -> str:
    """``[api✓]`` confirmed, ``[mapped?]`` one corroborating source, ``[path-arg]``
    informational; ``…`` while the API/header/log look is still running."""
    if m.confirmed:
        tag = f"[{m.evidence}{CONFIRMED_MARK}]"
    elif m.status == "informational" or m.evidence in ("path-arg", "installed"):
        tag = f"[{m.evidence}]"
    else:
        tag = f"[{m.evidence}{UNCONFIRMED_MARK}]"
    return tag + (PENDING_MARK if m.pending else "")


def model_cell(p: ProcGpu) -> str:
    """The MODEL column: the model's name with its evidence marker, else an app's selected
    model (a setting, not residency), else mapped model file names."""
    if p.model is not None:
        return f"{p.model.name} {model_mark(p.model)}"
    selected = getattr(p.app_model, "selected", None)
    if selected:
        return f"{selected} {SELECTED_TAG}"
    return ",".join(f.rsplit("/", 1)[-1] for f in p.detail.model_files)


def _count(n: int | None) -> str:
    if n is None:
        return NA
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def model_lines(p: ProcGpu) -> list[str]:
    """The model and its weights / KV / compute / other split, for --once and the inspector.
    Each part shows its reading with provenance marker and source, then the alternatives."""
    m, v = p.model, p.breakdown
    lines: list[str] = []
    if m is not None:
        status = m.status or ("confirmed" if m.confirmed else "unconfirmed")
        lines.append(f"model {m.name} {model_mark(m)}")
        lines.append(f"  evidence {m.evidence} ({status}: {'+'.join(m.sources) or m.evidence})")
        if m.store:
            lines.append(f"  name from the {m.store} store (a name, not evidence)")
        if m.path:
            lines.append(f"  path {m.path}")
        if m.api_endpoint:
            lines.append(f"  {m.api_runtime} API on {m.api_endpoint} (GET only)")
        elif m.api_errors:
            lines.append(f"  API probe: {m.api_errors[0]}")
        if m.header_error:
            lines.append(f"  GGUF header: {m.header_error}")
        if m.pending:
            lines.append("  looking at API, header and logs…")
        elif m.status == "informational":
            lines.append("  path-arg only: informational, no breakdown")
    app = p.app_model
    if app is not None and getattr(app, "selected", None) is not None:
        lines.append(f"{app.app}: selected model {app.selected} (a setting, not residency)")  # type: ignore[attr-defined]
    if v is None or isinstance(v, Mapping):
        return lines
    vv: Any = v
    lines.append(
        f"  {vv.architecture or 'n/a'} {vv.file_type or ''}  params {_count(vv.parameter_count)}"
        f"  n_ctx {NA if vv.n_ctx is None else vv.n_ctx}"
        + (f" ({vv.n_ctx_source})" if vv.n_ctx_source else "")
        + ("  owner ?" if vv.owner_marker else "")
    )
    for part in vv.parts:
        r = part.reading
        text = fmt_reading(r, as_bytes=True, reason=True) + (part.marker or "")
        lines.append(f"  {part.name:<8} {text}  [{r.kind}, {r.source}]")
        for a in part.alternatives:
            lines.append(f"           or {fmt_reading(a, as_bytes=True)}  [{a.kind}, {a.source}]")
    if vv.reported_total is not None:
        lines.append(f"  runtime-reported total {fmt_bytes(vv.reported_total)}")
    if vv.estimated_total is not None:
        lines.append(f"  estimated total {fmt_bytes(vv.estimated_total)} (never added to measured)")
    lines += [f"  note: {n}" for n in vv.notes]
    return lines
