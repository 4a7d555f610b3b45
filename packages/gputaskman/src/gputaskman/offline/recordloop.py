"""A record file played in a loop as a collector: what ``gputaskman serve --replay FILE`` samples.

Theory of operation
-------------------
`RecordLoop` has the collector's surface (`prime`, `sample_with_system`, `close`): each sample
is the record file's next good snapshot, from the first again after the last, read through
`playback.RecordSource` (lines located once, each read when used by `reader.read_document`).
So a recording stands in for a host: tests and demos run `serve` instances that answer like
GPU hosts on a machine without one.

What it returns says so. The snapshot's ``taken`` is the time it is served (a host's sample is
of now), and a note names the file, the line and when that line was recorded, so nobody takes
a replayed recording for a measurement of this machine. The host sample is host.py's own
`SystemInfo` rebuilt from the recorded ``system`` object and the recorded per-process RAM and
CPU readings (`recorded.system_info`), so the exporter and the document see the same numbers
the recording holds; what it does not hold stays unknown.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import MappingProxyType

from gputaskman.base.readings import Snapshot
from gputaskman.document.reader import Document, SnapshotError, read_document
from gputaskman.offline.playback import RecordSource
from gputaskman.offline.recorded import system_info
from gputaskman.sampling import host


class RecordLoop:
    """The snapshots of a record file, one per sample, in a loop (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.source = RecordSource.open(path)
        if not self.source.frames:
            raise SnapshotError(f"{path}: no snapshot to replay")
        self.position = 0

    def prime(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _note(self, doc: Document, lineno: int) -> str:
        try:
            recorded = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(doc.taken))
        except (OverflowError, OSError, ValueError):
            recorded = f"at {doc.taken!r}"
        return (
            f"replayed recording: {self.source.path.name} line {lineno}, recorded {recorded}; "
            "not a measurement of this machine"
        )

    def sample_with_system(self) -> tuple[Snapshot, host.SystemInfo | None]:
        frames = self.source.frames
        last_error: SnapshotError | None = None
        for _ in range(len(frames)):  # a line that cannot be read is passed over
            i, self.position = self.position, (self.position + 1) % len(frames)
            try:
                doc = read_document(self.source.doc(i))
                return as_served(doc, self._note(doc, frames[i].lineno))
            except SnapshotError as exc:
                last_error = exc
        raise SnapshotError(f"{self.source.path}: no line can be read ({last_error})")


def as_served(doc: Document, note: str) -> tuple[Snapshot, host.SystemInfo | None]:
    """`doc` as a sample taken now: its snapshot with ``taken`` now and `note` added (unless
    it already has that note), and host.py's `SystemInfo` from its ``system`` object and
    per-process readings."""
    now = time.time()
    snap = doc.snapshot()
    notes = snap.notes if note in snap.notes else (*snap.notes, note)
    snap = dataclasses.replace(snap, taken=now, notes=notes)
    if doc.system is None:
        return snap, None
    procs = {}
    for row in doc.processes:
        ram, cpu = row.ram_bytes, row.cpu_percent
        if row.proc.host is None and (ram is not None or cpu is not None):
            procs[row.proc.pid] = host.ProcessUsage(
                row.proc.pid,
                row.proc.create_time,
                row.proc.name,
                None if ram is None or ram.value is None else int(ram.value),
                None if cpu is None or cpu.value is None else float(cpu.value),
                None if ram is None else ram.reason,
                None if cpu is None else cpu.reason,
            )
    system = dataclasses.replace(
        system_info(doc.system), taken=now, processes=MappingProxyType(procs)
    )
    return snap, system
