"""The prepared lent-GPU check's health and MIG comparison (tools/nvml_health_check.py, run by
tools/nvml_check.py) on this machine: gputaskman's document from the mocked NVML against an
``nvidia-smi -q -x`` text written in nvidia-smi's format for the same mocked GPU (not
captured from a device), so the script is known to pass what agrees and fail what does not
before a lent GPU runs it."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from gputaskman.backends.nvml import NvmlBackend
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from test_nvml_mocked import BUS_A, GIB, MockedNvml, device, mig_device, proc

_spec = importlib.util.spec_from_file_location(
    "nvml_health_check", Path(__file__).resolve().parents[3] / "tools" / "nvml_health_check.py"
)
hc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hc)

MIB = 1 << 20
GHOST = 2**22 + 7  # 4194311, above pid_max: no process of this machine's

# nvidia-smi -q -x of the mocked GPU below: a MIG GPU with SRAM/DRAM ECC counts (newer
# drivers), row remapping and no page retirement, a hardware thermal slowdown, no fan
SMI = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>550.54.14</driver_version>
  <gpu id="00000000:01:00.0">
    <product_name>NVIDIA Mock GPU</product_name>
    <mig_mode><current_mig>Enabled</current_mig><pending_mig>Enabled</pending_mig></mig_mode>
    <mig_devices>
      <mig_device>
        <index>0</index>
        <gpu_instance_id>1</gpu_instance_id>
        <compute_instance_id>0</compute_instance_id>
        <fb_memory_usage><total>40960 MiB</total><reserved>0 MiB</reserved>
          <used>1024 MiB</used><free>39936 MiB</free></fb_memory_usage>
      </mig_device>
    </mig_devices>
    <pci><tx_util>100 KB/s</tx_util><rx_util>0 KB/s</rx_util></pci>
    <fan_speed>N/A</fan_speed>
    <clocks_event_reasons>
      <clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>
      <clocks_event_reason_sw_power_cap>Active</clocks_event_reason_sw_power_cap>
      <clocks_event_reason_hw_slowdown>Not Active</clocks_event_reason_hw_slowdown>
      <clocks_event_reason_hw_thermal_slowdown>Active</clocks_event_reason_hw_thermal_slowdown>
    </clocks_event_reasons>
    <ecc_errors>
      <volatile>
        <sram_correctable>1</sram_correctable>
        <sram_uncorrectable_parity>0</sram_uncorrectable_parity>
        <sram_uncorrectable_secded>0</sram_uncorrectable_secded>
        <dram_correctable>1</dram_correctable>
        <dram_uncorrectable>0</dram_uncorrectable>
      </volatile>
      <aggregate>
        <sram_correctable>4</sram_correctable>
        <sram_uncorrectable_parity>0</sram_uncorrectable_parity>
        <sram_uncorrectable_secded>0</sram_uncorrectable_secded>
        <dram_correctable>6</dram_correctable>
        <dram_uncorrectable>1</dram_uncorrectable>
      </aggregate>
    </ecc_errors>
    <retired_pages>
      <multiple_single_bit_retirement><retired_count>N/A</retired_count></multiple_single_bit_retirement>
      <double_bit_retirement><retired_count>N/A</retired_count></double_bit_retirement>
      <pending_blacklist>N/A</pending_blacklist>
      <pending_retirement>N/A</pending_retirement>
    </retired_pages>
    <remapped_rows>
      <remapped_row_corr>3</remapped_row_corr>
      <remapped_row_unc>0</remapped_row_unc>
      <remapped_row_pending>No</remapped_row_pending>
      <remapped_row_failure>No</remapped_row_failure>
    </remapped_rows>
    <processes>
      <process_info>
        <gpu_instance_id>1</gpu_instance_id>
        <compute_instance_id>0</compute_instance_id>
        <pid>4194311</pid>
        <type>C</type>
        <used_memory>1024 MiB</used_memory>
      </process_info>
    </processes>
  </gpu>
</nvidia_smi_log>
"""

FIELDS = {3: 2, 4: 0, 5: 10, 6: 1, 142: 3, 143: 0, 144: 0, 145: 0, 197: 5, 198: 5}


class Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[str, bool | None, Any, Any]] = []

    def add(self, name: str, ok: bool | None, got: Any, want: Any, note: str = "") -> None:
        self.rows.append((name, ok, got, want))

    def failed(self) -> list[tuple[str, bool | None, Any, Any]]:
        return [r for r in self.rows if r[1] is False]


def _doc(**over: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "mig_mode": [1, 1],
        "mig": [mig_device(1, 0, 40 * GIB, GIB, [proc(GHOST, GIB)])],
        "fields": dict(FIELDS),
        "clock_reasons": 0x4 | 0x40,
    }
    kw.update(over)
    c = Collector(source=NvmlBackend(MockedNvml([device(BUS_A, **kw)])), scanner=NullScanner())
    return report.to_json_dict(c.sample(), None)


def test_the_check_passes_a_document_that_agrees_with_nvidia_smi():
    checks = Rows()
    hc.compare_health(_doc(), SMI, checks)
    assert checks.failed() == []
    judged = {name.split(" ", 2)[2] for name, ok, *_ in checks.rows if ok is not None}
    assert {
        "ecc_volatile_corrected_errors",
        "ecc_aggregate_uncorrected_errors",
        "retired_pages_pending",
        "remapped_rows_correctable",
        "slowdown clock event reasons",
        "MIG mode",
        "MIG instances",
        "MIG (1, 0) memory total (1 MiB)",
        "process 4194311 MIG instance",
    } <= judged


@pytest.mark.parametrize(
    ("over", "fails"),
    [
        ({"fields": {**FIELDS, 3: 1}}, "ecc_volatile_corrected_errors"),
        ({"fields": {**FIELDS, 6: 0}}, "ecc_aggregate_uncorrected_errors"),
        ({"fields": {**FIELDS, 142: 4}}, "remapped_rows_correctable"),
        ({"fields": {**FIELDS, 144: 1}}, "remapped_rows_pending"),
        ({"fields": {k: v for k, v in FIELDS.items() if k != 143}}, "remapped_rows_uncorrectable"),
        ({"clock_reasons": 0x4}, "slowdown clock event reasons"),
        ({"fan": 40}, "fan speed"),
        ({"mig_mode": [0, 0]}, "MIG mode"),
        ({"mig": [mig_device(2, 0, 40 * GIB, GIB, [proc(GHOST, GIB)])]}, "MIG instances"),
        ({"mig": [mig_device(1, 0, 20 * GIB, GIB, [proc(GHOST, GIB)])]}, "memory total"),
    ],
)
def test_the_check_fails_each_reading_that_disagrees(over: dict[str, Any], fails: str):
    checks = Rows()
    hc.compare_health(_doc(**over), SMI, checks)
    names = [name for name, *_ in checks.failed()]
    assert any(fails in n for n in names), names


def test_the_check_reads_the_older_single_and_double_bit_ecc_format():
    older = SMI.replace(
        "<sram_correctable>1</sram_correctable>",
        "<single_bit><total>2</total></single_bit><double_bit><total>0</total></double_bit>",
        1,
    )
    gpu = ET.fromstring(older).find("gpu")
    got = hc.smi_health(gpu)
    assert got["ecc_volatile_corrected_errors"] == 2 and got["ecc_volatile_uncorrected_errors"] == 0
    assert got["clocks_event_reasons"] == 0x4 | 0x40 and got["fan_speed_percent"] is None
