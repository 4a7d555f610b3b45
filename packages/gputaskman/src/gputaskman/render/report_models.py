"""JSON and text for what modelinfo found: the model, its weights / KV / compute view, the
system object.

Theory of operation
-------------------
`model_json` and `breakdown_json` write `ProcGpu.model` and `ProcGpu.breakdown` (an
`llm.LlmView`) in the ``--json`` shape documented in `report`: every byte count is a reading
object, so estimates carry kind ``estimated`` and runtime reports kind ``runtime``, and none
of them is ever part of a measured sum. `model_lines` is the same information as text for
``--once`` and the TUI inspector; `model_cell` the table's MODEL column. `system_json` writes
host.py's `SystemInfo` (or the `reader.SystemDoc` replay read back) with reading objects
(kind ``measured``: the OS's own counters, the source naming the file), so the whole
document follows one null rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import Breakdown, Kind, ModelRef, ProcGpu, Reading, Reason
from gputaskman.document.reader import SwapDeviceDoc, SwapDoc, SystemDoc
from gputaskman.intel.apps import AppModel
from gputaskman.intel.llm import LlmView
from gputaskman.sampling import duvmpool, host


def system_doc(info: host.SystemInfo) -> SystemDoc:
    """A host sample as the ``system`` object holds it: swap device numbers become readings
    of /proc/swaps (unknown when the line had none)."""
    s, src = info.swap, "/proc/swaps"
    devices = None
    if s.devices is not None:
        devices = tuple(
            SwapDeviceDoc(
                d.filename,
                d.type,
                _os_reading(d.size_bytes, src),
                _os_reading(d.used_bytes, src),
                _os_reading(d.priority, src),
                d.deleted,
            )
            for d in s.devices
        )
    return SystemDoc(
        taken=info.taken,
        memory=fields_of(info.memory),
        swap=SwapDoc(
            s.total_bytes, s.free_bytes, s.used_bytes, devices, s.devices_reason, s.problems
        ),
        cpu=fields_of(info.cpu),
        processes_reason=info.processes_reason or None,
        duvm=info.duvm,
    )


def system_json(system: host.SystemInfo | SystemDoc) -> dict[str, Any]:
    """The ``system`` object: every number a reading object (OS-reported, kind measured),
    from a host sample or from a recorded one (`reader.SystemDoc`, in replay)."""
    doc = system_doc(system) if isinstance(system, host.SystemInfo) else system
    out: dict[str, Any] = {
        "taken": doc.taken,
        "kind": Kind.MEASURED.value,
        "memory": {n: reading_json(r) for n, r in doc.memory.items()},
    }
    s = doc.swap
    if s is not None:
        swap: dict[str, Any] = {
            n: reading_json(r)
            for n, r in (
                ("total_bytes", s.total_bytes),
                ("free_bytes", s.free_bytes),
                ("used_bytes", s.used_bytes),
            )
            if r is not None
        }
        swap["devices"] = None
        if s.devices is not None:
            swap["devices"] = [
                {
                    "filename": d.filename,
                    "type": d.type,
                    "size_bytes": reading_json(d.size_bytes),
                    "used_bytes": reading_json(d.used_bytes),
                    "priority": reading_json(d.priority),
                    "deleted": d.deleted,
                }
                for d in s.devices
            ]
        swap["devices_reason"] = s.devices_reason
        swap["problems"] = list(s.problems)
        out["swap"] = swap
    out["cpu"] = {n: reading_json(r) for n, r in doc.cpu.items()}
    if doc.processes_reason:
        out["processes_reason"] = doc.processes_reason
    if doc.duvm is not None:  # duvm pool (duvmpool.PoolInfo): kind runtime, never summed
        out["duvm"] = duvmpool.pool_json(doc.duvm)
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


def app_json(app: object | None) -> dict[str, object] | None:
    """An app adapter's `AppModel` as JSON."""
    if app is None:
        return None
    if not isinstance(app, AppModel):
        raise TypeError(f"app_model must be an apps.AppModel, got {type(app)!r}")
    return app.to_json()


BREAKDOWN_PARTS = ("weights", "kv_cache", "compute", "other")
# A runtime's own figures beside the parts (`breakdown.runtime_figures`), in words.
FIGURE_NAMES = {
    "model_vram_bytes": "runtime: model in VRAM",
    "model_size_bytes": "runtime: model size",
    "kv_pool_tokens": "runtime: KV pool tokens",
    "kv_used_percent": "runtime: KV pool used %",
    "kv_used_bytes": "runtime: KV pool used",
    "gpu_memory_fraction_percent": "runtime: GPU memory share %",
}


def breakdown_view(view: Breakdown | None) -> LlmView | None:
    """`ProcGpu.breakdown` as the `llm.LlmView` it holds (live or read back), None when the
    process has none."""
    if view is None:
        return None
    if not isinstance(view, LlmView):
        raise TypeError(f"breakdown must be an llm.LlmView, got {type(view)!r}")
    return view


def breakdown_totals(view: LlmView) -> tuple[Reading, Reading]:
    """The runtime-reported and the estimated total of a breakdown, as readings (unknown
    when no part is of that kind); never added to a measured total."""
    reported = (
        Reading.runtime(view.reported_total, "sum of runtime-reported parts")
        if view.reported_total is not None
        else Reading.missing(
            Reason.UNAVAILABLE,
            "sum of runtime-reported parts",
            "no part runtime-reported",
            Kind.RUNTIME,
        )
    )
    estimated = (
        Reading.estimated(view.estimated_total, "sum of estimated parts")
        if view.estimated_total is not None
        else Reading.missing(
            Reason.UNAVAILABLE, "sum of estimated parts", "no part estimated", Kind.ESTIMATED
        )
    )
    return reported, estimated


def breakdown_json(view: Breakdown | None) -> dict[str, Any] | None:
    """An `llm.LlmView` (live, or read back from a recording) as reading objects."""
    view = breakdown_view(view)
    if view is None:
        return None
    parts = {}
    for part in view.parts:
        parts[part.name] = {
            "reading": reading_json(part.reading),
            "marker": part.marker or None,
            "alternatives": [reading_json(a) for a in part.alternatives],
        }
    reported, estimated = breakdown_totals(view)
    return {
        "model": view.model,
        "path": view.path,
        "evidence": view.evidence,
        "status": view.status,
        "owner_marker": view.owner_marker or None,
        "runtime": view.runtime,
        "architecture": view.architecture,
        "file_type": view.file_type,
        "parameter_count": view.parameter_count,
        "n_ctx": view.n_ctx,
        "n_ctx_source": view.n_ctx_source,
        "parts": parts,
        "reported_total": reading_json(reported),
        "estimated_total": reading_json(estimated),
        "notes": list(view.notes),
        "format": view.format,
        "kv_cache_dtype": view.kv_cache_dtype,
        # null: no runtime answered for the model (and in files written before the key was)
        "runtime_figures": None
        if view.figures is None
        else {n: reading_json(r) for n, r in view.figures},
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
    selected = None if p.app_model is None else p.app_model.selected
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
    m, vv = p.model, breakdown_view(p.breakdown)
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
            lines.append(f"  model header: {m.header_error}")
        if m.pending:
            lines.append("  looking at API, header and logs…")
        elif m.status == "informational":
            lines.append("  path-arg only: informational, no breakdown")
    app = p.app_model
    if app is not None and app.selected is not None:
        lines.append(f"{app.app}: selected model {app.selected} (a setting, not residency)")
    if vv is None:
        return lines
    lines.append(
        f"  {vv.format + ' ' if vv.format else ''}{vv.architecture or 'n/a'} {vv.file_type or ''}"
        f"  params {_count(vv.parameter_count)}"
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
    if vv.kv_cache_dtype:
        lines.append(f"  KV cache dtype {vv.kv_cache_dtype}")
    for name, r in vv.figures or ():
        as_bytes = name.endswith("_bytes")
        lines.append(
            f"  {FIGURE_NAMES.get(name, name)} {fmt_reading(r, as_bytes=as_bytes)}"
            f"  [{r.kind}, {r.source}]"
        )
    lines += [f"  note: {n}" for n in vv.notes]
    return lines
