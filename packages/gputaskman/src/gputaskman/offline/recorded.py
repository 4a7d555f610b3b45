"""Replay's objects from a saved ``--json`` object: the model's `Snapshot` and a host sample.

Theory of operation
-------------------
`document.reader` reads the document (the one reader of the format); `replay_objects` turns
its `Document` into what the live TUI and the report take: the `Snapshot`
(`Document.snapshot`) and a `RecordedSystem`, the recorded ``system`` object with the
surface the report and the TUI use for a host sample (`to_json_dict`, `process_readings`,
`render_lines`). Per-process RAM/CPU readings come from the recorded process rows; the
system panel is host.py's `SystemInfo` rebuilt from the recorded numbers, one the file does
not hold shown as unknown. Derived fields (``attributed_bytes``, ``shown_vram``,
``process_list``) are derived again by the model from the same readings, so
``report.to_json_dict(*snapshot_from_json(doc), selected_gpu=doc["selected_gpu"])`` gives
``doc`` back; tests check that round trip on record files of a released version
(tests/recordings) and on documents drawn from the JSON Schema with every optional field set.

Anything the reader cannot read raises `SnapshotError`, which replay reports as a malformed
line.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gputaskman.base.readings import Reading, Reason, Snapshot
from gputaskman.document.reader import (
    RECORDED_SOURCE,
    Document,
    SnapshotError,
    SwapDoc,
    SystemDoc,
    read_document,
)
from gputaskman.render import text_report
from gputaskman.render.report_models import system_json
from gputaskman.sampling import host

__all__ = ["RecordedSystem", "SnapshotError", "replay_objects", "snapshot_from_json"]


class RecordedSystem:
    """The recorded ``system`` object (None: the snapshot had no host sample), with the
    surface `report` and the TUI use."""

    def __init__(
        self,
        doc: SystemDoc | None,
        per_process: Mapping[tuple[int, float | None], Mapping[str, Reading]],
    ) -> None:
        self.doc = doc
        self._per_process = per_process

    def to_json_dict(self) -> Any:
        return None if self.doc is None else system_json(self.doc)

    def process_readings(self, pid: int, create_time: float | None) -> Mapping[str, Reading]:
        return self._per_process.get((pid, create_time), {})

    def render_lines(self) -> list[str]:
        if self.doc is None:
            return ["not recorded"]
        return text_report.system_lines(system_info(self.doc))


def _unrecorded() -> Reading:
    return Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded")


def _count(r: Reading | None) -> int | None:
    return None if r is None or r.value is None else int(r.value)


def system_info(doc: SystemDoc) -> host.SystemInfo:
    """host.py's `SystemInfo` from a recorded ``system`` object, for the system panel; a
    number the file does not hold is unknown ("not recorded"), never 0."""
    swap = doc.swap if doc.swap is not None else SwapDoc(devices_reason="not recorded")
    devices = None
    if swap.devices is not None:
        devices = tuple(
            host.SwapDevice(
                d.filename or "?",
                d.type or "?",
                _count(d.size_bytes),
                _count(d.used_bytes),
                _count(d.priority),
                d.deleted,
            )
            for d in swap.devices
        )
    return host.SystemInfo(
        taken=doc.taken or 0.0,
        memory=host.MemoryInfo(
            *(doc.memory.get(n) or _unrecorded() for n in host.MemoryInfo.__slots__)
        ),
        swap=host.SwapInfo(
            total_bytes=swap.total_bytes or _unrecorded(),
            free_bytes=swap.free_bytes or _unrecorded(),
            used_bytes=swap.used_bytes or _unrecorded(),
            devices=devices,
            devices_reason=swap.devices_reason,
            problems=swap.problems,
        ),
        cpu=host.CpuInfo(*(doc.cpu.get(n) or _unrecorded() for n in host.CpuInfo.__slots__)),
        processes=MappingProxyType({}),
        processes_reason=doc.processes_reason,
        duvm=doc.duvm,
    )


def replay_objects(doc: Document) -> tuple[Snapshot, RecordedSystem]:
    """The `Snapshot` and host sample replay shows for `doc`."""
    per_process: dict[tuple[int, float | None], dict[str, Reading]] = {}
    for row in doc.processes:
        got = {"ram_bytes": row.ram_bytes, "cpu_percent": row.cpu_percent}
        per_process[row.proc.key] = {k: r for k, r in got.items() if r is not None}
    return doc.snapshot(), RecordedSystem(doc.system, per_process)


def snapshot_from_json(obj: object) -> tuple[Snapshot, RecordedSystem]:
    """`read_document` then `replay_objects`; `SnapshotError` when it cannot be read."""
    return replay_objects(read_document(obj))
