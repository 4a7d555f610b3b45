"""What the fleet shows, UI-free: one row per host and GPU, the fleet's totals, sorting,
filtering, and the text form (``fleet --once``). The TUI's fleet screen and the text output
both build on these, so they never disagree.

Theory of operation
-------------------
`fleet_rows` turns the poller's `HostState`s into `FleetRow`s. A host that is up gives one
row per GPU of its document: memory used / total and utilisation as readings (with their
provenance marks when shown; an Intel card's inferred memory shows ``~``), the processes with
the most memory on that GPU, and the models held there with their evidence markers
(`report_models.model_cell`), with ``UNHEALTHY`` before the name of a GPU whose health
readings say so (`health_flag`); and, not shown but filtered on (`matches`), every
process's name and command line on that GPU. A host whose backend answered without GPUs
gives one row saying why. A host that is not up gives one row whose GPU cell is its status
and reason (and when it last answered, and when the next try is): never zeros, never stale
numbers.

`fleet_totals` adds up only measured memory of hosts that are up: used and total over the
GPUs where both are measured, and how many GPUs that leaves out. Inferred device memory
(``~``), and the estimated (``≈``) and runtime-reported (``ʳ``) model memory of the processes'
weights / KV cache / compute views, are totals of their own, shown apart and never added to
the measured ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.gpuhealth import UNHEALTHY, verdict
from gputaskman.base.readings import Kind, ProcGpu, Reading, Reason
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import AdapterDoc, Document
from gputaskman.fleet.poller import HostState
from gputaskman.render.report_models import model_cell

TOP_PROCESSES = 3
COLUMNS = ("HOST", "GPU", "MEMORY", "UTIL", "PROCESSES", "MODELS")
SORT_COLUMNS = ("HOST", "MEMORY", "MEM%", "UTIL")
SUM_SOURCE = "fleet"
UNHEALTHY_FLAG = "UNHEALTHY "  # before the GPU's name (a narrow cell cuts the name's end)


@dataclass(frozen=True, slots=True)
class FleetRow:
    key: str  # stable across refreshes: host name and GPU address
    state: HostState
    adapter: AdapterDoc | None  # None: a row about the host, not one of its GPUs
    gpu: str  # the GPU's index and name, or what the host row says instead
    memory_used: Reading | None = None
    memory_total: Reading | None = None
    util: Reading | None = None
    processes: str = ""
    models: str = ""
    # not shown, for the filter: every process's name and command line on this GPU (the
    # PROCESSES cell names only the few with the most memory; a command line is in a polled
    # host's document, never in Prometheus's series)
    commands: tuple[str, ...] = ()

    @property
    def host(self) -> str:
        return self.state.target.name

    @property
    def status(self) -> HostStatus:
        return self.state.status


def _clock(t: float | None) -> str:
    if t is None:
        return NA
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return NA


def host_line(s: HostState, next_try: bool = True) -> str:
    """A host that is not up, in one line: status, reason, next try, last answer."""
    parts = [f"{s.status}: {s.reason}" if s.reason else str(s.status)]
    if next_try and s.next_poll_in_s is not None and s.status is not HostStatus.WAITING:
        parts.append(f"next try in {s.next_poll_in_s:g} s")
    if s.answered_at is not None:
        parts.append(f"last answer {_clock(s.answered_at)}")
    return " · ".join(parts)


def _on(p: ProcGpu, a: AdapterDoc) -> bool:
    return a.pci_bus_id is not None and p.adapter == a.pci_bus_id


def _vram(p: ProcGpu) -> float:
    r = p.shown_vram
    return -1.0 if r is None or r.value is None else float(r.value)


def _processes(procs: Sequence[ProcGpu]) -> str:
    top = sorted(procs, key=_vram, reverse=True)[:TOP_PROCESSES]
    cells = [f"{p.name or p.pid} {fmt_reading(p.shown_vram, as_bytes=True)}" for p in top]
    more = len(procs) - len(top)
    return ", ".join(cells) + (f" +{more}" if more > 0 else "")


def _commands(procs: Sequence[ProcGpu]) -> tuple[str, ...]:
    out: list[str] = []
    for p in procs:
        if p.name:
            out.append(p.name)
        if p.detail.cmdline:
            out.append(" ".join(p.detail.cmdline))
    return tuple(out)


def _models(procs: Sequence[ProcGpu]) -> str:
    seen = dict.fromkeys(cell for p in procs if p.model is not None and (cell := model_cell(p)))
    return ", ".join(seen)


def health_flag(a: AdapterDoc) -> str:
    """What the GPU cell adds for a GPU whose health readings say it is unhealthy
    (`gpuhealth.verdict`: a critical XID, uncorrected ECC, a pending retirement or remap, a
    failed remap, a slowdown); nothing for a healthy GPU or one whose health is unknown."""
    return UNHEALTHY_FLAG if a.health and verdict(a.health).state == UNHEALTHY else ""


def _gpu_rows(s: HostState, doc: Document) -> list[FleetRow]:
    procs = [row.proc for row in doc.processes]
    if not doc.adapters:
        if doc.unavailable is not None:
            why = f"no GPU usable via {doc.backend} ({doc.unavailable.reason})"
        else:
            why = f"{doc.backend} answered but lists no GPU"
        return [
            FleetRow(
                f"{s.target.name}|",
                s,
                None,
                why,
                processes=_processes(procs),
                commands=_commands(procs),
            )
        ]
    rows = []
    for a in doc.adapters:
        mine = [p for p in procs if _on(p, a)]
        m = a.metrics
        rows.append(
            FleetRow(
                f"{s.target.name}|{a.pci_bus_id or a.index}",
                s,
                a,
                f"{a.index} {health_flag(a)}{a.name or NA}",
                None if m is None else m.memory_used_bytes,
                None if m is None else m.memory_total_bytes,
                None if m is None else m.util_gpu_percent,
                _processes(mine),
                _models(mine),
                _commands(mine),
            )
        )
    return rows


class ViewCache:
    """Each host's rows and sums, kept while its state is the same object: a source replaces
    a host's state only when something about it changed (the poller on every answer,
    Prometheus when a sample or a status did), so a refresh builds the rows and sums of the
    changed hosts only."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[HostState, bool, list[FleetRow]]] = {}
        self.sums: dict[str, tuple[HostState, _HostSums]] = {}  # for `fleet_totals`


def _host_rows(s: HostState, live: bool) -> list[FleetRow]:
    if s.up and s.document is not None:
        return _gpu_rows(s, s.document)
    return [FleetRow(f"{s.target.name}|", s, None, host_line(s, live))]


def fleet_rows(
    states: Iterable[HostState], live: bool = True, cache: ViewCache | None = None
) -> list[FleetRow]:
    """Rows in host order, each host's GPUs in its document's order (`live`: a failing
    host's row says when the next try is); with a `cache`, unchanged hosts' rows are
    reused."""
    out: list[FleetRow] = []
    if cache is None:
        for s in states:
            out += _host_rows(s, live)
        return out
    rows = cache.rows
    for s in states:
        hit = rows.get(s.target.name)
        if hit is None or hit[0] is not s or hit[1] != live:
            hit = rows[s.target.name] = (s, live, _host_rows(s, live))
        out += hit[2]
    _forget_gone(rows, states)
    return out


def _forget_gone(kept: dict[str, Any], states: Sequence[HostState]) -> None:
    """Drop the cached hosts `states` no longer has (every one it has was just stored, so
    the sizes differ exactly when some are gone)."""
    if len(kept) != len(states):
        names = {s.target.name for s in states}
        for name in [n for n in kept if n not in names]:
            del kept[name]


# ---------------------------------------------------------------------------- totals


@dataclass(frozen=True, slots=True)
class FleetTotals:
    hosts: int
    up: int
    by_status: dict[str, int]
    gpus: int  # GPUs of the hosts that are up
    gpus_measured: int  # of those, with used and total both measured
    used_bytes: float | None  # measured sums; None: no GPU measured
    total_bytes: float | None
    inferred_used_bytes: float | None  # device memory used, inferred (~): apart
    gpus_inferred: int
    estimated_model_bytes: float | None  # processes' model views, estimated (≈): apart
    runtime_model_bytes: float | None  # the same, runtime-reported (ʳ): apart


def _known(r: Reading | None, kind: Kind) -> bool:
    return r is not None and r.value is not None and r.kind is kind


@dataclass(frozen=True, slots=True)
class _HostSums:
    gpus: int = 0
    measured: int = 0
    used: float = 0.0
    total: float = 0.0
    inferred_n: int = 0
    inferred: float = 0.0
    estimated: float | None = None
    runtime: float | None = None


def _host_sums(s: HostState) -> _HostSums:
    if not s.up or s.document is None:
        return _HostSums()
    gpus = measured = inferred_n = 0
    used = total = inferred = 0.0
    estimated: float | None = None
    runtime: float | None = None
    for a in s.document.adapters:
        gpus += 1
        m = a.metrics
        if m is None:
            continue
        if _known(m.memory_used_bytes, Kind.MEASURED) and _known(
            m.memory_total_bytes, Kind.MEASURED
        ):
            measured += 1
            used += float(m.memory_used_bytes.value)  # type: ignore[arg-type]
            total += float(m.memory_total_bytes.value)  # type: ignore[arg-type]
        elif _known(m.memory_used_bytes, Kind.INFERRED):
            inferred_n += 1
            inferred += float(m.memory_used_bytes.value)  # type: ignore[arg-type]
    for row in s.document.processes:
        view = row.proc.breakdown
        if view is None:
            continue
        if view.estimated_total is not None:
            estimated = (estimated or 0.0) + view.estimated_total
        if view.reported_total is not None:
            runtime = (runtime or 0.0) + view.reported_total
    return _HostSums(gpus, measured, used, total, inferred_n, inferred, estimated, runtime)


def fleet_totals(states: Sequence[HostState], cache: ViewCache | None = None) -> FleetTotals:
    """The fleet's totals (see the module docstring); with a `cache`, an unchanged host's
    sums are reused."""
    by_status: dict[str, int] = {}
    gpus = measured = inferred_n = up = 0
    used = total = inferred = estimated = runtime = 0.0
    any_est = any_rt = False
    sums = cache.sums if cache is not None else {}
    for s in states:
        by_status[str(s.status)] = by_status.get(str(s.status), 0) + 1
        up += s.up
        if cache is None:
            h = _host_sums(s)
        else:
            hit = sums.get(s.target.name)
            if hit is None or hit[0] is not s:
                hit = sums[s.target.name] = (s, _host_sums(s))
            h = hit[1]
        gpus += h.gpus
        measured += h.measured
        used += h.used
        total += h.total
        inferred_n += h.inferred_n
        inferred += h.inferred
        if h.estimated is not None:
            estimated += h.estimated
            any_est = True
        if h.runtime is not None:
            runtime += h.runtime
            any_rt = True
    if cache is not None:
        _forget_gone(sums, states)
    return FleetTotals(
        hosts=len(states),
        up=up,
        by_status=by_status,
        gpus=gpus,
        gpus_measured=measured,
        used_bytes=used if measured else None,
        total_bytes=total if measured else None,
        inferred_used_bytes=inferred if inferred_n else None,
        gpus_inferred=inferred_n,
        estimated_model_bytes=estimated if any_est else None,
        runtime_model_bytes=runtime if any_rt else None,
    )


def summary_line(t: FleetTotals) -> str:
    """The fleet in one line: hosts up, measured GPU memory, and what is apart."""
    down = ", ".join(f"{n} {st}" for st, n in sorted(t.by_status.items()) if st != "up")
    parts = [f"hosts {t.up}/{t.hosts} up" + (f" ({down})" if down else "")]
    if t.used_bytes is not None and t.total_bytes is not None:
        pct = f" ({t.used_bytes / t.total_bytes * 100:.0f}%)" if t.total_bytes else ""
        left = t.gpus - t.gpus_measured
        parts.append(
            f"GPU memory {fmt_bytes(t.used_bytes)} / {fmt_bytes(t.total_bytes)} used{pct}, "
            f"measured on {t.gpus_measured} GPU{'s' if t.gpus_measured != 1 else ''}"
            + (f" ({left} GPU{'s' if left != 1 else ''} not measured, not counted)" if left else "")
        )
    else:
        parts.append(f"GPU memory: {NA} (no measured GPU memory on {t.gpus} GPUs of hosts up)")
    apart = []
    if t.inferred_used_bytes is not None:
        n = t.gpus_inferred
        apart.append(
            f"~{fmt_bytes(t.inferred_used_bytes)} used inferred on {n} GPU{'s' if n != 1 else ''}"
        )
    if t.estimated_model_bytes is not None:
        apart.append(f"≈{fmt_bytes(t.estimated_model_bytes)} model memory estimated")
    if t.runtime_model_bytes is not None:
        apart.append(f"ʳ{fmt_bytes(t.runtime_model_bytes)} runtime-reported")
    if apart:
        parts.append("apart: " + ", ".join(apart))
    return " · ".join(parts)


def _sum_reading(v: float | None, kind: Kind, what: str) -> Reading:
    if v is None:
        return Reading.missing(Reason.UNAVAILABLE, SUM_SOURCE, f"no {what} on any host up", kind)
    return Reading(int(v), kind, SUM_SOURCE, None, f"sum of {what} over the hosts up")


def totals_json(t: FleetTotals) -> dict[str, Any]:
    """The ``summary`` object of the fleet document."""
    return {
        "hosts_total": t.hosts,
        "hosts_up": t.up,
        "hosts_by_status": dict(sorted(t.by_status.items())),
        "gpus": t.gpus,
        "gpus_measured": t.gpus_measured,
        "memory_used_bytes": reading_json(
            _sum_reading(t.used_bytes, Kind.MEASURED, "measured GPU memory used")
        ),
        "memory_total_bytes": reading_json(
            _sum_reading(t.total_bytes, Kind.MEASURED, "measured GPU memory total")
        ),
        "memory_used_inferred_bytes": reading_json(
            _sum_reading(t.inferred_used_bytes, Kind.INFERRED, "inferred GPU memory used")
        ),
        "model_estimated_bytes": reading_json(
            _sum_reading(t.estimated_model_bytes, Kind.ESTIMATED, "estimated model memory")
        ),
        "model_runtime_bytes": reading_json(
            _sum_reading(t.runtime_model_bytes, Kind.RUNTIME, "runtime-reported model memory")
        ),
    }


# ---------------------------------------------------------------------------- sort, filter


def _value(r: Reading | None) -> float | None:
    return None if r is None or r.value is None else float(r.value)


def sort_value(row: FleetRow, column: str) -> Any:
    """The key `column` sorts `row` by; None when unknown (sorted last either way)."""
    if column == "HOST":
        return (row.host.casefold(), row.adapter.index if row.adapter else -1)
    if column == "MEMORY":
        return _value(row.memory_used)
    if column == "MEM%":
        used, total = _value(row.memory_used), _value(row.memory_total)
        return None if used is None or not total else used / total
    if column == "UTIL":
        return _value(row.util)
    raise ValueError(f"not a sort column: {column}")


def sorted_rows(rows: Iterable[FleetRow], column: str, descending: bool) -> list[FleetRow]:
    """`rows` by `column`; unknown values (down hosts, n/a readings) last in both orders."""
    rows = list(rows)
    known = [r for r in rows if sort_value(r, column) is not None]
    unknown = [r for r in rows if sort_value(r, column) is None]
    known.sort(key=lambda r: sort_value(r, column), reverse=descending)
    unknown.sort(key=lambda r: sort_value(r, "HOST"))
    return known + unknown


def matches(row: FleetRow, text: str) -> bool:
    """Whether `text` (any case) is in the row's host, status, GPU, processes or models, or in
    the name or command line of any process on that GPU."""
    needle = text.casefold()
    hay = (row.host, str(row.status), row.gpu, row.processes, row.models, *row.commands)
    return any(needle in h.casefold() for h in hay)


# ---------------------------------------------------------------------------- text


def memory_text(row: FleetRow) -> str:
    if row.adapter is None:
        return ""
    used, total = row.memory_used, row.memory_total
    if used is None or total is None:
        return f"{NA} (no metrics)"
    if used.value is None or total.value is None:
        missing = used if used.value is None else total
        return fmt_reading(missing, reason=True)
    pct = f" {used.value / total.value * 100:.0f}%" if total.value else ""
    return f"{fmt_reading(used, as_bytes=True)} / {fmt_reading(total, as_bytes=True)}{pct}"


def util_text(row: FleetRow) -> str:
    return "" if row.adapter is None else fmt_reading(row.util, "%")


def cells(row: FleetRow, first_of_host: bool = True) -> tuple[str, ...]:
    """The row as text cells, in `COLUMNS` order."""
    return (
        row.host if first_of_host else "",
        row.gpu,
        memory_text(row),
        util_text(row),
        row.processes,
        row.models,
    )


def render_text(states: Sequence[HostState]) -> str:
    """``fleet --once``: the summary line, then the rows as a table. The columns fit the
    GPU rows; a row about a host (not up, or no GPU) has its status and whole reason after
    the host's name, running on past the columns, so one long reason widens no column."""
    rows = fleet_rows(states, live=False)
    table: list[tuple[str, ...]] = [COLUMNS]
    prev = None
    for r in rows:
        first = r.host != prev
        if r.adapter is None:  # the host's words, outside the columns
            procs = f" · processes: {r.processes}" if r.processes else ""
            table.append((r.host if first else "", r.gpu + procs))
        else:
            table.append(cells(r, first))
        prev = r.host
    widths = [max(len(t[i]) for t in table if len(t) == len(COLUMNS)) for i in range(len(COLUMNS))]
    widths[0] = max(len(t[0]) for t in table)
    lines = [summary_line(fleet_totals(states)), ""]
    for t in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=False)).rstrip())
    return "\n".join(lines) + "\n"
