"""The inspector pane: everything known about one process row, each number with its kind,
source and (when missing) reason."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from gputaskman.base.fmt import fmt_bytes
from gputaskman.base.readings import ProcGpu, Reading, Snapshot
from gputaskman.render import report
from gputaskman.render.report_owners import owner_detail_lines
from gputaskman.sampling.host import HostSample
from gputaskman.tui.history import History, Series, sparkline
from gputaskman.tui.widgets.unchanged import update_static

HISTORY_WIDTH = 30  # samples drawn in the VRAM history line
MAX_CMDLINE = 600  # characters; a huge argv must not swamp the pane


def reading_line(label: str, r: Reading | None, *, as_bytes: bool = False, unit: str = "") -> str:
    if r is None:
        return f"{label}: n/a"
    value = report.fmt_reading(r, unit, as_bytes=as_bytes, reason=True)
    extra = f" — {r.detail}" if r.detail and r.value is None else ""
    return f"{label}: {value}  [{r.kind}, {r.source}]{extra}"


def history_line(series: Series | None) -> str | None:
    """The process's shown VRAM over the samples the TUI took, with its provenance mark."""
    if series is None or len(series.values) < 2:
        return None
    known = [v for v in series.values if v is not None]
    span = f"{fmt_bytes(min(known))}–{fmt_bytes(max(known))}" if known else "n/a"
    line = sparkline(series.values, HISTORY_WIDTH).lstrip()
    return f"VRAM{series.mark()} last {len(series.values)} samples: {line}  ({span})"


def inspect_text(
    p: ProcGpu | None,
    snapshot: Snapshot | None,
    system: HostSample | None,
    history: History | None = None,
) -> str:
    if p is None or snapshot is None:
        return "no process selected"
    d = p.detail
    lookup = report.proc_host_lookup(system)
    host = lookup(p.pid, p.create_time) or {}
    started = "n/a"
    if p.create_time is not None:
        try:
            when = dt.datetime.fromtimestamp(p.create_time, tz=dt.UTC)
            started = when.strftime("%Y-%m-%d %H:%M:%S UTC")
        except (ValueError, OverflowError, OSError):  # a replayed file may hold any number
            started = f"n/a (unreadable start time {p.create_time!r})"
    lines = [
        f"PID {p.pid}  {p.name or 'n/a'}",
        f"started {started}",
        f"exe {d.exe or 'n/a'}",
        f"GPU {p.adapter or 'none known'}  contexts {','.join(p.contexts) or 'none'}",
        reading_line("VRAM (driver)", p.dedicated, as_bytes=True),
    ]
    hist = history_line(history.vram.get(p.key)) if history is not None else None
    if hist is not None:
        lines.append(hist)
    if p.inferred is not None:
        star = " (* only one explanation fits)" if p.unique else ""
        lines.append(reading_line("VRAM inferred", p.inferred, as_bytes=True) + star)
    if p.parent_pid is not None:
        lines.append(f"counted under PID {p.parent_pid}'s measured total; never added again")
    if p.host is not None:
        lines.append(f"a {p.host} process: its PID is not one of this machine's")
    if p.paged is not None:
        lines.append(reading_line("Paged (non-local)", p.paged, as_bytes=True))
    if p.footprint is not None:
        lines.append(reading_line("footprint (not VRAM)", p.footprint, as_bytes=True))
    for name, r in sorted(p.engines.items()):
        lines.append(reading_line(name, r, unit="%"))
    lines.append(reading_line("RAM", host.get("ram_bytes"), as_bytes=True))
    lines.append(reading_line("CPU", host.get("cpu_percent"), unit="%"))
    m = p.memory
    if m is not None:  # /proc/PID/status: out of RAM, or held in it (never swapped)
        where = "" if m.swapped_to is None else f" in {m.swapped_to} ({m.swapped.detail})"
        lines.append(reading_line("swapped out", m.swapped, as_bytes=True) + where)
        lines.append(reading_line("locked (mlock)", m.locked, as_bytes=True))
        lines.append(reading_line("pinned", m.pinned, as_bytes=True))
    if p.owner is not None:  # what its cgroup names (None: not read, e.g. an older file)
        lines += owner_detail_lines(p.owner)
    if not d.scanned:
        detail = f" — {d.reason_detail}" if d.reason_detail else ""
        lines.append(f"scan: {d.reason or 'not scanned yet'}{detail}")
    else:
        lines.append(f"category {d.category or 'none'}")
        lines.append("runtimes (mapped, detection not proof): " + (", ".join(d.runtimes) or "none"))
        for ev, path in d.model_evidence:
            lines.append(f"model [{ev}] {path or 'unresolved'}")
        if d.reason:
            lines.append(f"partial: {d.reason} {d.reason_detail or ''}".rstrip())
    # the model and its weights / KV cache / compute / other split, each part with its
    # provenance (ʳ runtime, ≈ estimated, ~ inferred), source and marker
    lines += report.model_lines(p)
    if d.cmdline is not None:
        cmd = " ".join(d.cmdline)
        if len(cmd) > MAX_CMDLINE:
            cmd = cmd[:MAX_CMDLINE] + "…"
        lines.append(f"cmdline (secrets redacted): {cmd}")
    return "\n".join(escape(line) for line in lines)


class Inspector(VerticalScroll):
    DEFAULT_CSS = """
    Inspector { width: 46; border-left: solid $primary-darken-2; padding: 0 1;
                overflow-x: hidden; }
    Inspector.-hidden { display: none; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body = Static("no process selected", id="inspector-body")

    def compose(self) -> ComposeResult:
        yield self.body

    def show(
        self,
        p: ProcGpu | None,
        snapshot: Snapshot | None,
        system: HostSample | None,
        history: History | None = None,
    ) -> None:
        update_static(self.body, inspect_text(p, snapshot, system, history))
