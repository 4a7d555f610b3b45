"""MIG instances through the mocked NVML of test_nvml_mocked (this machine has no MIG-capable
GPU, and a lent machine's MIG mode is never changed): not validated on hardware. Each process
is attributed to its instance and never to the parent GPU twice."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
from gputaskman.backends.nvml import NvmlBackend
from gputaskman.base import schema
from gputaskman.base.gpuhealth import instance_attributed
from gputaskman.base.readings import Kind, Reason
from gputaskman.document.reader import read_document
from gputaskman.render import report, report_health, text_report
from gputaskman.sampling.collector import Collector, NullScanner
from test_nvml_mocked import BUS_A, GIB, MockedNvml, device, err, mig_device, proc

A = BUS_A.lower()


def mig_gpu(**over):
    """An 80 GiB GPU in MIG mode: instance 1/0 (40 GiB) runs PIDs 500 and 501, a gap at
    index 1, instance 2/0 (20 GiB) runs PID 502. Its parent-level lists (an aggregate
    NVML gives privileged callers) name the same processes: asking them would double count."""
    return device(
        BUS_A,
        memory=SimpleNamespace(total=80 * GIB, reserved=0, free=0, used=30 * GIB),
        mig_mode=[1, 1],
        mig=[
            mig_device(1, 0, 40 * GIB, 25 * GIB, [proc(500, 20 * GIB), proc(501, 4 * GIB)]),
            None,
            mig_device(2, 0, 20 * GIB, 5 * GIB, [proc(502, 5 * GIB)]),
        ],
        compute=[proc(500, 20 * GIB), proc(501, 4 * GIB), proc(502, 5 * GIB)],
        **over,
    )


def snap_of(dev):
    return Collector(source=NvmlBackend(MockedNvml([dev])), scanner=NullScanner()).sample()


def test_nvml_mocked_mig_processes_are_on_their_instance_and_counted_once():
    s = NvmlBackend(MockedNvml([mig_gpu()])).sample()
    state = s.mig[A]
    assert state.mode.value == 1 and state.mode.kind is Kind.MEASURED
    assert [(i.gpu_instance_id, i.compute_instance_id) for i in state.instances] == [
        (1, 0),
        (2, 0),
    ]
    one = state.instances[0]
    assert one.memory_total_bytes.value == 40 * GIB and one.memory_used_bytes.value == 25 * GIB
    assert one.uuid == "MIG-mock-1-0"
    rows = {p.pid: p.mig for p in s.processes}
    assert rows == {500: (1, 0), 501: (1, 0), 502: (2, 0)}  # one row each, never twice
    assert s.problems == ()  # the gap at index 1 (NOT_FOUND) is no problem
    snap = snap_of(mig_gpu())
    assert snap.attributed_on(A) == 29 * GIB  # not 58: the parent's lists were not added
    sums = [instance_attributed(snap, A, i) for i in snap.mig[A].instances]
    assert sums == [(24 * GIB, True), (5 * GIB, True)]
    assert sum(t for t, _ in sums) == snap.attributed_on(A)


def test_nvml_mocked_mig_disabled_lists_the_parent_as_before():
    s = NvmlBackend(MockedNvml([device(BUS_A, mig_mode=[0, 0])])).sample()
    assert s.mig[A].mode.value == 0 and s.mig[A].instances == ()
    (p,) = s.processes
    assert p.pid == 100 and p.mig is None


def test_nvml_mocked_gpu_without_mig_is_na_not_disabled_and_asked_once():
    lib = MockedNvml([device(BUS_A)])
    backend = NvmlBackend(lib)
    backend.sample()
    s = backend.sample()
    mode = s.mig[A].mode
    assert mode.value is None and mode.reason is Reason.NOT_SUPPORTED
    assert lib.calls.count("mig_mode") == 1
    assert report_health.mig_lines(s_snap := snap_of(device(BUS_A)), A) == []
    assert s_snap.processes[0].mig is None


def test_nvml_mocked_mig_failed_instance_list_makes_its_sums_lower_bounds():
    dev = mig_gpu()
    dev["mig"][2]["compute"] = err(pynvml.NVML_ERROR_NO_PERMISSION)
    snap = snap_of(dev)
    (pr,) = snap.problems
    assert (pr.where, pr.reason, pr.adapter) == ("processes.mig.2.0", Reason.DENIED, A)
    one, two = snap.mig[A].instances
    assert instance_attributed(snap, A, one) == (24 * GIB, True)
    assert instance_attributed(snap, A, two) == (None, False)
    assert snap.attributed_complete_on(A) is False  # the GPU's sum is a lower bound too


def test_nvml_mocked_mig_hidden_memory_is_na_and_the_instance_sum_a_lower_bound():
    dev = mig_gpu()
    dev["mig"][0]["compute"] = [proc(500, None), proc(501, 4 * GIB)]
    snap = snap_of(dev)
    hidden = next(p for p in snap.processes if p.pid == 500)
    assert hidden.dedicated.value is None and hidden.dedicated.reason is Reason.HIDDEN
    assert instance_attributed(snap, A, snap.mig[A].instances[0]) == (4 * GIB, False)


def test_nvml_mocked_mig_process_on_two_instances_is_one_row_credited_to_neither():
    dev = mig_gpu()
    dev["mig"][2]["compute"] = [proc(502, 5 * GIB), proc(500, 1 * GIB)]
    snap = snap_of(dev)
    rows = [p for p in snap.processes if p.pid == 500]
    assert len(rows) == 1 and rows[0].mig is None
    assert rows[0].dedicated.value == 21 * GIB  # both measured slices, each once
    assert snap.attributed_on(A) == 30 * GIB
    for inst in snap.mig[A].instances:
        assert instance_attributed(snap, A, inst)[1] is False
    assert {p.reason for p in snap.problems} == {Reason.SHARED}
    assert snap.attributed_complete_on(A) is True  # the GPU's own sum is whole


def test_nvml_mocked_mig_in_the_json_document_text_and_read_back():
    snap = snap_of(mig_gpu())
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == [] and report.null_rule_violations(doc) == []
    mig = doc["adapters"][0]["mig"]
    assert mig["mode"]["value"] == 1
    assert mig["instances"][0]["attributed_bytes"] == 24 * GIB
    assert mig["instances"][0]["attributed_complete"] is True
    row = next(p for p in doc["processes"] if p["pid"] == 502)
    assert row["mig"] == {"gpu_instance_id": 2, "compute_instance_id": 0}
    back = read_document(doc)
    assert back.adapters[0].mig == snap.mig[A]
    assert {p.proc.pid: p.proc.mig for p in back.processes} == {
        p.pid: p.mig for p in snap.processes
    }
    assert report.to_json_dict(back.snapshot(), None)["adapters"][0]["mig"] == mig
    lines = report_health.mig_lines(snap, A)
    assert lines[0].startswith("MIG     enabled, 2 instance(s)")
    assert "1/0  memory 25.0 GiB / 40.0 GiB  attributed 24.0 GiB" in lines[1]
    text = text_report.render_text(snap, None)
    assert "MIG     enabled" in text and "mig 2/0" in text
