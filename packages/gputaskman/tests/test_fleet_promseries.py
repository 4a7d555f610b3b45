"""A host's snapshot rebuilt from its series (`fleet.promseries`): what `serve` exports comes
back with its kind, an absent series is unknown with a reason (never 0), and values no host
can have are refused with a reason and a problem. The series are the exporter's own
families for the demo and DRM fixture snapshots (with the host sample `serve` takes beside
them: the demo's, and the DRM recording's), labelled as Prometheus stores them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from gputaskman.base.readings import Kind, ProcGpu, Reading, Reason
from gputaskman.document.reader import read_document
from gputaskman.fixtures.demo import TAKEN, demo_snapshot, unavailable_snapshot
from gputaskman.fleet.promapi import Sample
from gputaskman.fleet.promdoc import host_document, snapshot_document
from gputaskman.fleet.promreadings import NO_SERIES, NOT_EXPORTED
from gputaskman.fleet.promseries import host_sample
from gputaskman.fleet.promsystem import CPU_KEYS, MEMORY_KEYS
from gputaskman.offline.recordloop import as_served
from gputaskman.render import report
from gputaskman.render.exporter import Cached, snapshot_families
from gputaskman.render.exporter_families import metric_name
from gputaskman.sampling import host
from gputaskman.serve.sources import DemoSource
from hypothesis import given, settings
from hypothesis import strategies as st
from prom_compare import differences, not_exported_violations
from test_fleet_tui import HERE


def _series(snapshot, instance: str = "gpu-node-01:9835", system=None) -> list[Sample]:
    out = []
    cached = Cached(snapshot, system, snapshot.taken, 0.01)
    for fam in snapshot_families(cached, now=snapshot.taken):
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
    rebuilt = host_sample(_series(original), note="test")[0]
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
    snap = host_sample(series, note="test")[0]
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
    snap = host_sample(series, note="test")[0]
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
    doc, _ = host_document(host_sample(_series(demo_snapshot()), note="built from X")[0])
    assert doc.notes == ("built from X",) and doc.taken == TAKEN


def _served_demo():
    """The demo as `serve --demo` samples it: the snapshot and host.py's `SystemInfo`."""
    return DemoSource().sample_with_system()


def _served_drm():
    """The DRM recording as `serve --replay` samples it (its host sample included)."""
    line = (HERE / "recordings" / "drm.jsonl").read_text().splitlines()[0]
    return as_served(read_document(line.encode()), "test")


@pytest.mark.parametrize("make", [_served_demo, _served_drm], ids=["demo", "drm"])
@pytest.mark.parametrize(
    "damage",
    [
        None,
        "gputaskman_gpu_memory_used_bytes",
        "gputaskman_system_memory_used_bytes",
        "gputaskman_process_ram_bytes",
    ],
)
def test_the_table_s_document_is_the_one_the_reader_reads_from_the_json(make, damage):
    """Catches the document built without JSON (the fleet table's, every second) drifting
    from the one the reader reads from the written document (what --json and record show):
    a sum, a time, a host reading, the system panel or a problem that differs."""
    snapshot, system = make()
    series = _series(snapshot, system=system)
    if damage is not None:
        hit = next(i for i, s in enumerate(series) if s.labels["__name__"] == damage)
        series[hit] = Sample(series[hit].labels, (0.0, -1.0))
    snap, sample = host_sample(series, note="test")
    assert snapshot_document(snap) == host_document(snap)[0]
    assert snapshot_document(snap, sample) == host_document(snap, sample)[0]
    assert host_document(snap, sample)[0].system is not None


# the system object's readings `serve` exports, by (section, key)
EXPORTED = {
    ("memory", "total_bytes"),
    ("memory", "available_bytes"),
    ("memory", "used_bytes"),
    ("memory", "cached_bytes"),
    ("swap", "total_bytes"),
    ("swap", "used_bytes"),
    ("cpu", "percent"),
}


def _system_readings(doc) -> dict[tuple, Reading]:
    """Every reading of a document's system panel and of its processes' RAM and CPU."""
    s = doc.system
    out: dict[tuple, Reading] = {}
    out.update({("memory", k): r for k, r in s.memory.items()})
    out.update({("cpu", k): r for k, r in s.cpu.items()})
    for k in ("total_bytes", "free_bytes", "used_bytes"):
        out[("swap", k)] = getattr(s.swap, k)
    for d in s.swap.devices or ():
        for k in ("size_bytes", "used_bytes", "priority"):
            out[("device", d.filename, d.type, k)] = getattr(d, k)
    for row in doc.processes:
        if row.proc.host is None:
            out[("process", row.proc.pid, row.proc.adapter, "ram")] = row.ram_bytes
            out[("process", row.proc.pid, row.proc.adapter, "cpu")] = row.cpu_percent
    return out


def _exported(key: tuple) -> bool:
    return (key[0] in ("process", "device") and key[-1] != "priority") or key in EXPORTED


@pytest.mark.parametrize("make", [_served_demo, _served_drm], ids=["demo", "drm"])
def test_the_system_panel_and_process_ram_cpu_come_back_as_polling_has_them(make):
    """Catches the system panel or a process's RAM / CPU lost on the way through
    Prometheus, read under the wrong key, process or kind, or shown as a number that was
    not exported (RAM free, load averages) instead of unknown."""
    snapshot, system = make()
    direct = read_document(report.to_json_dict(snapshot, system))
    doc, _ = host_document(*host_sample(_series(snapshot, system=system), note="test"))
    was, now = _system_readings(direct), _system_readings(doc)
    known = 0
    for key, r in was.items():
        got = now.get(key)
        if r is not None and r.value is not None and _exported(key):
            assert got is not None and (got.value, got.kind) == (r.value, r.kind), key
            known += 1
        elif got is not None:
            assert got.value is None and got.reason is Reason.UNAVAILABLE, key
            assert got.detail == (NO_SERIES if _exported(key) else NOT_EXPORTED), key
    assert known >= 8
    assert not [k for k in now if k not in was]  # no device or process made up
    assert doc.system.taken is None  # the host sample's own time is not exported
    if not direct.system.swap.devices:  # none listed: Prometheus cannot tell it from unknown
        assert doc.system.swap.devices is None and doc.system.swap.devices_reason == NO_SERIES


def test_the_system_object_keeps_every_key_a_host_sampler_writes():
    """Catches a key of host.py's samples missing from a host's view built from series
    (its panel would say "not recorded" instead of "not exported")."""
    assert tuple(f.name for f in dataclasses.fields(host.MemoryInfo)) == MEMORY_KEYS
    assert tuple(f.name for f in dataclasses.fields(host.CpuInfo)) == CPU_KEYS


def test_a_system_or_process_reading_of_another_kind_comes_back_with_it():
    """Catches a kind lost on the system panel or a process's host readings: an estimated
    RAM figure or a runtime-reported CPU load shown as measured. The system readings are
    the exporter's for a host sample carrying them (a replayed recording can); a process's
    are renamed as the exporter names such a reading (`metric_name`), since host.py
    measures every process reading it has."""
    snapshot, system = _served_demo()
    memory = dataclasses.replace(system.memory, cached_bytes=Reading.estimated(5 << 30, "x"))
    cpu = dataclasses.replace(system.cpu, percent=Reading.runtime(12.5, "x"))
    system = dataclasses.replace(system, memory=memory, cpu=cpu)
    series = _series(snapshot, system=system)
    ram = "gputaskman_process_ram_bytes"
    renamed = metric_name("gputaskman_process_ram", "bytes", Kind.ESTIMATED)
    series = [
        Sample({**s.labels, "__name__": renamed}, s.value)
        if s.labels["__name__"] == ram and s.labels["pid"] == "4242"
        else s
        for s in series
    ]
    doc, _ = host_document(*host_sample(series, note="test"))
    got = doc.system.memory["cached_bytes"]
    assert (got.value, got.kind) == (5 << 30, Kind.ESTIMATED)
    assert got.source == "prometheus:gputaskman_system_memory_cached_estimated_bytes"
    got = doc.system.cpu["percent"]
    assert (got.value, got.kind) == (12.5, Kind.RUNTIME)
    (row,) = [r for r in doc.processes if r.proc.pid == 4242]
    assert (row.ram_bytes.value, row.ram_bytes.kind) == (6 << 30, Kind.ESTIMATED)


def test_a_system_series_prometheus_does_not_have_is_unknown_with_a_reason_never_zero():
    """Catches an absent system or process series read as 0 (0 B of RAM used, a process
    at 0 % CPU), or a host without any shown with a system panel of unknowns."""
    snapshot, system = _served_demo()
    gone = {
        "gputaskman_system_memory_used_bytes",
        "gputaskman_system_cpu_percent",
        "gputaskman_system_swap_device_size_bytes",
        "gputaskman_system_swap_device_used_bytes",
    }
    series = [
        s
        for s in _series(snapshot, system=system)
        if s.labels["__name__"] not in gone
        and not (
            s.labels["__name__"] == "gputaskman_process_cpu_percent" and s.labels["pid"] == "4242"
        )
    ]
    doc, body = host_document(*host_sample(series, note="test"))
    for r in (doc.system.memory["used_bytes"], doc.system.cpu["percent"]):
        assert r.value is None and r.reason is Reason.UNAVAILABLE and r.detail == NO_SERIES
    assert doc.system.swap.devices is None and doc.system.swap.devices_reason == NO_SERIES
    (row,) = [r for r in doc.processes if r.proc.pid == 4242]
    assert row.cpu_percent.value is None and row.cpu_percent.detail == NO_SERIES
    assert row.ram_bytes.value == 6 << 30
    assert json.loads(body)["system"]["memory"]["used_bytes"]["value"] is None
    # a host that exported no system series has no system object
    bare = [s for s in series if not s.labels["__name__"].startswith("gputaskman_system_")]
    assert host_document(*host_sample(bare, note="test"))[0].system is None


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("gputaskman_system_memory_total_bytes", -1.0, "impossible value -1"),
        ("gputaskman_system_memory_used_bytes", 1e15, "over the total"),
        ("gputaskman_system_swap_used_bytes", 1e15, "over the total"),
        ("gputaskman_system_swap_device_used_bytes", 1e15, "over the size"),
        ("gputaskman_system_cpu_percent", float("nan"), "impossible value nan"),
        ("gputaskman_system_cpu_percent", 150.0, "over 100 percent"),
        ("gputaskman_process_ram_bytes", -4096.0, "impossible value -4096"),
        ("gputaskman_process_cpu_percent", float("inf"), "impossible value inf"),
    ],
)
def test_impossible_system_and_process_values_are_refused_with_a_reason_and_a_problem(
    name, value, says
):
    """Catches negative RAM, used over total, NaN or a CPU load no host can have shown as a
    number on the system panel or a process's row."""
    snapshot, system = _served_demo()
    series = _series(snapshot, system=system)
    hit = next(i for i, s in enumerate(series) if s.labels["__name__"] == name)
    series[hit] = Sample(series[hit].labels, (0.0, value))
    doc, _ = host_document(*host_sample(series, note="test"))
    labels = series[hit].labels
    if name.startswith("gputaskman_process_"):
        (row,) = [r for r in doc.processes if r.proc.pid == int(labels["pid"])]
        r = row.ram_bytes if "ram" in name else row.cpu_percent
    elif "device" in name:
        (d,) = doc.system.swap.devices
        r = d.used_bytes
    else:
        section = name.split("_")[2]
        key = "percent" if section == "cpu" else name.split("_")[3] + "_bytes"
        r = getattr(doc.system, section)
        r = r[key] if isinstance(r, dict) else getattr(r, key)
    assert r.value is None and r.reason is Reason.QUERY_FAILED and says in r.detail
    assert any(says in (p.detail or "") for p in doc.problems)


_DEMO, _DEMO_SYSTEM = _served_demo()
_NAMES = sorted(
    {s.labels["__name__"] for s in _series(_DEMO, system=_DEMO_SYSTEM)}
    | {
        "gputaskman_gpu_gtt_used_bytes",
        "gputaskman_process_x_utilization_runtime_percent",
        "gputaskman_system_memory_cached_estimated_bytes",
        "gputaskman_process_cpu_runtime_percent",
        "gputaskman_gpu_health_fan_speed_percent",
        "gputaskman_gpu_health_xid_critical_errors_inferred",
        "gputaskman_gpu_unhealthy",
        "gputaskman_gpu_mig_mode",
        "gputaskman_mig_info",
        "gputaskman_mig_memory_used_bytes",
        "gputaskman_mig_attributed_bytes",
        "gputaskman_process_mig_info",
    }
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
        "device",
        "type",
        "gpu_instance",
        "compute_instance",
        "mig_uuid",
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
    snap, system = host_sample(series, note="fuzz")
    doc, body = host_document(snap, system)
    assert snapshot_document(snap, system) == doc
    assert snapshot_document(snap) == host_document(snap)[0]
    assert json.loads(body)["schema"] == "gputaskman.snapshot"
    for m in (a.metrics for a in doc.adapters):
        for r in (m.memory_used_bytes, m.memory_total_bytes, m.util_gpu_percent):
            assert r.value is None or (r.value >= 0 and math.isfinite(r.value))
    readings = [r for row in doc.processes for r in (row.ram_bytes, row.cpu_percent)]
    if doc.system is not None:
        s = doc.system
        readings += [*s.memory.values(), *s.cpu.values(), s.swap.total_bytes, s.swap.used_bytes]
        for total, used in [
            (s.memory["total_bytes"], s.memory["used_bytes"]),
            (s.swap.total_bytes, s.swap.used_bytes),
            *((d.size_bytes, d.used_bytes) for d in s.swap.devices or ()),
        ]:
            assert None in (total.value, used.value) or used.value <= total.value
    for r in readings:
        assert r.value is None or (r.value >= 0 and math.isfinite(r.value))


# ------------------------------------------------------------------ every exported field


def _served_wsl():
    """The demo with rows as the WSL backend builds them (mocked: no Windows host here): a
    Windows host row, a row whose bytes that host row's measured total counts (its own VRAM
    unknown, `parent_pid` set), and an inferred value that admits one explanation."""
    snapshot, system = _served_demo()
    bus = snapshot.adapters[0].pci_bus_id
    vmwp = ProcGpu(
        4, None, "vmwp.exe", bus, ("compute",), Reading.measured(3 << 30, "pdh"), host="windows"
    )
    child = ProcGpu(
        8080,
        None,
        "python3",
        bus,
        ("compute", "graphics"),
        Reading.missing(Reason.UNAVAILABLE, "dxg", "inside vmwp.exe's total"),
        inferred=Reading.inferred(1 << 30, "wsl:context"),
        parent_pid=4,
        unique=True,
    )
    return dataclasses.replace(snapshot, processes=(*snapshot.processes, vmwp, child)), system


def _served_mig_and_health():
    """A mocked NVML GPU in MIG mode with health counters, a thermal slowdown and an XID
    event (tests/test_schema.py's), and the demo's host sample."""
    from test_schema import _mig_and_health_doc

    doc = _mig_and_health_doc()
    _, system = _served_demo()
    return read_document(doc).snapshot(), system


def _served_down():
    """A host whose backend is down (no NVML library), with its host sample."""
    _, system = _served_demo()
    return unavailable_snapshot(), system


@pytest.mark.parametrize(
    "make",
    [_served_demo, _served_drm, _served_wsl, _served_mig_and_health, _served_down],
    ids=["demo", "drm", "wsl", "mig-health", "down"],
)
def test_a_host_read_from_its_series_agrees_with_its_own_document_on_every_exported_field(make):
    """Catches a field serve exports that comes back other than its own document has it (a
    GPU's lower bound, a process row without a GPU, the driver version, contexts, a row
    counted in its parent's total, the backend's problem), and one it does not export
    shown with a value instead of "not exported to Prometheus" (tests/prom_compare.py)."""
    snapshot, system = make()
    direct = json.loads(json.dumps(report.to_json_dict(snapshot, system)))
    _, body = host_document(*host_sample(_series(snapshot, system=system), note="test"))
    prom = json.loads(body)
    assert differences(direct, prom) == []
    assert not_exported_violations(prom) == []


def test_a_lower_bound_an_older_serve_exported_without_its_gpu_stays_a_lower_bound():
    """Catches a GPU shown complete when its serve said its sum is a lower bound
    (``gputaskman_gpu_attributed_complete 0``) but its problems name no GPU, as an older
    serve's did: the sum must not read as the whole."""
    series = [
        Sample(
            {k: v for k, v in s.labels.items() if k not in ("gpu", "pci_bus_id")}
            if s.labels["__name__"] == "gputaskman_sample_problems"
            else s.labels,
            s.value,
        )
        for s in _series(demo_snapshot())
    ]
    snap, _ = host_sample(series, note="test")
    second = snap.adapters[1].pci_bus_id
    assert snap.attributed_complete_on(second) is False
    (why,) = [p for p in snap.problems if p.adapter == second]
    assert why.where == "processes.unexplained" and "lower bound" in why.detail
    doc = json.loads(host_document(snap)[1])
    assert doc["adapters"][1]["process_list"]["unexplained"]["reason"] == "unavailable"


def test_an_older_serve_s_doubled_engine_name_reads_as_the_same_engine():
    """Catches the engine shares of hosts still on an older serve
    (``gputaskman_process_gpu_percent_utilization_percent``) lost or read as another
    engine while a fleet is upgraded."""
    old = "gputaskman_process_gpu_percent_utilization_percent"
    series = [
        Sample({**s.labels, "__name__": old}, s.value)
        if s.labels["__name__"] == "gputaskman_process_gpu_utilization_percent"
        else s
        for s in _series(demo_snapshot())
    ]
    snap, _ = host_sample(series, note="test")
    (llama,) = [p for p in snap.processes if p.pid == 4242]
    assert list(llama.engines) == ["gpu_percent"] and llama.engines["gpu_percent"].value == 87


def test_the_host_view_says_n_a_not_exported_where_serve_exports_nothing():
    """Catches a host view built from series that shows "not scanned yet" (a scan that
    will never come), RUNTIMES as pending ("…") or a process's contexts as "none" when
    they were exported."""
    from gputaskman.offline.recorded import replay_objects
    from gputaskman.render import text_report
    from gputaskman.tui.widgets.inspector import inspect_text

    snapshot, system = _served_demo()
    doc, _ = host_document(*host_sample(_series(snapshot, system=system), note="test"))
    snap, sample = replay_objects(doc)
    lookup = report.proc_host_lookup(sample)
    (llama,) = [p for p in snap.processes if p.pid == 4242]
    cells = text_report.process_cells(llama, lookup, snap)
    cells = dict(zip(text_report.PROCESS_COLUMNS, cells, strict=True))
    assert cells["RUNTIMES"] == "n/a"
    text = inspect_text(llama, snap, sample)
    assert "scan: unavailable — not exported to Prometheus" in text
    assert "contexts compute" in text and "not scanned yet" not in text
