"""The typed reader's part of a process row that concerns its host memory and its owner:
``swapped_bytes`` / ``locked_bytes`` / ``pinned_bytes`` / ``swapped_to`` into a
`readings.ProcMemory` and ``owner`` into a `readings.Owner` (`reader` calls these for every
row; the reference reader, `docfields`, reads the same keys to the same objects).

A row with none of the three memory keys (a file written before them, another OS's process)
has no memory (None); one that has some lacks the others as ``unavailable`` ("not
recorded"). An owner's reason this version does not know reads as ``unavailable`` with the
recorded word in the detail, as every other reason does.
"""

from __future__ import annotations

from collections.abc import Callable

from gputaskman.base.frozen import builder
from gputaskman.base.readings import Owner, ProcMemory, Reading, Reason
from gputaskman.document.docshape import OwnerShape, ProcessShape, ReadingShape
from gputaskman.document.doctypes import RECORDED_SOURCE
from gputaskman.document.jsonfields import REASONS

NOT_RECORDED = Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded")
_ProcMemory = builder(ProcMemory)
_Owner = builder(Owner)


def memory_of(s: ProcessShape, read: Callable[[ReadingShape], Reading]) -> ProcMemory | None:
    """The row's `ProcMemory` (`read` turns a reading's shape into a `Reading`, checked)."""
    got = (s.swapped_bytes, s.locked_bytes, s.pinned_bytes)
    if got == (None, None, None):
        return None
    swapped, locked, pinned = (NOT_RECORDED if r is None else read(r) for r in got)
    return _ProcMemory(swapped, locked, pinned, s.swapped_to)


def owner_of(s: OwnerShape | None) -> Owner | None:
    """The row's `Owner`, None when it has none."""
    if s is None:
        return None
    why, detail = s.reason, s.detail
    reason = None if why is None else REASONS.get(why)
    if why is not None and reason is None:
        extra = f"recorded reason: {why}"
        reason, detail = Reason.UNAVAILABLE, extra if detail is None else f"{detail} ({extra})"
    return _Owner(
        s.cgroup,
        s.user,
        s.pod_uid,
        s.container_id,
        s.container_runtime,
        s.qos,
        s.slurm_job,
        s.slurm_step,
        s.unit,
        bool(s.user_unit),
        s.session,
        s.pod_name,
        s.pod_namespace,
        s.pod_source,
        reason,
        detail,
    )
