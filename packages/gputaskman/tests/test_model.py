"""The provenance rules that model.py enforces as code."""

from __future__ import annotations

import dataclasses
import math

import pytest
from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    Kind,
    Problem,
    ProcGpu,
    Reading,
    Reason,
    Snapshot,
)
from gputaskman.fixtures.demo import BUS0, BUS1, demo_snapshot
from hypothesis import given
from hypothesis import strategies as st


def proc(pid: int, dedicated: Reading, inferred: Reading | None = None, bus=BUS0) -> ProcGpu:
    return ProcGpu(pid, 100.0 + pid, f"p{pid}", bus, ("compute",), dedicated, inferred)


def test_reading_needs_exactly_one_of_value_and_reason():
    with pytest.raises(ValueError, match="needs a reason"):
        Reading(None, Kind.MEASURED, "x")
    with pytest.raises(ValueError, match="cannot also carry"):
        Reading(5, Kind.MEASURED, "x", Reason.DENIED)
    with pytest.raises(TypeError):
        Reading(True, Kind.MEASURED, "x")
    with pytest.raises(ValueError, match="non-finite"):
        Reading(math.nan, Kind.MEASURED, "x")
    with pytest.raises(TypeError):
        Reading(1, "measured", "x")  # type: ignore[arg-type]


def test_measured_zero_stays_zero_and_is_known():
    r = Reading.measured(0, "nvml")
    assert r.value == 0 and r.known and r.reason is None


def test_readings_are_frozen():
    r = Reading.measured(1, "s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.value = 2  # type: ignore[misc]


def test_shown_vram_prefers_measured_then_inferred_then_none():
    m = Reading.measured(10, "nvml")
    i = Reading.inferred(20, "rule")
    hidden = Reading.missing(Reason.HIDDEN, "nvml")
    assert proc(1, m, i).shown_vram is m
    assert proc(2, hidden, i).shown_vram is i
    assert proc(3, hidden).shown_vram is None
    assert (
        proc(4, hidden, Reading.missing(Reason.UNAVAILABLE, "rule", kind=Kind.INFERRED)).shown_vram
        is None
    )


def test_attributed_sums_measured_only_never_inferred():
    snap = Snapshot(
        1.0,
        "nvml",
        processes=(
            proc(1, Reading.measured(100, "nvml")),
            proc(2, Reading.missing(Reason.HIDDEN, "nvml"), Reading.inferred(5000, "rule")),
            proc(3, Reading.measured(0, "nvml")),
            proc(4, Reading.estimated(7000, "gguf")),  # estimated in `dedicated`: not summed
        ),
    )
    assert snap.attributed == 100
    assert snap.attributed_complete is False  # pid 2's memory is hidden


def test_attributed_is_none_when_nothing_measured_and_zero_when_measured_zero():
    hidden = Snapshot(1.0, "nvml", processes=(proc(1, Reading.missing(Reason.HIDDEN, "n")),))
    assert hidden.attributed is None
    zero = Snapshot(1.0, "nvml", processes=(proc(1, Reading.measured(0, "n")),))
    assert zero.attributed == 0 and zero.attributed_complete
    assert Snapshot(1.0, "nvml").attributed is None


def test_attributed_per_adapter_and_failed_list_makes_it_a_lower_bound():
    snap = demo_snapshot()
    assert snap.attributed_on(BUS1) == 1536 * 1024**2
    assert snap.attributed_complete_on(BUS1) is False  # graphics list failed on BUS1
    assert snap.attributed_complete_on(BUS0) is False  # python3's memory is hidden
    total = snap.attributed_on(BUS0) + snap.attributed_on(BUS1)
    assert snap.attributed == total


def test_candidates_without_gpu_context_do_not_break_completeness():
    snap = Snapshot(
        1.0,
        "nvml",
        processes=(
            proc(1, Reading.measured(5, "n")),
            proc(2, Reading.missing(Reason.NOT_LISTED, "n"), bus=None),
        ),
    )
    assert snap.attributed == 5 and snap.attributed_complete


def test_all_missing_metrics_cover_every_field():
    m = DeviceMetrics.all_missing(Reason.GPU_LOST, "nvml", "GPU is lost")
    for name in DeviceMetrics.__slots__:
        r = getattr(m, name)
        assert r.value is None and r.reason is Reason.GPU_LOST


def test_snapshot_availability_follows_backend_problem():
    p = Problem("backend.init", Reason.NO_LIBRARY, "x")
    assert not Snapshot(1.0, "nvml", problems=(p,), backend_problem=p).available
    assert Snapshot(1.0, "nvml").available


def test_process_key_distinguishes_reused_pid():
    a = ProcGpu(7, 1.0, "a", None, (), Reading.missing(Reason.NOT_LISTED, "n"))
    b = ProcGpu(7, 2.0, "b", None, (), Reading.missing(Reason.NOT_LISTED, "n"))
    assert a.key != b.key and a.started_at == 1.0


def test_adapter_lookup_by_bus_id_not_index():
    a = Adapter(0, "nvidia", "same name", None, BUS1, "nvml")
    b = Adapter(1, "nvidia", "same name", None, BUS0, "nvml")
    snap = Snapshot(1.0, "nvml", adapters=(a, b))
    assert snap.adapter(BUS0) is b and snap.adapter("nope") is None


@given(
    st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=2**44).map(lambda v: Reading.measured(v, "n")),
            st.integers(min_value=0, max_value=2**44).map(lambda v: Reading.inferred(v, "r")),
            st.sampled_from(list(Reason)).map(lambda r: Reading.missing(r, "n")),
        ),
        max_size=20,
    )
)
def test_attributed_equals_sum_of_measured_values(readings):
    snap = Snapshot(1.0, "nvml", processes=tuple(proc(i, r) for i, r in enumerate(readings)))
    measured = [r.value for r in readings if r.kind is Kind.MEASURED and r.value is not None]
    assert snap.attributed == (sum(measured) if measured else None)


def test_partial_metrics_say_what_the_backend_does_not_have() -> None:
    """Catches a backend helper that fills a missing field with 0 or drops its reason."""
    from gputaskman.base.readings import METRIC_NAMES, DeviceMetrics, Kind, Reading, Reason

    used = Reading.measured(5, "pdh")
    m = DeviceMetrics.partial("pdh", "not a PDH counter", memory_used_bytes=used)
    assert m.memory_used_bytes is used
    assert set(METRIC_NAMES) == set(DeviceMetrics.__slots__)
    for f in DeviceMetrics.__slots__:
        if f == "memory_used_bytes":
            continue
        r = getattr(m, f)
        assert (r.value, r.reason, r.kind, r.source) == (
            None,
            Reason.NOT_SUPPORTED,
            Kind.MEASURED,
            "pdh",
        ), f
        assert r.detail == f"{METRIC_NAMES[f]} is not a PDH counter"
    import pytest

    with pytest.raises(TypeError, match="power_watts"):
        DeviceMetrics.partial("pdh", "absent", power_watts=used)
