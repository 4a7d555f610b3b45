"""Huawei Ascend NPUs from ``npu-smi info`` text (no Ascend hardware or driver here).

The fixtures follow the table format of real ``npu-smi`` output as published in public
sources (npu-smi 23.0.2.1 with a 910B2C and a process row, npu-smi 25.x dual-die
Ascend910 cards with ``Chip  Phy-ID`` and ``-`` power on the second die, a 310B4 board
without HBM and with bus id ``NA``; see the test fixtures of youyve/nputop
``tests/test_libascend.py``). Column layout is kept; the numbers are our own. The
fixtures live in ``tests/npu_smi/``. The backend
is driven through a stand-in ``npu-smi`` script run as a real process (a mocked tool:
test names say so).
"""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path

import pytest
from gputaskman.backends.ascend import (
    SEARCH,
    AscendBackend,
    find_npu_smi,
    parse_npu_smi,
    to_sample,
)
from gputaskman.backends.drm import DrmBackend
from gputaskman.backends.linux import LinuxGpus
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuSample, GpuSource
from gputaskman.base.readings import Problem, Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from hypothesis import given
from hypothesis import strategies as st

MIB = 1024**2
FIXTURES = Path(__file__).with_name("npu_smi")
SINGLE = (FIXTURES / "single.txt").read_text()  # npu-smi 23.0.2.1 layout, 910B2C
DUAL_DIE = (FIXTURES / "dual_die.txt").read_text()  # npu-smi 25.2.0 layout, Ascend910
NO_HBM = (FIXTURES / "no_hbm.txt").read_text()  # npu-smi 23.0.0 layout, 310B4


def test_parse_single_die_cards_and_process_row():
    info = parse_npu_smi(SINGLE)
    assert info.version == "23.0.2.1" and info.unparsed == 0
    a, b = info.chips
    assert (a.npu, a.chip, a.name, a.health, a.bus_id) == (0, 0, "910B2C", "OK", "0000:5A:00.0")
    assert a.power_w == 92.4 and a.temp_c == 48 and a.aicore_percent == 73
    assert a.memory_mb == (0, 0) and a.hbm_mb == (31022, 65536)
    assert b.hbm_mb == (3371, 65536)
    (p,) = info.processes
    assert (p.npu, p.chip, p.pid, p.name, p.memory_mb) == (0, 0, 31337, "python3.10", 27600)
    assert info.idle_npus == {1}


def test_parse_dual_die_cards():
    info = parse_npu_smi(DUAL_DIE)
    assert [(c.npu, c.chip, c.phy_id) for c in info.chips] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 2),
        (1, 1, 3),
    ]
    assert info.chips[1].power_w is None and info.chips[0].power_w == 158.2
    (p,) = info.processes
    assert (p.npu, p.chip, p.pid) == (1, 1, 880123)


def test_parse_board_without_hbm_or_bus_id():
    (c,) = parse_npu_smi(NO_HBM).chips
    assert c.bus_id is None and c.hbm_mb is None and c.memory_mb == (4100, 15609)
    assert c.health == "Alarm" and c.temp_c == 61


def test_ascend_sample_measures_memory_and_keys_by_pci_address():
    s = to_sample(parse_npu_smi(SINGLE))
    assert [(a.index, a.pci_bus_id, a.vendor) for a in s.adapters] == [
        (0, "00000000:5a:00.0", "huawei"),
        (1, "00000000:19:00.0", "huawei"),
    ]
    m = s.metrics["00000000:5a:00.0"]
    assert m.memory_used_bytes.value == 31022 * MIB and m.memory_total_bytes.value == 65536 * MIB
    assert "HBM-Usage" in m.memory_used_bytes.source
    assert m.util_gpu_percent.value == 73 and m.power_w.value == 92.4
    (p,) = s.processes
    assert p.adapter == "00000000:5a:00.0" and p.dedicated.value == 27600 * MIB
    assert p.name == "python3.10"
    assert s.problems == () and s.probe.status == "ok"


def test_ascend_dual_die_process_lands_on_its_die_and_dash_power_is_not_zero():
    s = to_sample(parse_npu_smi(DUAL_DIE))
    (p,) = s.processes
    assert p.adapter == "00000000:39:00.0"
    second = s.metrics["00000000:9e:00.0"].power_w
    assert second.value is None and second.reason is Reason.NOT_SUPPORTED


def test_ascend_without_process_table_the_sum_is_a_lower_bound():
    s = to_sample(parse_npu_smi(NO_HBM))
    (a,) = s.adapters
    assert a.pci_bus_id == "ascend:npu0-chip0"
    assert s.metrics[a.pci_bus_id].memory_used_bytes.value == 4100 * MIB
    assert "Memory-Usage" in s.metrics[a.pci_bus_id].memory_used_bytes.source
    assert any(p.is_process_list and "no process table" in (p.detail or "") for p in s.problems)


def test_ascend_truncated_output_counts_what_it_cannot_read():
    cut = SINGLE.split("| 0                         | 0000:5A")[0]
    info = parse_npu_smi(cut)
    assert info.chips == [] and info.unparsed == 1
    assert parse_npu_smi("garbage\n| x | y |\n").has_device_table is False
    assert to_sample(parse_npu_smi("nothing here")).probe.status == "failed"


@given(st.text(max_size=400))
def test_parse_fuzz_never_raises(text):
    to_sample(parse_npu_smi(text))


def test_a_process_row_after_a_lone_chip_row_is_not_taken_for_the_chips_second_row():
    """Found by the fuzz test below: without a chip's second row and the process table's
    header, the process row came right after the chip's first row and was read as its
    second (a chip without a bus id, the process lost without a word)."""
    lines = [ln for i, ln in enumerate(SINGLE.splitlines()) if i not in (10, 13)]
    info = parse_npu_smi("\n".join(lines))
    assert [c.npu for c in info.chips] == [0] and info.unparsed == 1
    assert info.processes == []  # not understood, and counted as such


@given(st.lists(st.integers(0, 40), max_size=10), st.sampled_from([SINGLE, DUAL_DIE, NO_HBM]))
def test_parse_fuzz_lines_dropped_never_raise_or_invent_memory(drop, text):
    full = {p.pid: p.memory_mb * MIB for p in parse_npu_smi(text).processes}
    lines = [ln for i, ln in enumerate(text.splitlines()) if i not in set(drop)]
    info = parse_npu_smi("\n".join(lines))
    s = to_sample(info)
    got = {p.pid: p.dedicated.value for p in s.processes}
    # nothing invented: every row is one of the full output's, with its measured bytes
    assert all(full.get(pid) == value for pid, value in got.items()), (got, full)
    # nothing lost silently: a process row that survived is in the sample, or a problem
    # names it, or it is counted as not understood, or the whole sample failed with a reason
    for pid in full:
        if any(f" {pid} " in ln for ln in lines):
            named = any(f"process {pid} " in (pr.detail or "") for pr in s.problems)
            failed = s.backend_problem is not None
            assert pid in got or named or info.unparsed > 0 or failed, pid
    if not set(drop) & set(range(len(text.splitlines()))):  # nothing dropped
        assert got == full


def test_fixtures_hold_process_rows_or_say_there_is_no_table():
    """The fuzz test above needs fixtures with processes, and one without a table."""
    assert parse_npu_smi(SINGLE).processes and parse_npu_smi(DUAL_DIE).processes
    no_table = to_sample(parse_npu_smi(NO_HBM))
    assert no_table.processes == ()
    assert [pr.detail for pr in no_table.problems] == ["npu-smi printed no process table"]


def fake_tool(tmp_path, body: str) -> str:
    path = tmp_path / "npu-smi"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_ascend_mocked_npu_smi_runs_as_a_real_process(tmp_path):
    (tmp_path / "out.txt").write_text(SINGLE)
    tool = fake_tool(tmp_path, f'[ "$1" = info ] || exit 9\ncat {tmp_path / "out.txt"}\n')
    s = AscendBackend([tool, "info"]).sample()
    assert s.probe.status == "ok" and s.probe.count == 2


def test_ascend_mocked_npu_smi_failure_is_a_failed_probe_with_its_message(tmp_path):
    tool = fake_tool(
        tmp_path,
        """
        echo "DrvMngGetConsoleLogLevel failed. (g_conLogLevel=3)"
        echo "dcmi model initialized failed, because the device is used. ret is -8020" >&2
        exit 255
        """,
    )
    s = AscendBackend([tool]).sample()
    assert s.probe.status == "failed" and s.probe.reason is Reason.QUERY_FAILED
    assert "ret is -8020" in (s.probe.detail or "") and "255" in (s.probe.detail or "")


def test_ascend_mocked_npu_smi_hang_times_out(tmp_path):
    tool = fake_tool(tmp_path, "exec sleep 30\n")
    s = AscendBackend([tool], timeout=0.5).sample()
    assert s.probe.status == "failed" and "0.5s" in (s.probe.detail or "")


def test_ascend_missing_tool_is_a_failed_probe(tmp_path):
    s = AscendBackend([str(tmp_path / "absent")]).sample()
    assert s.probe.status == "failed" and s.probe.reason is Reason.NO_LIBRARY


def test_find_npu_smi_on_path_or_in_driver_locations():
    assert find_npu_smi(which=lambda _: "/opt/ascend/npu-smi") == "/opt/ascend/npu-smi"
    if any(os.path.exists(p) for p in SEARCH):
        pytest.skip("an npu-smi is installed here")
    assert find_npu_smi(which=lambda _: None) is None


class NoNvml(GpuSource):
    def sample(self):
        p = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
        return GpuSample("nvml", problems=(p,), backend_problem=p)

    def close(self):
        self.closed = True


def test_ascend_mocked_alongside_a_failed_nvml_is_usable_and_sums_measured_bytes(tmp_path):
    (tmp_path / "out.txt").write_text(SINGLE)
    tool = fake_tool(tmp_path, f"cat {tmp_path / 'out.txt'}\n")
    src = LinuxGpus(NoNvml(), DrmBackend(str(tmp_path / "no-drm")), AscendBackend([tool]))
    snap = Collector(source=src, scanner=NullScanner()).sample()
    assert snap.available and [a.index for a in snap.adapters] == [0, 1]
    assert snap.backend == "ascend"  # the first GPU shown is an NPU
    assert any(p.reason is Reason.NO_LIBRARY for p in snap.problems)  # NVML's, kept
    assert snap.attributed_on("00000000:5a:00.0") == 27600 * MIB
    assert report.null_rule_violations(report.to_json_dict(snap, None)) == []
    assert schema.errors(report.to_json_dict(snap, None)) == []  # the packaged JSON Schema


def test_ascend_absent_leaves_the_other_source_untouched(tmp_path):
    no_drm = DrmBackend(str(tmp_path / "no-drm"))
    without = LinuxGpus(NoNvml(), no_drm).sample()
    src = LinuxGpus(NoNvml(), no_drm, AscendBackend([str(tmp_path / "absent")]))
    s = src.sample()
    assert (s.adapters, s.problems, s.backend_problem) == (
        without.adapters,
        without.problems,
        without.backend_problem,
    )
    # only the failed Ascend probe is added, for --list-gpus
    assert [p.backend for p in s.parts] == ["ascend", "drm"]
    assert s.parts[0].status == "failed" and s.parts[0].reason is Reason.NO_LIBRARY
