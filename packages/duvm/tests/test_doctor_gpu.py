"""`duvm doctor`'s GPU-node checks: HMM through NVML, and locked or pinned RAM.

No NVIDIA GPU or driver is here, so the NVML answers come from a fake library object passed
through `check_gpu_hmm`'s ``load`` parameter (those tests say mocked_nvml in their names); the
ctypes calls into it are the real ones the check makes. Without the fake, the real loader finds
no libnvidia-ml here and the check is skipped. The pinned check reads a real process that
mlock()s memory (root), and status files written into a temporary /proc tree for VmPin,
which nothing here can produce without RDMA hardware.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from duvm.node.doctor import doctor, doctor_gpu
from duvm.node.doctor.doctor_check import OK, SKIP, WARN
from hypothesis import given
from hypothesis import strategies as st

MIB = 1 << 20


class FakeNvml:
    """Answers as libnvidia-ml does to the calls the check makes (same signatures, results
    written through the ctypes pointers it passes). ``modes``: each GPU's addressing mode;
    ``has_call=False``: a driver older than nvmlDeviceGetAddressingMode."""

    def __init__(
        self,
        modes: list[int],
        driver: bytes = b"580.65.06",
        init_rc: int = 0,
        has_call: bool = True,
        mode_rc: int = 0,
    ) -> None:
        self.modes, self.driver, self.init_rc, self.mode_rc = modes, driver, init_rc, mode_rc
        self.calls: list[str] = []
        if has_call:
            self.nvmlDeviceGetAddressingMode = self._get_mode

    def nvmlInit_v2(self) -> int:
        self.calls.append("init")
        return self.init_rc

    def nvmlShutdown(self) -> int:
        self.calls.append("shutdown")
        return 0

    def nvmlSystemGetDriverVersion(self, buf: Any, length: ctypes.c_uint) -> int:
        assert len(self.driver) < length.value
        buf.value = self.driver
        return 0

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count.contents.value = len(self.modes)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: ctypes.c_uint, handle: Any) -> int:
        handle.contents.value = 0x1000 + index.value
        return 0

    def _get_mode(self, handle: ctypes.c_void_p, mode: Any) -> int:
        if mode.contents.version != 0x1000008:  # NVML refuses a struct of another version
            return 25
        if self.mode_rc:
            return self.mode_rc
        mode.contents.value = self.modes[handle.value - 0x1000]
        return 0


def hmm(fake: FakeNvml | None, tmp_path: Path, **files: str) -> Any:
    """Run the check against `fake`, with /sys/module, the driver's version file and the
    kernel config read from `tmp_path` (those named in `files` exist)."""
    paths = {
        "uvm_disable_hmm": tmp_path / "module/nvidia_uvm/parameters/uvm_disable_hmm",
        "driver": tmp_path / "nvidia-version",
        "config": tmp_path / "config",
    }
    for key, text in files.items():
        paths[key].parent.mkdir(parents=True, exist_ok=True)
        paths[key].write_text(text)
    return doctor_gpu.check_gpu_hmm(
        lambda: fake, tmp_path / "module", paths["driver"], paths["config"]
    )


def test_hmm_active_on_every_gpu_mocked_nvml(tmp_path: Path) -> None:
    fake = FakeNvml([doctor_gpu.ADDRESSING_HMM, doctor_gpu.ADDRESSING_HMM])
    c = hmm(fake, tmp_path)
    assert c.status == OK, c
    assert "driver 580.65.06" in c.detail and "GPU 0,1: HMM" in c.detail
    assert fake.calls == ["init", "shutdown"]


def test_ats_counts_as_active_mocked_nvml(tmp_path: Path) -> None:
    c = hmm(FakeNvml([doctor_gpu.ADDRESSING_ATS]), tmp_path)
    assert c.status == OK and "GPU 0: ATS" in c.detail


def test_hmm_not_active_says_what_is_missing_mocked_nvml(tmp_path: Path) -> None:
    fake = FakeNvml([doctor_gpu.ADDRESSING_HMM, doctor_gpu.ADDRESSING_NONE])
    c = hmm(
        fake,
        tmp_path,
        driver="NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06\n",
        config="CONFIG_ZONE_DEVICE=y\n# CONFIG_DEVICE_PRIVATE is not set\n",
        uvm_disable_hmm="Y\n",
    )
    assert c.status == WARN and not c.required
    assert "GPU 0: HMM; GPU 1: none" in c.detail
    assert "proprietary kernel modules" in c.detail
    assert "uvm_disable_hmm=1" in c.detail and "CONFIG_DEVICE_PRIVATE" in c.detail
    assert c.fix is not None and "open kernel modules" in c.fix


def test_open_modules_and_config_not_blamed_when_present_mocked_nvml(tmp_path: Path) -> None:
    c = hmm(
        FakeNvml([doctor_gpu.ADDRESSING_NONE]),
        tmp_path,
        driver="NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06\n",
        config="CONFIG_DEVICE_PRIVATE=y\n",
        uvm_disable_hmm="N\n",
    )
    assert c.status == WARN
    assert "proprietary" not in c.detail and "uvm_disable_hmm" not in c.detail
    assert "CONFIG_DEVICE_PRIVATE" not in c.detail


def test_driver_older_than_the_call_is_a_warning_mocked_nvml(tmp_path: Path) -> None:
    c = hmm(FakeNvml([0], driver=b"575.57.08", has_call=False), tmp_path)
    assert c.status == WARN
    assert "575.57.08" in c.detail and "R580" in c.detail and "not known" in c.detail
    assert c.fix is not None and "R580" in c.fix


def test_mode_not_supported_on_a_gpu_mocked_nvml(tmp_path: Path) -> None:
    c = hmm(FakeNvml([0], mode_rc=3), tmp_path)
    assert c.status == WARN and "not supported (3)" in c.detail


def test_driver_not_loaded_is_skipped_mocked_nvml(tmp_path: Path) -> None:
    fake = FakeNvml([], init_rc=doctor_gpu.NVML_ERROR_DRIVER_NOT_LOADED)
    c = hmm(fake, tmp_path)
    assert c.status == SKIP and "not loaded" in c.detail
    assert "shutdown" not in fake.calls  # NVML never started


def test_no_gpu_is_skipped_mocked_nvml(tmp_path: Path) -> None:
    assert hmm(FakeNvml([]), tmp_path).status == SKIP


def test_no_nvidia_driver_is_skipped_not_failed(tmp_path: Path) -> None:
    """The real loader, on this machine without an NVIDIA driver."""
    if doctor_gpu.load_nvml() is not None:
        pytest.skip("this machine has libnvidia-ml.so.1")
    c = doctor_gpu.check_gpu_hmm()
    assert c.status == SKIP and "no NVIDIA driver" in c.detail
    assert hmm(None, tmp_path).status == SKIP


def test_doctor_runs_both_checks() -> None:
    names = [c.name for c in doctor.run_checks(doctor.Options())]
    assert "gpu-hmm" in names and "pinned-memory" in names


# --- locked and pinned memory ------------------------------------------------------------------

LOCKER = r"""
import ctypes, mmap, sys
size = int(sys.argv[1])
buf = mmap.mmap(-1, size)
libc = ctypes.CDLL(None, use_errno=True)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
    print("mlock failed", ctypes.get_errno(), flush=True)
    sys.exit(1)
print("locked", flush=True)
sys.stdin.readline()
"""


@pytest.mark.root
def test_a_process_that_mlocks_is_counted() -> None:
    if os.geteuid() != 0:
        pytest.skip("mlock of 64 MiB needs root (or a memlock limit this large)")
    size = 64 * MIB
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        mine = [e for e in doctor_gpu.locked_by_process() if e[0] == proc.pid]
        assert mine and mine[0][2] >= size, mine
        assert doctor_gpu.check_pinned(max_share=1.0).status == OK
        total = doctor_gpu.mem_total(Path("/proc/meminfo"))
        assert total is not None
        c = doctor_gpu.check_pinned(max_share=(size // 2) / total)
        assert c.status == WARN and "largest:" in c.detail, c
        assert c.fix is not None
    finally:
        proc.kill()
        proc.wait()


def _status(name: str, lck_kb: int | None, pin_kb: int | None) -> str:
    lines = [f"Name:\t{name}", "VmRSS:\t  1000 kB"]
    if lck_kb is not None:
        lines.append(f"VmLck:\t{lck_kb:>8} kB")
    if pin_kb is not None:
        lines.append(f"VmPin:\t{pin_kb:>8} kB")
    return "\n".join(lines) + "\n"


def test_pinned_memory_from_status_files(tmp_path: Path) -> None:
    """VmPin (RDMA registrations and the like) counts beside VmLck; the largest are named."""
    proc = tmp_path / "proc"
    for pid, text in {
        "10": _status("trainer", 0, 3 << 20),  # 3 GiB pinned
        "11": _status("daemon", 200 << 10, 0),
        "12": _status("kthread", None, None),
        "13": "garbage\x00\n",
        "self": _status("self", 1, 1),
    }.items():
        (proc / pid).mkdir(parents=True)
        (proc / pid / "status").write_text(text)
    (proc / "14").mkdir()  # a process that went away: no status
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")  # 16 GiB
    assert doctor_gpu.locked_by_process(proc) == [
        (10, "trainer", 3 << 30),
        (11, "daemon", 200 << 20),
    ]
    ok = doctor_gpu.check_pinned(proc, meminfo)  # 3.2 of 16 GiB: 20 %
    assert ok.status == OK and "3272 MiB (20 %" in ok.detail
    warn = doctor_gpu.check_pinned(proc, meminfo, max_share=0.1)
    assert warn.status == WARN
    assert "trainer (pid 10) 3072 MiB, daemon (pid 11) 200 MiB" in warn.detail
    meminfo.write_text("nothing here\n")
    assert doctor_gpu.check_pinned(proc, meminfo).status == SKIP


@given(st.text())
def test_status_parser_never_raises(text: str) -> None:
    name, held = doctor_gpu.parse_status(text)
    assert isinstance(name, str) and held >= 0


def test_status_parser_ignores_non_ascii_digits() -> None:
    assert doctor_gpu.parse_status("VmLck:\t١٢ kB\nVmPin:\t2 kB\n") == ("", 2048)
