"""A host's snapshot rebuilt from its series (`fleet.promseries`): what `serve` exports comes
back with its kind, an absent series is unknown with a reason (never 0), and values no host
can have are refused with a reason and a problem. The series are the exporter's own
families for the demo and DRM fixture snapshots, labelled as Prometheus stores them."""

from __future__ import annotations

import json
import math

import pytest
from gputaskman.base.readings import Kind, Reason
from gputaskman.document.reader import read_document
from gputaskman.fixtures.demo import TAKEN, demo_snapshot
from gputaskman.fleet.promapi import Sample
from gputaskman.fleet.promseries import (
    NO_SERIES,
    host_document,
    host_snapshot,
    snapshot_document,
)
from gputaskman.render.exporter import Cached, snapshot_families
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fleet_tui import HERE


def _series(snapshot, instance: str = "gpu-node-01:9835") -> list[Sample]:
    out = []
    for fam in snapshot_families(Cached(snapshot, None, snapshot.taken, 0.01), now=snapshot.taken):
        for s in fam.samples:
            labels = {**s.labels, "__name__": s.name, "instance": instance, "job": "gputaskman"}
            out.append(Sample(labels, (0.0, float(s.value))))
    return out


def _drm_snapshot():
    line = (HERE / "recordings" / "drm.jsonl").read_text().splitlines()[0]
    return read_document(line.encode()).snapshot()


def _measured(snap) -> dict[tuple, float]:
    """Every measured number of a snapshot, by where it is."""
    out: dict[tuple, float] = {}
    for pci, m in snap.metrics.items():
        for fld in type(m).__dataclass_fields__:
            r = getattr(m, fld)
            if r.kind is Kind.MEASURED and r.value is not None:
                out[(pci, fld)] = r.value
    for p in snap.processes:
        for what, r in (("dedicated", p.dedicated), ("paged", p.paged), ("footprint", p.footprint)):
            if r is not None and r.kind is Kind.MEASURED and r.value is not None:
                out[(p.pid, p.adapter, what)] = r.value
        for engine, r in p.engines.items():
            if r.kind is Kind.MEASURED and r.value is not None:
                out[(p.pid, p.adapter, engine)] = r.value
    return out


@pytest.mark.parametrize("make", [demo_snapshot, _drm_snapshot], ids=["demo", "drm"])
def test_every_exported_measured_number_comes_back_with_its_kind(make):
    """Catches a series read under the wrong field or kind (an inferred value read as
    measured, a clock left in hertz), or a process merged with another GPU's."""
    original = make()
    rebuilt = host_snapshot(_series(original), note="test")
    assert _measured(rebuilt) == pytest.approx(_measured(original))
    assert len(_measured(rebuilt)) > 10
    for pci, m in original.metrics.items():
        for fld in type(m).__dataclass_fields__:
            was, now = getattr(m, fld), getattr(rebuilt.metrics[pci], fld)
            if was.value is not None:
                assert (now.value, now.kind) == (pytest.approx(was.value), was.kind), fld
    assert [a.pci_bus_id for a in rebuilt.adapters] == [a.pci_bus_id for a in original.adapters]
    assert rebuilt.taken == original.taken
    inferred = {(p.pid, p.adapter): p.inferred.value for p in original.processes if p.inferred}
    assert {
        (p.pid, p.adapter): p.inferred.value for p in rebuilt.processes if p.inferred
    } == inferred
    models = {(p.pid, p.model.name, p.model.evidence) for p in original.processes if p.model}
    assert {(p.pid, p.model.name, p.model.evidence) for p in rebuilt.processes if p.model} == models


def test_a_series_prometheus_does_not_have_is_unknown_with_a_reason_never_zero():
    """Catches an absent series read as 0 (a GPU whose memory series is missing would show
    0 B used, and a fleet total would count it)."""
    series = [
        s
        for s in _series(demo_snapshot())
        if s.labels["__name__"] not in ("gputaskman_gpu_memory_used_bytes",)
    ]
    snap = host_snapshot(series, note="test")
    for m in snap.metrics.values():
        r = m.memory_used_bytes
        assert r.value is None and r.reason is Reason.UNAVAILABLE and r.detail == NO_SERIES
    doc, body = host_document(snap)
    assert json.loads(body)["adapters"][0]["metrics"]["memory_used_bytes"]["value"] is None
    assert doc.adapters[0].metrics.memory_used_bytes.value is None


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("gputaskman_gpu_memory_total_bytes", -1.0, "impossible value -1"),
        ("gputaskman_gpu_memory_used_bytes", 1e15, "over the total"),
        ("gputaskman_gpu_utilization_percent", float("nan"), "impossible value nan"),
        ("gputaskman_process_vram_bytes", -4096.0, "impossible value -4096"),
    ],
)
def test_impossible_values_are_refused_with_a_reason_and_a_problem(name, value, says):
    """Catches negative bytes, used over total, or NaN shown as a number (or summed into
    the fleet's totals)."""
    series = _series(demo_snapshot())
    hit = next(i for i, s in enumerate(series) if s.labels["__name__"] == name)
    series[hit] = Sample(series[hit].labels, (0.0, value))
    snap = host_snapshot(series, note="test")
    pci = series[hit].labels["pci_bus_id"]
    if name.startswith("gputaskman_process_"):
        pid = int(series[hit].labels["pid"])
        r = next(p.dedicated for p in snap.processes if p.pid == pid and p.adapter == pci)
    else:
        fld = {"gputaskman_gpu_memory_total_bytes": "memory_total_bytes"}.get(
            name,
            "memory_used_bytes" if "used" in name else "util_gpu_percent",
        )
        r = getattr(snap.metrics[pci], fld)
    assert r.value is None and r.reason is Reason.QUERY_FAILED and says in r.detail
    assert any(says in (p.detail or "") and p.adapter == pci for p in snap.problems)
    host_document(snap)  # and it is still a document the one reader reads


def test_the_document_says_it_was_built_from_series():
    doc, _ = host_document(host_snapshot(_series(demo_snapshot()), note="built from X"))
    assert doc.notes == ("built from X",) and doc.taken == TAKEN


@pytest.mark.parametrize("make", [demo_snapshot, _drm_snapshot], ids=["demo", "drm"])
@pytest.mark.parametrize("damage", [None, "gputaskman_gpu_memory_used_bytes"])
def test_the_table_s_document_is_the_one_the_reader_reads_from_the_json(make, damage):
    """Catches the document built without JSON (the fleet table's, every second) drifting
    from the one the reader reads from the written document (what --json and record show):
    a sum, a time, a host reading or a problem that differs."""
    series = _series(make())
    if damage is not None:
        hit = next(i for i, s in enumerate(series) if s.labels["__name__"] == damage)
        series[hit] = Sample(series[hit].labels, (0.0, -1.0))
    snap = host_snapshot(series, note="test")
    assert snapshot_document(snap) == host_document(snap)[0]


_NAMES = sorted(
    {s.labels["__name__"] for s in _series(demo_snapshot())}
    | {"gputaskman_gpu_gtt_used_bytes", "gputaskman_process_x_utilization_runtime_percent"}
)
_LABEL = st.sampled_from(
    [
        "pid",
        "name",
        "pci_bus_id",
        "gpu",
        "model_name",
        "evidence",
        "confirmed",
        "provenance",
        "where",
        "reason",
        "vendor",
        "backend",
    ]
)
_TEXT = st.sampled_from(
    [
        "",
        "0",
        "1",
        "42",
        "windows:7",
        "x:",
        "00000000:01:00.0",
        "true",
        "measured",
        "estimated",
        "denied",
        "llama",
        "ü",
        "-3",
    ]
)
_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, -1.0, 1e15, 2.0**64, 0.5]),
)


@given(
    st.lists(
        st.tuples(st.sampled_from(_NAMES), st.dictionaries(_LABEL, _TEXT, max_size=6), _VALUE),
        max_size=40,
    )
)
@settings(max_examples=300, deadline=None)
def test_any_series_make_a_document_both_ways_alike_and_never_raise(raw):
    """Catches series that crash the fleet (a label missing, a PID that is not a number,
    NaN where a count goes), or a document built without JSON that differs from the
    reader's on any of them."""
    series = [
        Sample({**labels, "__name__": name, "instance": "h:1"}, (0.0, value))
        for name, labels, value in raw
    ]
    snap = host_snapshot(series, note="fuzz")
    doc, body = host_document(snap)
    assert snapshot_document(snap) == doc
    assert json.loads(body)["schema"] == "gputaskman.snapshot"
    for m in (a.metrics for a in doc.adapters):
        for r in (m.memory_used_bytes, m.memory_total_bytes, m.util_gpu_percent):
            assert r.value is None or (r.value >= 0 and math.isfinite(r.value))
