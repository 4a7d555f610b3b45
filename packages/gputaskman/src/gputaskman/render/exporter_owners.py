"""The series `serve` exports for what of a process is out of RAM or held in it, and for who
owns it (`exporter` calls these for each process row and once per sample).

* ``gputaskman_process_swapped_bytes`` (VmSwap, ``swapped_to="pool"`` when duvm's device is
  the node's only active swap device, else ``"swap"``), ``gputaskman_process_locked_bytes``
  (VmLck) and ``gputaskman_process_pinned_bytes`` (VmPin), from `procfacts`;
* ``gputaskman_process_owner_info`` (`OWNER_INFO_LABELS`), one per row whose cgroup was read;
* the totals by owner: ``gputaskman_owner_vram_bytes`` (measured VRAM only),
  ``gputaskman_owner_vram_complete`` and ``gputaskman_owner_processes``, labelled
  `OWNER_TOTAL_LABELS`.
"""

from __future__ import annotations

from gputaskman.base.owners import owner_totals
from gputaskman.base.readings import ProcGpu, Snapshot
from gputaskman.render.exporter_families import PROC_LABELS, Families, info_series

# `readings.Owner` fields exported as labels of gputaskman_process_owner_info
OWNER_INFO_LABELS = (
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
OWNER_TOTAL_LABELS = ("by", "owner", "state", "pod_namespace", "pod_name")


def process_memory_and_owner(f: Families, p: ProcGpu, pv: tuple[str, ...]) -> None:
    """A row's swapped / locked / pinned bytes and its owner's info series (`procfacts`)."""
    m = p.memory
    if m is not None:
        f.reading(
            "gputaskman_process_swapped",
            "bytes",
            "Process memory swapped out (VmSwap); swapped_to=pool: duvm's device is the "
            "only active swap device",
            (*PROC_LABELS, "swapped_to"),
            (*pv, m.swapped_to or ""),
            m.swapped,
        )
        f.reading(
            "gputaskman_process_locked",
            "bytes",
            "Process memory locked with mlock (VmLck): never swapped",
            PROC_LABELS,
            pv,
            m.locked,
        )
        f.reading(
            "gputaskman_process_pinned",
            "bytes",
            "Process memory pinned by the kernel (VmPin: devices, RDMA, io_uring): never swapped",
            PROC_LABELS,
            pv,
            m.pinned,
        )
    o = p.owner
    if o is not None and o.cgroup is not None:
        info_series(
            f,
            "gputaskman_process_owner_info",
            "Who owns a process row, as its cgroup names it (empty: not named)",
            PROC_LABELS + OWNER_INFO_LABELS,
            (*pv, *(_label(getattr(o, k)) for k in OWNER_INFO_LABELS)),
        )


def _label(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "" if v is None else str(v)


def owner_totals_families(f: Families, snap: Snapshot) -> None:
    """Measured VRAM summed by user, pod and job (`owners.owner_totals`); an owner whose rows
    had no measured VRAM has no bytes series, and ``state="unknown"`` counts apart."""
    for t in owner_totals(snap):
        lv = (t.by, t.owner or "", t.state, t.pod_namespace or "", t.pod_name or "")
        if t.attributed_bytes is not None:
            f.add(
                "gputaskman_owner_vram_bytes",
                "Measured process VRAM summed by owner (by=user|pod|job)",
                OWNER_TOTAL_LABELS,
                lv,
                t.attributed_bytes,
            )
        f.add(
            "gputaskman_owner_vram_complete",
            "1 if every row of the owner had measured VRAM (else its sum is a lower bound)",
            OWNER_TOTAL_LABELS,
            lv,
            1 if t.complete else 0,
        )
        f.add(
            "gputaskman_owner_processes",
            "Process rows with a GPU context, by owner",
            OWNER_TOTAL_LABELS,
            lv,
            len(t.pids),
        )
