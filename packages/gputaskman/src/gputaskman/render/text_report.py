"""The ``--once`` text report and the process table's cells, from a `Snapshot` and the host
sample: what `render_text` prints and what the TUI's table shows. The JSON document is
`report`'s; both read the same snapshot and say n/a with the reason wherever a value is
unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gputaskman import __version__
from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading
from gputaskman.base.readings import (
    Kind,
    Problem,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.render.report import ProcHostLookup, proc_host_lookup, utc_of
from gputaskman.render.report_health import health_lines, mig_cell, mig_lines
from gputaskman.render.report_models import (
    gtt_text,
    model_cell,
    model_lines,
)
from gputaskman.render.report_owners import memory_lines, owner_detail_lines, totals_lines
from gputaskman.sampling import host

# What a backend-wide failure means for a user, beside NVML's own words.
BACKEND_HINTS: dict[Reason, str] = {
    Reason.NO_LIBRARY: "libnvidia-ml.so.1 was not found: no NVIDIA driver is installed here "
    "(or it is not on the library path), so NVIDIA GPUs cannot be shown",
    Reason.NO_DRIVER: "the NVIDIA library is installed but the kernel driver is not loaded",
    Reason.DENIED: "NVML refused access (permissions on /dev/nvidia*)",
    Reason.GPU_LOST: "the GPU stopped answering",
}


def describe_problem(p: Problem) -> str:
    where = f" [{p.adapter}]" if p.adapter else ""
    detail = f": {p.detail}" if p.detail else ""
    return f"{p.where}{where}: {p.reason}{detail}"


def no_gpu_lines(snapshot: Snapshot) -> list[str]:
    """Why there is no GPU to show (the backend failed, or answered with none), with a hint
    where one helps; empty when there are GPUs. Shared by ``--once`` and ``--watch``."""
    if not snapshot.available:
        bp = snapshot.backend_problem
        assert bp is not None
        lines = [f"GPU: none usable via {snapshot.backend} ({bp.reason})"]
        if bp.detail:
            lines.append(f"  {snapshot.backend}: {bp.detail}")
        if bp.reason in BACKEND_HINTS:
            lines.append(f"  {BACKEND_HINTS[bp.reason]}")
        return lines
    if not snapshot.adapters:
        return [f"GPU: {snapshot.backend} answered but lists no GPU"]
    return []


def _gpu_lines(snapshot: Snapshot, selected: str | None) -> list[str]:
    lines = no_gpu_lines(snapshot)
    if lines:
        return lines
    for a in snapshot.adapters:
        if selected is not None and a.pci_bus_id != selected:
            continue
        m = snapshot.metrics.get(a.pci_bus_id)
        lines.append(f"GPU {a.index}  {a.name or NA}  {a.pci_bus_id}  {a.uuid or ''}".rstrip())
        if m is None:
            lines.append("  metrics: n/a")
            continue
        lines.append(
            "  memory  used "
            + fmt_reading(m.memory_used_bytes, as_bytes=True, reason=True)
            + " / "
            + fmt_reading(m.memory_total_bytes, as_bytes=True, reason=True)
            + "  reserved "
            + fmt_reading(m.memory_reserved_bytes, as_bytes=True, reason=True)
        )
        lines.append(
            "  load    gpu "
            + fmt_reading(m.util_gpu_percent, "%", reason=True)
            + "  mem "
            + fmt_reading(m.util_memory_percent, "%", reason=True)
            + "  enc "
            + fmt_reading(m.encoder_percent, "%", reason=True)
            + "  dec "
            + fmt_reading(m.decoder_percent, "%", reason=True)
        )
        lines.append(
            "  temp "
            + fmt_reading(m.temperature_c, " C", reason=True)
            + "  power "
            + fmt_reading(m.power_w, " W", reason=True)
            + " / "
            + fmt_reading(m.power_limit_w, " W", reason=True)
            + "  clocks gfx "
            + fmt_reading(m.clock_graphics_mhz, " MHz", reason=True)
            + " sm "
            + fmt_reading(m.clock_sm_mhz, " MHz", reason=True)
            + " mem "
            + fmt_reading(m.clock_memory_mhz, " MHz", reason=True)
        )
        gtt = snapshot.extra_metrics.get(a.pci_bus_id, {})
        if gtt:
            lines.append("  " + gtt_text(gtt))
        att = snapshot.attributed_on(a.pci_bus_id)
        complete = snapshot.attributed_complete_on(a.pci_bus_id)
        lines.append(
            f"  attributed to processes (measured only): {fmt_bytes(att)}"
            + ("" if complete else "  (lower bound: some memory hidden or a list failed)")
        )
        bus = a.pci_bus_id
        lines += ["  " + line for line in health_lines(snapshot, bus) + mig_lines(snapshot, bus)]
    return lines


PROCESS_COLUMNS = ("PID", "NAME", "GPU", "VRAM", "RAM", "CPU%", "RUNTIMES", "CATEGORY", "MODEL")
# With a backend that measures non-local / compressed memory (Windows, macOS), a PAGED
# column follows VRAM; it is left out entirely when no row has such a reading.
PAGED_COLUMNS = (*PROCESS_COLUMNS[:4], "PAGED", *PROCESS_COLUMNS[4:])

# Marks a table cell can carry beside the provenance marks of `KIND_MARK` (the TUI's help
# screen explains each one; its test reads them from here).
UNIQUE_MARK = "*"  # after an inferred VRAM value: only one explanation fits
NOT_SCANNED_MARK = "…"  # RUNTIMES: the budgeted scan has not reached this process yet
# Reasons an unknown VRAM cell spells out ("n/a (hidden by driver)"): the user can act on
# these (run as root, check the GPU); any other unknown is a plain n/a.
LOUD_REASONS = (Reason.HIDDEN, Reason.DENIED, Reason.GPU_LOST)


def process_columns(snapshot: Snapshot) -> tuple[str, ...]:
    """The columns for `snapshot`'s rows: `PAGED_COLUMNS` when any row carries a paged
    reading (measured or not), else `PROCESS_COLUMNS`."""
    if any(p.paged is not None for p in snapshot.processes):
        return PAGED_COLUMNS
    return PROCESS_COLUMNS


def process_cells(
    p: ProcGpu,
    lookup: ProcHostLookup,
    snapshot: Snapshot,
    columns: tuple[str, ...] = PROCESS_COLUMNS,
) -> tuple[str, ...]:
    """Display cells for one process row, in `columns` order (`PROCESS_COLUMNS` or
    `PAGED_COLUMNS`; shared with the TUI)."""
    if p.host is not None:  # another OS's process (WSL: Windows host): no host readings here
        host: Mapping[str, Reading] = {}
    else:
        host = lookup(p.pid, p.create_time) or {}
    gpu = NA
    if p.adapter is not None:
        a = snapshot.adapter(p.adapter)
        gpu = str(a.index) if a is not None else p.adapter
        if p.mig is not None:
            gpu += f" {mig_cell(p.mig)}"  # its MIG instance (GPU / compute instance)
    vram = p.shown_vram
    if vram is not None:
        vram_text = fmt_reading(vram, as_bytes=True)
        if p.unique and vram.kind is Kind.INFERRED:
            vram_text += UNIQUE_MARK
    else:  # only a reason the user can act on earns table width; the rest is plain n/a
        vram_text = fmt_reading(p.dedicated, reason=p.dedicated.reason in LOUD_REASONS)
    runtimes = ",".join(p.detail.runtimes) if p.detail.scanned else NOT_SCANNED_MARK
    if not p.detail.scanned and p.detail.reason is Reason.UNAVAILABLE:
        runtimes = NA  # no scan will come (another OS's process, a host read from Prometheus)
    model = model_cell(p)
    cells = (
        str(p.pid) if p.host is None else f"{p.host}:{p.pid}",
        p.name or NA,
        gpu,
        vram_text,
        fmt_reading(host.get("ram_bytes"), as_bytes=True),
        fmt_reading(host.get("cpu_percent")),
        runtimes,
        p.detail.category or "",
        model,
    )
    if columns is PROCESS_COLUMNS or len(columns) == len(cells):
        return cells
    return (*cells[:4], fmt_reading(p.paged, as_bytes=True), *cells[4:])


def _platform_legend(snapshot: Snapshot) -> list[str]:
    """Legend lines for the markers only non-Linux backends produce (none on Linux)."""
    out = []
    if any(p.paged is not None for p in snapshot.processes):
        out.append("PAGED: non-local / compressed graphics memory, measured; never in totals")
    if any(p.parent_pid is not None for p in snapshot.processes):
        out.append(
            "~ rows with a parent: their bytes are inside the parent's measured total "
            "(WSL: vmwp.exe) and are never added again; * only one explanation fits"
        )
    if any(p.host is not None for p in snapshot.processes):
        out.append("windows:PID = a process of the Windows host, not of this machine")
    return out


def sort_key_vram(p: ProcGpu) -> float:
    """Sort key by shown VRAM (display only), unknown last when sorting descending."""
    r = p.shown_vram
    return -1.0 if r is None or r.value is None else float(r.value)


def _table(rows: Iterable[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def system_lines(system: host.HostSample | None) -> list[str]:
    """The system panel as text lines (shared by --once and the TUI)."""
    if system is None:
        return ["not sampled"]
    if not isinstance(system, host.SystemInfo):
        return list(system.render_lines())
    m, s, c = system.memory, system.swap, system.cpu
    lines = [
        "RAM   used "
        + fmt_reading(m.used_bytes, as_bytes=True, reason=True)
        + " / "
        + fmt_reading(m.total_bytes, as_bytes=True, reason=True)
        + "  available "
        + fmt_reading(m.available_bytes, as_bytes=True, reason=True)
        + "  cached "
        + fmt_reading(m.cached_bytes, as_bytes=True, reason=True),
        "swap  used "
        + fmt_reading(s.used_bytes, as_bytes=True, reason=True)
        + " / "
        + fmt_reading(s.total_bytes, as_bytes=True, reason=True),
    ]
    if s.devices is None:
        lines.append(f"      devices n/a ({s.devices_reason or 'unreadable'})")
    elif not s.devices:
        lines.append("      no swap devices")
    for d in s.devices or ():
        lines.append(
            f"      {d.filename}  {d.type}  {fmt_bytes(d.used_bytes)} / {fmt_bytes(d.size_bytes)}"
            f"  prio {NA if d.priority is None else d.priority}"
        )
    lines.append(
        "CPU   "
        + fmt_reading(c.percent, "%", reason=True)
        + f"  load {fmt_reading(c.load_1)} {fmt_reading(c.load_5)} {fmt_reading(c.load_15)}"
        + f"  cpus {fmt_reading(c.logical_cpus)}"
    )
    if system.duvm is not None:  # duvm pool (runtime-reported, from duvm's status sockets)
        from gputaskman.sampling import duvmpool

        lines += duvmpool.pool_lines(system.duvm)
    return lines


def title_line(snapshot: Snapshot) -> str:
    """The first line of ``--once`` and of each ``--watch`` sample: the version, when the
    sample was taken (UTC), the backend and the driver."""
    utc = utc_of(snapshot.taken)
    when = NA if utc is None else utc.strftime("%Y-%m-%d %H:%M:%S")
    line = f"gputaskman {__version__}  {when} UTC  backend {snapshot.backend}"
    if snapshot.driver_version:
        line += f"  driver {snapshot.driver_version}"
    return line


def render_text(
    snapshot: Snapshot, system: host.HostSample | None = None, selected_gpu: int | None = None
) -> str:
    """The ``--once`` report: GPUs, processes, problems, then the system panel."""
    out = [title_line(snapshot)]
    selected = None
    if selected_gpu is not None:
        sel = next((a for a in snapshot.adapters if a.index == selected_gpu), None)
        selected = sel.pci_bus_id if sel else None
    out += ["", *_gpu_lines(snapshot, selected), ""]
    lookup = proc_host_lookup(system)
    procs = [p for p in snapshot.processes if selected is None or p.adapter in (selected, None)]
    procs.sort(key=sort_key_vram, reverse=True)
    if procs:
        out.append(
            "PROCESSES  (VRAM: measured by the driver unless marked ~ inferred, "
            "≈ estimated, ʳ runtime-reported; n/a = unknown)"
        )
        out += ["  " + line for line in _platform_legend(snapshot)]
        cols = process_columns(snapshot)
        out += [
            "  " + line
            for line in _table((process_cells(p, lookup, snapshot, cols) for p in procs), cols)
        ]
    else:
        out.append("PROCESSES: none with a GPU context or a GPU runtime found")
    with_models = [
        p
        for p in procs
        if p.model is not None
        or p.breakdown is not None
        or (p.app_model is not None and p.app_model.selected)
    ]
    if with_models:
        out += [
            "",
            "MODELS  (ʳ runtime-reported, ≈ estimated, ~ inferred; * only one explanation "
            "fits; ✓ confirmed by two of api/mapped/cmdline; estimates never enter totals)",
        ]
        seen: set[int] = set()
        for p in with_models:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            out.append(f"  PID {p.pid} {p.name or NA}")
            out += ["    " + line for line in model_lines(p)]
    memory = memory_lines(procs)
    if memory:
        out += [
            "",
            "HOST MEMORY  (/proc/PID/status, measured, not GPU: swapped out and where (pool: "
            "duvm's device is the only active swap device); locked (mlock) and pinned, never "
            "swapped)",
            *("  " + line for line in memory),
        ]
    owners = totals_lines(snapshot, selected, limit=20)
    if owners:
        out += [
            "",
            "OWNERS  (measured VRAM summed per user, pod and job from /proc/PID/cgroup; + lower "
            "bound; rows whose owner is unknown counted apart)",
            *("  " + line for line in owners),
        ]
        seen_owner: set[int] = set()
        for p in procs:
            o = p.owner
            if p.pid in seen_owner or o is None or not (o.pod_uid or o.slurm_job or o.container_id):
                continue
            seen_owner.add(p.pid)
            out.append(f"  PID {p.pid} {p.name or NA}: " + "; ".join(owner_detail_lines(o)[1:]))
    problems = [p for p in snapshot.problems if p is not snapshot.backend_problem]
    if problems:
        out += ["", "PROBLEMS", *("  " + describe_problem(p) for p in problems)]
    if snapshot.notes:
        out += ["", "NOTES", *("  " + n for n in snapshot.notes)]
    out += [
        "",
        "SYSTEM  (OS-reported; never part of GPU totals)",
        *("  " + line for line in system_lines(system)),
    ]
    return "\n".join(out) + "\n"
