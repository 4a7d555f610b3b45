"""Measured GPU memory summed by owner: per user, per Kubernetes pod, per Slurm job.

Theory of operation
-------------------
`owner_totals(snapshot)` groups the rows that have a GPU context by who owns them, each
dimension on its own (`BY`): the user a process runs as (`Owner.user`, its real uid read
with the cgroup, so a document or a fleet that has the owner has the user), the pod UID and
the Slurm job its cgroup names (`Owner`). Each group's
`attributed_bytes` adds the rows' **measured** VRAM only, as `Snapshot.attributed` does
(None when none was measured); `complete` is false when a row's VRAM is unknown (hidden by
the driver) or a GPU's process list failed, so the sum is a lower bound.

Rows are never given an owner they do not have. Per dimension a row is in one of three
kinds of group (`OwnerTotal.state`): ``named`` (the owner is known), ``none`` (its cgroup was
read and names no pod / no job) and ``unknown`` (the owner could not be read: the process was
gone, permission, another OS's process, a document that did not record it). The ``unknown``
group is counted apart, never folded into a named one or into ``none``.

A row of another OS (`ProcGpu.host`, the Windows host seen from WSL) is ``unknown`` in every
dimension; a row whose bytes its parent's total already counts (`ProcGpu.parent_pid`) is not
added again, as `Snapshot.attributed_complete` treats it.

This module imports only the standard library and `base.readings` (checked by
tests/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gputaskman.base.readings import Kind, ProcGpu, Snapshot

BY = ("user", "pod", "job")
NAMED, NONE, UNKNOWN = "named", "none", "unknown"


@dataclass(frozen=True, slots=True)
class OwnerTotal:
    """One owner's rows: `owner` is the user, pod UID or job ID (None for the ``none`` and
    ``unknown`` groups); `pod_namespace` / `pod_name` where a local source gave them."""

    by: str
    owner: str | None
    state: str
    attributed_bytes: int | None
    complete: bool
    pids: tuple[int, ...]
    pod_namespace: str | None = None
    pod_name: str | None = None


def owner_of(p: ProcGpu, by: str) -> tuple[str, str | None]:
    """(state, owner) of row `p` in dimension `by` (one of `BY`)."""
    if p.host is not None:
        return UNKNOWN, None
    o = p.owner
    if by == "user":
        user = None if o is None else o.user
        return (NAMED, user) if user is not None else (UNKNOWN, None)
    if o is None or o.cgroup is None:
        return UNKNOWN, None
    value = o.pod_uid if by == "pod" else o.slurm_job
    return (NAMED, value) if value is not None else (NONE, None)


def owner_totals(snapshot: Snapshot, pci_bus_id: str | None = None) -> list[OwnerTotal]:
    """The totals of every owner in each dimension of `BY`, for one GPU or (None) all of them:
    named owners by size (largest measured first), then ``none``, then ``unknown``."""
    failed = {
        pr.adapter
        for pr in snapshot.problems
        if pr.is_process_list and (pci_bus_id is None or pr.adapter == pci_bus_id)
    }
    rows = [
        p
        for p in snapshot.processes
        if p.adapter is not None and (pci_bus_id is None or p.adapter == pci_bus_id)
    ]
    out: list[OwnerTotal] = []
    for by in BY:
        groups: dict[tuple[str, str | None], list[ProcGpu]] = {}
        for p in rows:
            groups.setdefault(owner_of(p, by), []).append(p)
        totals = []
        for (state, owner), members in groups.items():
            total: int | None = None
            complete = not failed and snapshot.backend_problem is None
            for p in members:
                if p.parent_pid is not None:
                    continue  # inside its parent's measured total already
                d = p.dedicated
                if d.kind is Kind.MEASURED and d.value is not None:
                    total = (total or 0) + int(d.value)
                else:
                    complete = False
            ns = name = None
            if by == "pod" and state == NAMED:
                o = next((p.owner for p in members if p.owner and p.owner.pod_name), None)
                ns, name = (None, None) if o is None else (o.pod_namespace, o.pod_name)
            pids = tuple(sorted({p.pid for p in members}))
            totals.append(OwnerTotal(by, owner, state, total, complete, pids, ns, name))
        order = {NAMED: 0, NONE: 1, UNKNOWN: 2}
        totals.sort(
            key=lambda t: (
                order[t.state],
                1 if t.attributed_bytes is None else -t.attributed_bytes,
                t.owner or "",
            )
        )
        out += totals
    return out
