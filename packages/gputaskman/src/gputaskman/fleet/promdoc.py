"""A host's snapshot document from the `Snapshot` (and host sample) that `promseries` built
from its series: written and read back as every other document is (`host_document`, what
``fleet --json`` and ``fleet record`` write), or built without the JSON for the fleet table
(`snapshot_document`, held equal to the first by a differential test).
"""

from __future__ import annotations

import json

from gputaskman.base.readings import Reading, Reason, Snapshot
from gputaskman.document.doctypes import AdapterDoc, ProcessDoc
from gputaskman.document.reader import Document, read_document
from gputaskman.offline.recorded import RecordedSystem
from gputaskman.render import report


def host_document(
    snapshot: Snapshot, system: RecordedSystem | None = None
) -> tuple[Document, bytes]:
    """`snapshot` with its host sample `system` (`host_sample`'s) as a snapshot document: the
    typed `Document` and the JSON bytes it was read from (what ``fleet --json`` and ``fleet
    record`` write)."""
    body = json.dumps(report.to_json_dict(snapshot, system), allow_nan=False, separators=(",", ":"))
    raw = body.encode()
    return read_document(raw), raw


_NOT_SAMPLED = Reading.missing(Reason.UNAVAILABLE, report.HOST_SOURCE, "host not sampled")
_NOT_IN_SAMPLE = Reading.missing(
    Reason.UNAVAILABLE, report.HOST_SOURCE, "process not in host sample"
)


def _iso(taken: float) -> str | None:
    when = report.utc_of(taken)  # as the writer writes ``taken_iso``
    return None if when is None else when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def snapshot_document(snapshot: Snapshot, system: RecordedSystem | None = None) -> Document:
    """`snapshot` as the `Document` `host_document` reads from its JSON, built without
    writing and reading it: what the fleet table needs, several hundred times a second in a
    large fleet (a differential test holds the two equal)."""
    adapters = tuple(
        AdapterDoc(
            a.index,
            a.vendor,
            a.name,
            a.uuid,
            a.pci_bus_id,
            a.backend,
            snapshot.metrics.get(a.pci_bus_id),
            dict(snapshot.extra_metrics.get(a.pci_bus_id, {})),
            snapshot.attributed_on(a.pci_bus_id),
            snapshot.attributed_complete_on(a.pci_bus_id),
            dict(snapshot.health.get(a.pci_bus_id, {})),
            snapshot.mig.get(a.pci_bus_id),
        )
        for a in snapshot.adapters
    )
    processes = []
    for p in snapshot.processes:
        # the writer's words for a process without the host's readings
        if p.host is None:
            none = _NOT_SAMPLED if system is None else _NOT_IN_SAMPLE
            got = {} if system is None else system.process_readings(p.pid, p.create_time)
        else:
            why = f"a {p.host} process: not in this machine's host sample"
            none = Reading.missing(Reason.UNAVAILABLE, report.HOST_SOURCE, why)
            got = {}
        processes.append(ProcessDoc(p, got.get("ram_bytes", none), got.get("cpu_percent", none)))
    return Document(
        snapshot.taken,
        snapshot.backend,
        adapters,
        tuple(processes),
        snapshot.problems,
        snapshot.notes,
        snapshot.driver_version,
        snapshot.backend_problem,
        None,
        None if system is None else system.doc,
        _iso(snapshot.taken),
        snapshot.attributed,
        snapshot.attributed_complete,
    )
