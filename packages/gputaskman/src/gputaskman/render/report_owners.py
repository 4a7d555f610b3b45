"""JSON and text for each process's memory outside the GPU (swapped out, locked, pinned), its
owner (pod, container, Slurm job, systemd unit, session, user) and the totals by owner.

Theory of operation
-------------------
`memory_json` and `owner_json` write `ProcGpu.memory` (`readings.ProcMemory`) and
`ProcGpu.owner` (`readings.Owner`) into a process row of the ``--json`` document (the shape
is documented in `report`); `totals_json` writes `owners.owner_totals`, which the document
derives from its rows (a reader derives it again, it is never read back). The text helpers
give the TUI's SWAPPED / LOCKED / PINNED / OWNER cells and the ``--once`` sections from the
same objects, so the table, ``--once`` and ``--json`` agree. Unknown is n/a with its reason;
only measured VRAM is summed, per owner, and rows whose owner is unknown are a group apart.
"""

from __future__ import annotations

from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, fmt_reading, reading_json
from gputaskman.base.owners import NAMED, NONE, UNKNOWN, OwnerTotal, owner_totals
from gputaskman.base.readings import Owner, ProcGpu, ProcMemory, Snapshot

# the TUI's columns a user turns on (settings ``shown_columns``, keys m and o)
MEMORY_COLUMNS = ("SWAPPED", "LOCKED", "PINNED")
OWNER_COLUMNS = ("OWNER",)
OPTIONAL_COLUMNS = (*MEMORY_COLUMNS, *OWNER_COLUMNS)
OWNER_KEYS = (
    "cgroup",
    "user",
    "pod_uid",
    "pod_namespace",
    "pod_name",
    "pod_source",
    "qos",
    "container_id",
    "container_runtime",
    "slurm_job",
    "slurm_step",
    "unit",
    "user_unit",
    "session",
    "reason",
    "detail",
)


def memory_json(m: ProcMemory | None) -> dict[str, Any]:
    """The row's ``swapped_bytes``, ``swapped_to``, ``locked_bytes`` and ``pinned_bytes``
    (each null when the memory was not read: another OS's process, an older file)."""
    if m is None:
        return {
            "swapped_bytes": None,
            "swapped_to": None,
            "locked_bytes": None,
            "pinned_bytes": None,
        }
    return {
        "swapped_bytes": reading_json(m.swapped),
        "swapped_to": m.swapped_to,
        "locked_bytes": reading_json(m.locked),
        "pinned_bytes": reading_json(m.pinned),
    }


def owner_json(o: Owner | None) -> dict[str, Any] | None:
    """The row's ``owner`` object (null when not read)."""
    if o is None:
        return None
    out = {k: getattr(o, k) for k in OWNER_KEYS}
    out["reason"] = None if o.reason is None else str(o.reason)
    return out


def total_json(t: OwnerTotal) -> dict[str, Any]:
    return {
        "by": t.by,
        "owner": t.owner,
        "state": t.state,
        "attributed_bytes": t.attributed_bytes,
        "attributed_complete": t.complete,
        "pids": list(t.pids),
        "pod_namespace": t.pod_namespace,
        "pod_name": t.pod_name,
    }


def totals_json(snapshot: Snapshot) -> list[dict[str, Any]]:
    """The document's ``owner_totals``: every GPU's rows, by user, pod and job."""
    return [total_json(t) for t in owner_totals(snapshot)]


# ---------------------------------------------------------------------------- text


def swapped_cell(m: ProcMemory | None) -> str:
    """SWAPPED: the bytes and where they are (``pool`` / ``swap``), or n/a."""
    if m is None:
        return NA
    cell = fmt_reading(m.swapped, as_bytes=True)
    return cell if m.swapped_to is None or not m.swapped.value else f"{cell} {m.swapped_to}"


def memory_cells(p: ProcGpu) -> tuple[str, str, str]:
    """SWAPPED, LOCKED and PINNED of row `p`."""
    m = p.memory
    if m is None:
        return (NA, NA, NA)
    return (
        swapped_cell(m),
        fmt_reading(m.locked, as_bytes=True),
        fmt_reading(m.pinned, as_bytes=True),
    )


def owner_cell(o: Owner | None) -> str:
    """OWNER: the pod (namespace/name where known, else its UID's first 8 digits), the Slurm
    job and step, else the systemd unit or session; n/a when unread, ``-`` when it names
    none of them."""
    if o is None or o.cgroup is None:
        return NA
    if o.pod_uid is not None:
        if o.pod_name is not None:
            return f"pod {o.pod_namespace}/{o.pod_name}"
        return f"pod {o.pod_uid[:8]}"
    if o.slurm_job is not None:
        step = "" if o.slurm_step is None else f".{o.slurm_step}"
        return f"job {o.slurm_job}{step}"
    if o.container_id is not None:
        return f"{o.container_runtime or 'container'} {o.container_id[:12]}"
    if o.session is not None:
        return f"session {o.session}"
    return o.unit or "-"


def owner_detail_lines(o: Owner | None) -> list[str]:
    """The owner as the inspector shows it: each fact its cgroup names, or why unknown."""
    if o is None:
        return [f"owner {NA} (not read)"]
    if o.cgroup is None:
        return [f"owner {NA} ({o.reason or 'unknown'}{': ' + o.detail if o.detail else ''})"]
    lines = [f"cgroup {o.cgroup}"]
    if o.pod_uid is not None:
        name = (
            "" if o.pod_name is None else f" {o.pod_namespace}/{o.pod_name} (from {o.pod_source})"
        )
        lines.append(f"pod {o.pod_uid}{name}  qos {o.qos or NA}")
    if o.container_id is not None:
        lines.append(f"container {o.container_id}  runtime {o.container_runtime or NA}")
    if o.slurm_job is not None:
        lines.append(f"slurm job {o.slurm_job}  step {o.slurm_step or NA}")
    if o.unit is not None:
        lines.append(f"{'user ' if o.user_unit else ''}unit {o.unit}")
    if o.session is not None:
        lines.append(f"session {o.session}")
    if o.detail:
        lines.append(o.detail)
    return lines


def _total_text(t: OwnerTotal) -> str:
    if t.state == NAMED:
        who = t.owner or NA
        if t.pod_name is not None:
            who = f"{t.pod_namespace}/{t.pod_name}"
        elif t.by == "pod" and t.owner is not None:
            who = t.owner[:8]
    else:
        who = {NONE: f"no {t.by}", UNKNOWN: f"{t.by} unknown"}[t.state]
    low = "" if t.complete else "+"
    n = len(t.pids)
    return f"{who} {fmt_bytes(t.attributed_bytes)}{low} ({n} proc{'' if n == 1 else 's'})"


def totals_lines(snapshot: Snapshot, pci_bus_id: str | None = None, limit: int = 6) -> list[str]:
    """One line per dimension in which some row's owner is named: ``user alice 3.1 GiB (2
    procs) · ...``; ``+`` marks a lower bound. Empty when none is (no GPU row, or a document
    without owners)."""
    totals = owner_totals(snapshot, pci_bus_id)
    lines = []
    for by in ("user", "pod", "job"):
        mine = [t for t in totals if t.by == by]
        if all(t.state != NAMED for t in mine):
            continue  # no owner of this kind named: nothing to say (older files, the demo)
        shown = mine[:limit]
        more = f" · {len(mine) - limit} more" if len(mine) > limit else ""
        lines.append(f"{by:<4} " + " · ".join(_total_text(t) for t in shown) + more)
    return lines


def memory_lines(rows: list[ProcGpu]) -> list[str]:
    """``--once``'s lines for rows with swapped, locked or pinned bytes, or with them unknown
    for a reason other than being of another OS."""
    out = []
    for p in rows:
        m = p.memory
        if m is None:
            continue
        if m.swapped.value is not None and not any(
            r.value for r in (m.swapped, m.locked, m.pinned)
        ):
            continue  # nothing out of RAM, nothing held in it
        where = "" if m.swapped_to is None or not m.swapped.value else f" ({m.swapped_to})"
        out.append(
            f"PID {p.pid} {p.name or NA}: swapped "
            f"{fmt_reading(m.swapped, as_bytes=True, reason=True)}{where}  locked "
            f"{fmt_reading(m.locked, as_bytes=True, reason=True)}  pinned "
            f"{fmt_reading(m.pinned, as_bytes=True, reason=True)}"
        )
    return out
