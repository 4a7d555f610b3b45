"""A process row's host memory and owner rebuilt from the series its serve exported
(`render.exporter_owners`): ``gputaskman_process_{swapped,locked,pinned}_bytes`` into a
`readings.ProcMemory` and ``gputaskman_process_owner_info``'s labels into a `readings.Owner`,
for `promseries`.

A row with none of the three memory series has no memory (None: its serve did not read it,
or is older); one with some lacks the others as unknown ("no series in Prometheus"). An owner
is rebuilt only from an info series, whose labels are the owner's fields (empty: not named);
a row without one has no owner (unknown), never "no pod".
"""

from __future__ import annotations

from collections.abc import Mapping

from gputaskman.base.readings import Owner, ProcMemory, Reading
from gputaskman.fleet.promreadings import absent

OWNER_INFO = "gputaskman_process_owner_info"
# the series' word -> the slot `promseries` keeps its reading in
MEMORY_SERIES = {"swapped": "swapped", "locked": "locked", "pinned": "pinned"}
_ABSENT = {slot: absent(f"gputaskman_process_{slot}_bytes") for slot in MEMORY_SERIES.values()}


def memory_from(readings: Mapping[str, Reading], swapped_to: str | None) -> ProcMemory | None:
    """The row's `ProcMemory` from the readings `promseries` kept by slot."""
    if not any(slot in readings for slot in MEMORY_SERIES.values()):
        return None
    got = {slot: readings.get(slot) or _ABSENT[slot] for slot in MEMORY_SERIES.values()}
    return ProcMemory(**got, swapped_to=swapped_to if got["swapped"].value is not None else None)


def owner_from(labels: Mapping[str, str]) -> Owner:
    """The `Owner` an owner info series' labels describe."""

    def text(key: str) -> str | None:
        return labels.get(key) or None

    return Owner(
        text("cgroup"),
        user=text("user"),
        pod_uid=text("pod_uid"),
        container_id=text("container_id"),
        container_runtime=text("container_runtime"),
        qos=text("qos"),
        slurm_job=text("slurm_job"),
        slurm_step=text("slurm_step"),
        unit=text("unit"),
        user_unit=labels.get("user_unit") == "true",
        session=text("session"),
        pod_name=text("pod_name"),
        pod_namespace=text("pod_namespace"),
        pod_source="prometheus" if text("pod_name") else None,
    )
