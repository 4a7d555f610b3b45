"""``gputaskman diff BEFORE.json AFTER.json``: which memory moved between two saved snapshots.

Theory of operation
-------------------
Works on saved ``--json`` objects only, never on live state, as `document.reader` reads them
(`Document`). Three steps:

1. **Pair adapters.** By UUID when both sides have one, else by (vendor, PCI address).
   The same PCI address with a different vendor or UUID, or two snapshots whose addressed
   adapters have none in common, are *conflicting adapters*: the snapshots describe
   different GPUs and `diff` refuses (exit 3) rather than compare unrelated memory. An
   adapter without an address can only be paired by name; that happens only when the
   name is unique on both sides and always carries a ``name-only`` warning, because two
   cards of one model look the same by name. Two adapters that share a name are never
   paired by name when their addresses can tell them apart.
2. **Pair process rows** by PID on paired adapters (rows with no GPU context pair with
   rows with none). When both ``started_at`` values are valid times more than
   `SAME_PROCESS_SECS` apart, the PID was reused by a different process: the two rows are
   never paired, whatever else matches. An unknown start time (null, or not after 1970)
   never conflicts, so snapshots without one pair by PID as before.
3. **Compare fields**, sorted into sections by the kind the snapshot recorded. Fields in
   `MEASURED` (driver memory counters, the measured per-process VRAM and the measured
   sums) are compared directly with a byte delta. Byte readings of kind inferred,
   runtime-reported or estimated go to their own sections and are never mixed into the
   measured one. The byte readings of a process row are its VRAM (measured, inferred),
   paged and footprint bytes and the parts and totals of its breakdown; host RAM/CPU is
   not GPU memory and is ignored.

Unknown is never 0: a field that is null on one side "became known" or "became unknown"
(with the reason), a row missing on one side is "not listed", and no delta is computed
from either. A field whose kind differs between the two sides is shown, not subtracted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import Breakdown, ProcGpu, Reading
from gputaskman.document.reader import AdapterDoc, Document, ProcessDoc
from gputaskman.render import report
from gputaskman.render.report_models import breakdown_totals, breakdown_view

SAME_PROCESS_SECS = report.SAME_PROCESS_SECS

# Byte counts compared directly when their reading is measured (adapter metrics, the
# measured sums, the driver's per-process VRAM). Add a new measured byte count here.
MEASURED = (
    "memory_used_bytes",
    "memory_total_bytes",
    "memory_reserved_bytes",
    "gtt_used_bytes",  # amdgpu: system memory the GPU has mapped (extra_metrics)
    "gtt_total_bytes",
    "attributed_bytes",
    "vram_bytes",
)
SECTIONS = ("measured", "inferred", "runtime", "estimated")
SECTION_TITLES = {
    "measured": "MEASURED (driver counters and sums of them, compared directly)",
    "inferred": "INFERRED (derived values; never summed)",
    "runtime": "RUNTIME-REPORTED (what a runtime says about itself)",
    "estimated": "ESTIMATED (computed from a model, not observed)",
}
EXIT_REFUSED = 3
EXIT_BAD_INPUT = 2


class Refused(Exception):
    """The snapshots describe different GPUs; the message says which."""


# ---------------------------------------------------------------------------- fields


@dataclass(frozen=True, slots=True)
class Value:
    """One side of a field: the recorded value (None when unknown) and why."""

    value: float | None
    kind: str
    reason: str | None = None

    def json(self) -> dict[str, Any]:
        return {"value": self.value, "kind": self.kind, "reason": self.reason}


def _value(r: Reading) -> Value:
    if r.value is None:
        return Value(None, str(r.kind), "unknown" if r.reason is None else str(r.reason))
    return Value(r.value, str(r.kind), None)


def _sum_value(v: int | None) -> Value:
    """A plain measured sum (``attributed_bytes``): null means nothing was measured."""
    if v is not None:
        return Value(v, "measured")
    return Value(None, "measured", "nothing measured")


def _byte_values(readings: Iterable[tuple[str, Reading | None]]) -> dict[str, Value]:
    """The byte counts (``*_bytes``) among `readings` that were recorded, as `Value`s."""
    return {n: _value(r) for n, r in readings if r is not None and n.endswith("_bytes")}


def adapter_fields(a: AdapterDoc) -> dict[str, Value]:
    out = {} if a.metrics is None else _byte_values(fields_of(a.metrics).items())
    out.update(_byte_values(a.extra_metrics.items()))
    out["attributed_bytes"] = _sum_value(a.attributed_bytes)
    return out


def system_fields(doc: Document) -> dict[str, Value] | None:
    """The host's RAM and swap byte readings (``memory.used_bytes``...), None without a
    system sample. They are the OS's own counters, never GPU memory and never in a total."""
    system = doc.system
    if system is None:
        return None
    out = _byte_values((f"memory.{k}", r) for k, r in system.memory.items())
    s = system.swap
    if s is not None:
        swap = (("total_bytes", s.total_bytes), ("free_bytes", s.free_bytes))
        out.update(_byte_values((f"swap.{k}", r) for k, r in (*swap, ("used_bytes", s.used_bytes))))
    return out


def _breakdown_readings(view: Breakdown | None) -> Iterator[tuple[str, Value]]:
    """The weights / KV / compute parts (each part's chosen reading, not its alternatives)
    and the runtime-reported and estimated totals of a breakdown."""
    view = breakdown_view(view)
    if view is None:
        return
    for part in view.parts:
        yield f"breakdown.{part.name}", _value(part.reading)
    reported, estimated = breakdown_totals(view)
    yield "breakdown.reported_total", _value(reported)
    yield "breakdown.estimated_total", _value(estimated)


def process_fields(p: ProcGpu) -> dict[str, Value]:
    fields = _byte_values(
        (
            ("vram_bytes", p.dedicated),
            ("vram_inferred_bytes", p.inferred),
            ("paged_bytes", p.paged),
            ("footprint_bytes", p.footprint),
        )
    )
    fields.update(_breakdown_readings(p.breakdown))
    return fields


def _section(name: str, kind: str) -> str | None:
    if kind == "measured":
        measured = name.rsplit(".", 1)[-1] in MEASURED or name.startswith(("memory.", "swap."))
        return "measured" if measured else None
    return kind if kind in SECTIONS else None


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    section: str
    before: Value | None  # None: the row is not listed in that snapshot
    after: Value | None
    change: str
    delta: float | None = None

    def json(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "section": self.section,
            "before": None if self.before is None else self.before.json(),
            "after": None if self.after is None else self.after.json(),
            "change": self.change,
            "delta": self.delta,
        }


def compare_fields(
    before: Mapping[str, Value] | None, after: Mapping[str, Value] | None
) -> list[FieldChange]:
    """Field-by-field changes; `before`/`after` None means the row is not listed there."""
    names = list(dict.fromkeys([*(before or {}), *(after or {})]))
    out = []
    for name in names:
        b = None if before is None else before.get(name)
        a = None if after is None else after.get(name)
        kinds = {v.kind for v in (b, a) if v is not None}
        section = next((s for k in kinds if (s := _section(name, k))), None)
        if section is None:
            continue
        if before is None:
            change, delta = "not listed before", None
        elif after is None:
            change, delta = "not listed after", None
        elif b is None or a is None:
            change, delta = "not recorded on one side", None
        elif b.kind != a.kind:
            change, delta = f"kind changed ({b.kind} -> {a.kind}); not compared", None
        elif b.value is not None and a.value is not None:
            delta = a.value - b.value
            change = "unchanged" if delta == 0 else "changed"
        elif b.value is None and a.value is not None:
            change, delta = "became known", None
        elif b.value is not None:
            change, delta = "became unknown", None
        else:
            change, delta = "unknown in both", None
        out.append(FieldChange(name, section, b, a, change, delta))
    return out


# ---------------------------------------------------------------------------- pairing


def _text(v: object) -> str | None:
    return v.strip().lower() if isinstance(v, str) and v.strip() else None


UNPAIRED = "\0unpaired"  # the bus of a row whose adapter has no partner: pairs with nothing


def _ident(a: AdapterDoc) -> dict[str, Any]:
    return {**a.identity(), "backend": a.backend}  # diff also names the backend of each side


def _label(a: AdapterDoc) -> str:
    return f"{a.vendor or '?'} {a.name or 'n/a'} at {a.pci_bus_id or '?'}"


@dataclass
class AdapterPairing:
    pairs: list[tuple[AdapterDoc, AdapterDoc, str]] = field(default_factory=list)
    only_before: list[AdapterDoc] = field(default_factory=list)
    only_after: list[AdapterDoc] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    bus_map: dict[str | None, str | None] = field(default_factory=lambda: {None: None})


def pair_adapters(bs: tuple[AdapterDoc, ...], as_: tuple[AdapterDoc, ...]) -> AdapterPairing:
    """Pair adapters (see the module docstring); raises `Refused` on conflicting ones."""
    out = AdapterPairing()
    used_b: set[int] = set()
    used_a: set[int] = set()

    def pair(i: int, j: int, how: str) -> None:
        used_b.add(i)
        used_a.add(j)
        out.pairs.append((bs[i], as_[j], how))
        out.bus_map[bs[i].pci_bus_id] = as_[j].pci_bus_id

    def keyed(a: AdapterDoc) -> bool:
        return _text(a.pci_bus_id) is not None and _text(a.vendor) is not None

    # 1. the same UUID is the same card, wherever it sits
    for i, b in enumerate(bs):
        ub = _text(b.uuid)
        for j, a in enumerate(as_):
            if ub is None or i in used_b or j in used_a or ub != _text(a.uuid):
                continue
            moved = _text(b.pci_bus_id) != _text(a.pci_bus_id)
            pair(i, j, "uuid (PCI address changed)" if moved else "uuid")
    # 2. the same PCI address: the same card unless vendor or UUID says otherwise
    for i, b in enumerate(bs):
        if i in used_b or not keyed(b):
            continue
        for j, a in enumerate(as_):
            if j in used_a or not keyed(a):
                continue
            if _text(b.pci_bus_id) != _text(a.pci_bus_id):
                continue
            ub, ua = _text(b.uuid), _text(a.uuid)
            if _text(b.vendor) != _text(a.vendor) or (ub and ua and ub != ua):
                raise Refused(
                    f"conflicting adapters at {b.pci_bus_id}: before is {_label(b)} "
                    f"(uuid {b.uuid}), after is {_label(a)} (uuid {a.uuid})"
                )
            pair(i, j, "pci_bus_id")
            break
    keyed_b = [i for i, b in enumerate(bs) if keyed(b)]
    keyed_a = [j for j, a in enumerate(as_) if keyed(a)]
    if keyed_b and keyed_a and not out.pairs:
        raise Refused(
            "conflicting adapters: before lists "
            + "; ".join(_label(bs[i]) for i in keyed_b)
            + ", after lists "
            + "; ".join(_label(as_[j]) for j in keyed_a)
            + " (no GPU in common)"
        )
    # 3. name-only, for adapters that cannot be compared more exactly: never two adapters
    # whose addresses are both known (different addresses are different cards)
    for i, b in enumerate(bs):
        name = _text(b.name)
        if i in used_b or name is None:
            continue
        cands = [
            j
            for j, a in enumerate(as_)
            if j not in used_a and _text(a.name) == name and not (keyed(b) and keyed(a))
        ]
        if not cands:
            continue
        rivals = [k for k, x in enumerate(bs) if k not in used_b and _text(x.name) == name]
        if len(cands) > 1 or len(rivals) > 1:
            out.warnings.append(
                {
                    "code": "name-only",
                    "message": f"adapters named {b.name!r} cannot be told apart "
                    "(no PCI address on one side and the name is not unique); not compared",
                }
            )
            continue
        pair(i, cands[0], "name-only")
        out.warnings.append(
            {
                "code": "name-only",
                "message": f"{b.name!r} compared by name only: the snapshots do not "
                "both identify it by vendor and PCI address, so it may not be the same GPU",
            }
        )
    out.only_before = [b for i, b in enumerate(bs) if i not in used_b]
    out.only_after = [a for j, a in enumerate(as_) if j not in used_a]
    return out


def valid_start(v: float | None) -> float | None:
    """A usable ``started_at``; anything else is unknown and never conflicts."""
    return float(v) if v is not None and v > 0 else None


def same_process(b: ProcGpu, a: ProcGpu) -> bool:
    sb, sa = valid_start(b.create_time), valid_start(a.create_time)
    return sb is None or sa is None or abs(sb - sa) <= SAME_PROCESS_SECS


@dataclass
class ProcessEntry:
    pid: int
    name: str | None
    before: ProcGpu | None
    after: ProcGpu | None
    fields: list[FieldChange]
    pid_reused: bool = False

    @property
    def status(self) -> str:
        if self.before is None:
            return "not listed before"
        if self.after is None:
            return "not listed after"
        return "paired"

    def json(self) -> dict[str, Any]:
        def side(r: ProcGpu | None) -> dict[str, Any] | None:
            if r is None:
                return None
            return {"started_at": r.create_time, "gpu": r.adapter, "name": r.name}

        return {
            "pid": self.pid,
            "name": self.name,
            "status": self.status,
            "pid_reused": self.pid_reused,
            "before": side(self.before),
            "after": side(self.after),
            "fields": [f.json() for f in self.fields],
        }


def pair_processes(
    before: tuple[ProcessDoc, ...], after: tuple[ProcessDoc, ...], pairing: AdapterPairing
) -> list[ProcessEntry]:
    bs = [r.proc for r in before]
    as_ = [r.proc for r in after]
    taken: set[int] = set()
    reused_after: set[int] = set()
    out: list[ProcessEntry] = []
    for b in bs:
        target = pairing.bus_map.get(b.adapter, UNPAIRED)
        match = None
        reused = False
        for j, a in enumerate(as_):
            if j in taken or a.pid != b.pid or a.adapter != target:
                continue
            if not same_process(b, a):
                reused = True
                reused_after.add(j)
                continue
            match = j
            break
        if match is None:
            fields = compare_fields(process_fields(b), None)
            out.append(ProcessEntry(b.pid, b.name, b, None, fields, reused))
        else:
            taken.add(match)
            a = as_[match]
            fields = compare_fields(process_fields(b), process_fields(a))
            out.append(ProcessEntry(b.pid, a.name or b.name, b, a, fields))
    for j, a in enumerate(as_):
        if j not in taken:
            fields = compare_fields(None, process_fields(a))
            out.append(ProcessEntry(a.pid, a.name, None, a, fields, j in reused_after))
    return out


# ---------------------------------------------------------------------------- diff

LOWER_BOUND = "lower bound (memory hidden or a process list failed); not compared"


def _lower_bound(f: FieldChange, b: AdapterDoc, a: AdapterDoc) -> FieldChange:
    """A measured sum that is only a lower bound on either side is shown, not subtracted:
    its change could be a process whose memory became hidden, not memory freed."""
    if f.field != "attributed_bytes" or f.delta is None:
        return f
    if b.attributed_complete is True and a.attributed_complete is True:
        return f
    return FieldChange(f.field, f.section, f.before, f.after, LOWER_BOUND, None)


def diff(before: Document, after: Document) -> dict[str, Any]:
    """The ``--json`` diff object; raises `Refused` for conflicting adapters."""
    pairing = pair_adapters(before.adapters, after.adapters)
    warnings = list(pairing.warnings)
    if before.backend != after.backend:
        warnings.append(
            {
                "code": "backend-changed",
                "message": f"backend {before.backend} -> {after.backend}: "
                "counters may come from different APIs",
            }
        )
    adapters: list[dict[str, Any]] = []
    for b, a, how in pairing.pairs:
        fields = compare_fields(adapter_fields(b), adapter_fields(a))
        adapters.append(
            {
                "before": _ident(b),
                "after": _ident(a),
                "paired_by": how,
                "status": "paired",
                "fields": [_lower_bound(f, b, a).json() for f in fields],
            }
        )
    for b in pairing.only_before:
        adapters.append(
            {
                "before": _ident(b),
                "after": None,
                "paired_by": None,
                "status": "not listed after",
                "fields": [f.json() for f in compare_fields(adapter_fields(b), None)],
            }
        )
    for a in pairing.only_after:
        adapters.append(
            {
                "before": None,
                "after": _ident(a),
                "paired_by": None,
                "status": "not listed before",
                "fields": [f.json() for f in compare_fields(None, adapter_fields(a))],
            }
        )
    procs = pair_processes(before.processes, after.processes, pairing)
    tb, ta = before.taken, after.taken
    return {
        "schema": "gputaskman.offline.diff",
        "schema_version": 1,
        "before": {"taken": tb, "taken_iso": before.taken_iso, "backend": before.backend},
        "after": {"taken": ta, "taken_iso": after.taken_iso, "backend": after.backend},
        "elapsed_s": ta - tb,
        "same_process_secs": SAME_PROCESS_SECS,
        "warnings": warnings,
        "adapters": adapters,
        "processes": [p.json() for p in procs],
        "system": [f.json() for f in compare_fields(system_fields(before), system_fields(after))],
    }
