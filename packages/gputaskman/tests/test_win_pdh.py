"""Windows PDH counters: instance-name parsing and aggregation, on recorded-shape inputs.

This machine is Linux with no GPU, so no counter here was measured. The instance names
follow the shape Windows publishes
(``pid_<pid>_luid_0x<hi>_0x<lo>_phys_<n>_eng_<n>_engtype_<type>``, hex in either case,
engine types such as 3D, Copy, VideoDecode, VideoEncode, Compute_0,
JPEG_Decode_0, OFA_0, Security, VR) as quoted from ``Get-Counter`` output in public
projects' tests; the values are made up. `FakePdh` replaces the ctypes layer (mocked
Windows API: the test names say so).
"""

from __future__ import annotations

import ctypes
import math

import pytest
from gputaskman.backends.win import pdh
from gputaskman.backends.win.pdh import (
    ADAPTER_DEDICATED,
    ADAPTER_SHARED,
    ENGINE,
    LOCAL,
    NON_LOCAL,
    CounterRead,
    aggregate,
    engine_name,
    parse_instance,
)
from gputaskman.base import schema
from gputaskman.base.readings import Kind, Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from hypothesis import given
from hypothesis import strategies as st

MIB = 1024**2
LUID_A = "luid_0x00000000_0x0000d1a2"
LUID_B = "luid_0x00000000_0x0000c9a5"


def name(pid: int | None, luid: str = "0x00000000_0x0000D1A2", rest: str = "_phys_0") -> str:
    return (f"pid_{pid}_" if pid is not None else "") + f"luid_{luid}{rest}"


def reads() -> dict[str, CounterRead]:
    """A healthy second-sample read: two processes on adapter A, one also on adapter B."""
    base = {
        LOCAL: CounterRead.ok(
            {
                name(4242): 3000 * MIB,  # llama-server
                name(1234): 120 * MIB,  # dwm.exe
                name(77): 0,  # a process with a context but no local memory: a measured 0
                name(4242, "0x00000000_0x0000C9A5"): 10 * MIB,
            }
        ),
        NON_LOCAL: CounterRead.ok({name(4242): 64 * MIB, name(1234): 200 * MIB, name(77): 0}),
        ENGINE: CounterRead.ok(
            {
                name(4242, rest="_phys_0_eng_0_engtype_3D"): 10.0,
                name(4242, rest="_phys_0_eng_5_engtype_Compute_0"): 85.5,
                name(4242, rest="_phys_0_eng_6_engtype_Compute_0"): 12.0,
                name(1234, rest="_phys_0_eng_0_engtype_3D"): 4.0,
                name(1234, rest="_phys_0_eng_1_engtype_Copy"): 0.0,
                name(9, rest="_phys_0_eng_3_engtype_VideoDecode"): 20.0,
            }
        ),
        ADAPTER_DEDICATED: CounterRead.ok(
            {name(None): 3500 * MIB, name(None, "0x00000000_0x0000C9A5"): 12 * MIB}
        ),
        ADAPTER_SHARED: CounterRead.ok({name(None): 300 * MIB}),
    }
    return base


@pytest.mark.parametrize(
    ("text", "pid", "luid", "phys", "eng", "engtype"),
    [
        ("pid_1234_luid_0x00000000_0x0000D1A2_phys_0_eng_0_engtype_3D", 1234, LUID_A, 0, 0, "3D"),
        (
            "pid_1212_luid_0x00000000_0x00005c30_phys_0_eng_0_engtype_3d",
            1212,
            "luid_0x00000000_0x00005c30",
            0,
            0,
            "3d",
        ),
        (
            "PID_7_LUID_0X00000000_0X0000D1A2_PHYS_1_ENG_12_ENGTYPE_JPEG_Decode_0",
            7,
            LUID_A,
            1,
            12,
            "JPEG_Decode_0",
        ),
        (
            "pid_8_luid_0x00000001_0x0000D1A2_phys_0_eng_2_engtype_Video Codec",
            8,
            "luid_0x00000001_0x0000d1a2",
            0,
            2,
            "Video Codec",
        ),
        (
            "pid_9_luid_0x0_0x1_phys_0_eng_0_engtype_3D#1",
            9,
            "luid_0x00000000_0x00000001",
            0,
            0,
            "3D",
        ),
        ("pid_4242_luid_0x00000000_0x0000D1A2_phys_0", 4242, LUID_A, 0, None, None),
        ("luid_0x00000000_0x0000D1A2_phys_0", None, LUID_A, 0, None, None),
        ("  pid_5_luid_0x00000000_0x0000D1A2_phys_0  ", 5, LUID_A, 0, None, None),
    ],
)
def test_parse_instance_reads_recorded_shapes(text, pid, luid, phys, eng, engtype):
    i = parse_instance(text)
    assert i is not None
    assert (i.pid, i.luid, i.phys, i.eng, i.engtype) == (pid, luid, phys, eng, engtype)


@pytest.mark.parametrize(
    "text", ["_Total", "", "pid_x_luid", "pid_12_luid_0xZZ_0x1_phys_0", "luid_0x1", "dwm.exe"]
)
def test_parse_instance_refuses_what_it_cannot_read(text):
    assert parse_instance(text) is None


@given(st.text(max_size=200))
def test_parse_instance_fuzz_never_raises(text):
    i = parse_instance(text)
    assert i is None or i.luid.startswith("luid_0x")


@given(
    st.integers(0, 2**31),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 9),
    st.integers(0, 64),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_ ]{0,20}", fullmatch=True),
    st.booleans(),
)
def test_parse_instance_fuzz_round_trip(pid, hi, lo, phys, eng, engtype, upper):
    text = f"pid_{pid}_luid_0x{hi:08X}_0x{lo:08x}_phys_{phys}_eng_{eng}_engtype_{engtype}"
    i = parse_instance(text.upper() if upper else text)
    assert i is not None
    assert (i.pid, i.luid, i.phys, i.eng) == (pid, f"luid_0x{hi:08x}_0x{lo:08x}", phys, eng)
    assert i.engtype is not None and i.engtype.lower() == engtype.strip().lower()


def test_engine_names_become_reading_keys():
    assert engine_name("3D") == "3d_percent"
    assert engine_name("VideoDecode") == "videodecode_percent"
    assert engine_name("Compute_0") == "compute_0_percent"
    assert engine_name("Video Codec") == "video_codec_percent"
    assert engine_name("@@") == "unknown_percent"


def test_pdh_mocked_process_memory_is_local_usage_and_paged_is_non_local():
    v = aggregate(reads())
    llama = v.processes[(4242, LUID_A)]
    assert llama.local.value == 3000 * MIB and llama.local.kind is Kind.MEASURED
    assert "Local Usage" in llama.local.source and "Dedicated" not in llama.local.source
    assert llama.non_local.value == 64 * MIB and "Non Local Usage" in llama.non_local.source
    # the same process on a second adapter is a separate row, never merged
    assert v.processes[(4242, LUID_B)].local.value == 10 * MIB
    assert v.processes[(4242, LUID_B)].non_local.reason is Reason.NOT_LISTED
    # a measured zero stays 0
    assert v.processes[(77, LUID_A)].local.value == 0
    assert v.processes[(77, LUID_A)].local.reason is None


def test_pdh_mocked_adapter_reference_total_is_adapter_dedicated_usage():
    v = aggregate(reads())
    a = v.adapters[LUID_A]
    assert a.dedicated_usage.value == 3500 * MIB
    assert "GPU Adapter Memory" in a.dedicated_usage.source
    assert a.shared_usage.value == 300 * MIB
    # the per-process sum (3120 MiB) is not the reference; both are kept apart
    assert sum(p.local.value or 0 for k, p in v.processes.items() if k[1] == LUID_A) == 3120 * MIB


def test_pdh_mocked_phys_instances_of_one_process_add_up():
    r = reads() | {
        LOCAL: CounterRead.ok({name(5, rest="_phys_0"): 100, name(5, rest="_phys_1"): 23})
    }
    assert aggregate(r).processes[(5, LUID_A)].local.value == 123


def test_pdh_mocked_engines_busiest_per_process_and_summed_per_adapter_engine():
    v = aggregate(reads())
    e = v.processes[(4242, LUID_A)].engines
    assert e["compute_0_percent"].value == 85.5  # busiest Compute_0 engine, not 97.5
    assert e["3d_percent"].value == 10.0
    assert e["gpu_percent"].value == 85.5
    dwm = v.processes[(1234, LUID_A)].engines
    assert dwm["copy_percent"].value == 0.0 and dwm["copy_percent"].reason is None
    a = v.adapters[LUID_A]
    # engine 3D (phys 0, eng 0) is used by two processes: 10 + 4
    assert a.engines["3d_percent"].value == 14.0
    assert a.util_percent.value == 85.5
    # process 9 has engine time but no memory instance: its memory is not listed, not 0
    p9 = v.processes[(9, LUID_A)]
    assert p9.local.value is None and p9.local.reason is Reason.NOT_LISTED
    assert p9.engines["videodecode_percent"].value == 20.0


def test_pdh_mocked_first_engine_sample_is_unknown_never_zero():
    v = aggregate(reads() | {ENGINE: CounterRead.failed(pdh.PDH_INVALID_DATA)})
    g = v.processes[(4242, LUID_A)].engines["gpu_percent"]
    assert g.value is None and g.reason is Reason.UNAVAILABLE and "two samples" in (g.detail or "")
    assert v.adapters[LUID_A].util_percent.value is None
    # memory does not depend on the engine counter
    assert v.processes[(4242, LUID_A)].local.value == 3000 * MIB


def test_pdh_mocked_missing_counter_set_is_not_supported_with_reason():
    v = aggregate(
        reads()
        | {
            LOCAL: CounterRead.failed(pdh.PDH_CSTATUS_NO_OBJECT),
            NON_LOCAL: CounterRead.failed(pdh.PDH_CSTATUS_NO_OBJECT),
        }
    )
    p = v.processes[(4242, LUID_A)]
    assert p.local.value is None and p.local.reason is Reason.NOT_SUPPORTED
    assert "0xC0000BB8" in (p.local.detail or "")
    assert LOCAL in v.failures
    # engine readings survive: availability is independent
    assert p.engines["gpu_percent"].value == 85.5


def test_pdh_mocked_bad_values_and_names_are_counted_not_used():
    r = reads() | {
        LOCAL: CounterRead.ok(
            {
                name(1): -5,
                name(2): math.nan,
                name(3): math.inf,
                "_Total": 9,  # an aggregate instance: skipped, not "not understood"
                "GPU 0 - something": 1,
                name(4): 7,
            }
        )
    }
    v = aggregate(r)
    assert v.bad_values == 3 and v.unparsed == 1
    assert (1, LUID_A) not in v.processes or v.processes[(1, LUID_A)].local.value is None
    assert v.processes[(4, LUID_A)].local.value == 7


@given(
    st.dictionaries(
        st.sampled_from([LOCAL, NON_LOCAL, ENGINE, ADAPTER_DEDICATED, ADAPTER_SHARED]),
        st.one_of(
            st.builds(CounterRead.failed, st.integers(0, 2**32 - 1)),
            st.builds(
                CounterRead.ok,
                st.dictionaries(
                    st.one_of(
                        st.text(max_size=40),
                        st.builds(
                            lambda p, lo, r: f"pid_{p}_luid_0x0_0x{lo:x}{r}",
                            st.integers(0, 99),
                            st.integers(0, 3),
                            st.sampled_from(["_phys_0", "_phys_0_eng_1_engtype_3D", ""]),
                        ),
                    ),
                    st.one_of(st.floats(allow_nan=True), st.integers(-(2**40), 2**40)),
                    max_size=8,
                ),
            ),
        ),
    )
)
def test_pdh_aggregate_fuzz_never_raises_and_never_invents_zero(r):
    v = aggregate(r)
    for p in v.processes.values():
        for reading in (p.local, p.non_local, *p.engines.values()):
            assert (reading.value is None) == (reading.reason is not None)
            if reading.value is not None:
                assert reading.value >= 0


def test_pdh_ctypes_structures_have_the_windows_x64_layout():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("layout checked for 64-bit builds")
    assert ctypes.sizeof(pdh.PDH_FMT_COUNTERVALUE) == 16
    assert pdh.PDH_FMT_COUNTERVALUE.u.offset == 8
    assert ctypes.sizeof(pdh.PDH_FMT_COUNTERVALUE_ITEM_W) == 24


def test_pdh_ctypes_layer_refuses_off_windows():
    with pytest.raises(OSError, match="only on Windows"):
        pdh.CtypesPdh().read([LOCAL])


class FakePdh:
    """Mocked PDH (no Windows here): returns queued reads and records what was asked."""

    def __init__(self, *queue: dict[str, CounterRead]) -> None:
        self.queue = list(queue)
        self.asked: list[str] = []
        self.closed = False

    def read(self, paths):
        self.asked.extend(paths)
        return self.queue.pop(0) if len(self.queue) > 1 else self.queue[0]

    def close(self) -> None:
        self.closed = True


class FakeDxgi:
    def __init__(self, descs):
        self.descs = descs

    def enum_adapters(self):
        return list(self.descs)


def test_pdh_mocked_collector_sums_local_usage_only_and_never_asks_dedicated_usage():
    from gputaskman.backends.win.backend import WddmBackend
    from gputaskman.backends.win.dxgi import AdapterDesc

    desc = AdapterDesc(
        "NVIDIA Mock RTX",
        0x10DE,
        0x2704,
        0,
        0xA1,
        16 * 1024**3,
        0,
        8 * 1024**3,
        0,
        0xD1A2,
        pci=(1, 0, 0),
    )
    fake = FakePdh(reads())
    backend = WddmBackend(dxgi=FakeDxgi([desc]), pdh=fake, tcc=False)
    c = Collector(source=backend, scanner=NullScanner())
    snap = c.sample()
    c.close()
    assert fake.closed
    assert not any(p in fake.asked for p in pdh.FORBIDDEN)
    assert "Dedicated Usage" not in " ".join(a for a in fake.asked if "Process" in a)
    # measured Local Usage of the three processes on adapter A; Non Local never added
    assert snap.attributed_on(LUID_A) == 3120 * MIB
    # process 9 has no memory instance: the sum is a lower bound, and says so
    assert snap.attributed_complete_on(LUID_A) is False
    m = snap.metrics[LUID_A]
    assert m.memory_used_bytes.value == 3500 * MIB
    assert m.memory_total_bytes.value == 16 * 1024**3
    assert m.temperature_c.value is None and m.temperature_c.reason is Reason.NOT_SUPPORTED
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert report.null_rule_violations(doc) == []
