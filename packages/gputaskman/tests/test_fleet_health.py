"""The fleet table flags an unhealthy GPU, from a host's own document (whole or the table's
part) and from the series its serve exported to Prometheus (the table's series only), and
`serve`'s health and MIG series come back from Prometheus as the document has them. The GPU
is the mocked NVML one of tests/test_schema.py (MIG mode, health counters, a thermal slowdown,
an XID event): not validated on hardware."""

from __future__ import annotations

import dataclasses
import json
import re

from gputaskman.base.gpuhealth import UNHEALTHY, verdict
from gputaskman.base.readings import Reading, Reason
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import read_document, read_table_document
from gputaskman.fleet.poller import HostState
from gputaskman.fleet.promdoc import host_document, snapshot_document
from gputaskman.fleet.promseries import TABLE_REGEX, host_sample
from gputaskman.fleet.targets import parse_target
from gputaskman.fleet.view import fleet_rows, matches, render_text
from gputaskman.render.exporter import Cached, snapshot_families
from gputaskman.render.exporter_health import UNHEALTHY_SERIES
from test_fleet_promseries import _series
from test_schema import _mig_and_health_doc

BUS = "00000000:01:00.0"


def _state(doc) -> HostState:
    return HostState(parse_target("gpu1"), HostStatus.UP, None, doc)


def _healthy(doc: dict) -> dict:
    """The same document with every health reading that trips a check at zero."""
    doc = json.loads(json.dumps(doc))
    h = doc["adapters"][0]["health"]
    for key in ("xid_critical_errors", "ecc_volatile_uncorrected_errors", "clocks_event_reasons"):
        h[key]["value"] = 0
    return doc


def test_the_fleet_table_flags_an_unhealthy_gpu_and_only_it():
    doc = _mig_and_health_doc()
    body = json.dumps(doc).encode()
    for read in (read_document, read_table_document):
        (row,) = fleet_rows([_state(read(body))])
        assert row.gpu == "0 UNHEALTHY NVIDIA Mock GPU", row.gpu
        assert matches(row, "unhealthy")  # the filter finds the unhealthy GPUs
    assert "UNHEALTHY" in render_text([_state(read_document(body))])
    (fine,) = fleet_rows([_state(read_document(_healthy(doc)))])
    assert "UNHEALTHY" not in fine.gpu


def test_the_fleet_table_from_prometheus_flags_it_from_the_table_series_alone():
    snap = read_document(_mig_and_health_doc()).snapshot()
    table = [s for s in _series(snap) if re.fullmatch(TABLE_REGEX, s.metric["__name__"])]
    rebuilt, system = host_sample(table, note="test")
    (row,) = fleet_rows([_state(snapshot_document(rebuilt, system))])
    assert row.gpu == "0 UNHEALTHY NVIDIA Mock GPU", row.gpu


def test_health_and_mig_series_come_back_from_prometheus_as_the_document_has_them():
    snap = read_document(_mig_and_health_doc()).snapshot()
    names = {s.metric["__name__"] for s in _series(snap)}
    assert {
        "gputaskman_gpu_health_xid_critical_errors",
        "gputaskman_gpu_health_clocks_event_reasons",
        UNHEALTHY_SERIES,
        "gputaskman_gpu_mig_mode",
        "gputaskman_mig_info",
        "gputaskman_mig_memory_used_bytes",
        "gputaskman_mig_attributed_bytes",
        "gputaskman_process_mig_info",
    } <= names
    rebuilt, system = host_sample(_series(snap), note="test")
    known = {k: r for k, r in snap.health[BUS].items() if r.value is not None}
    assert {k: rebuilt.health[BUS][k].value for k in known} == {
        k: r.value for k, r in known.items()
    }
    assert verdict(rebuilt.health[BUS]).state == UNHEALTHY
    assert rebuilt.mig[BUS].mode.value == 1
    assert [dataclasses.astuple(i)[:3] for i in rebuilt.mig[BUS].instances] == [
        (1, 0, "MIG-mock-1-0")
    ]
    assert {p.pid: p.mig for p in rebuilt.processes} == {2**22 + 7: (1, 0)}
    doc, _ = host_document(rebuilt, system)
    assert snapshot_document(rebuilt, system) == doc


def test_unknown_health_exports_no_series_never_zero():
    snap = read_document(_mig_and_health_doc()).snapshot()
    gone = dict(snap.health[BUS])
    gone["fan_speed_percent"] = Reading.missing(Reason.NOT_SUPPORTED, "nvml:test")
    snap = dataclasses.replace(snap, health={BUS: gone})
    fams = list(snapshot_families(Cached(snap, None, snap.taken, 0.0), now=snap.taken))
    names = {s.name for fam in fams for s in fam.samples}
    assert "gputaskman_gpu_health_fan_speed_percent" not in names
    assert "gputaskman_gpu_health_ecc_volatile_uncorrected_errors" in names
