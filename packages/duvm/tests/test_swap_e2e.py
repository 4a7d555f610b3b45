"""The real kernel swap path, end to end, with a real C NBD server as the peer:

nbdkit memory (Unix socket) -> nbdfuse -> loop (direct I/O) -> mkswap -> swapon ->
a workload holding 4x its cgroup's RAM limit -> every byte verified -> swapoff -> detach,

asserting the mechanism (pages counted in /proc/vmstat, bytes present on the NBD server while
swapped out and discarded from it afterwards) and that nothing is left behind, also when a test
fails half-way. Root only; skipped with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from duvm.base import cgroup
from duvm.node.attach import attach, attach_fuse, attach_state, kernel_swap, processes, systools

NBDKIT = shutil.which("nbdkit")
NBDINFO = shutil.which("nbdinfo")
LIMIT_MIB, WORKLOAD_MIB, SERVER_MIB = 64, 256, 512
PAGE = 4096


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loop devices, FUSE, swapon, cgroups)"
    if NBDKIT is None or NBDINFO is None:
        return "nbdkit/nbdinfo missing (apt: nbdkit libnbd-bin)"
    if problems := attach_fuse.problems():
        return "; ".join(problems)
    for tool in ("mkswap", "swapon", "swapoff", "blkdiscard"):
        if systools.find_tool(tool) is None:
            return f"{tool} missing (apt: util-linux)"
    if cgroup.detect_version() is None:
        return "no cgroup memory controller"
    return None


pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, _, v = line.partition(" ")
        out[k] = int(v)
    return out


BOOST = kernel_swap.WATERMARK_BOOST_SYSCTL


@dataclass
class Stack:
    base: Path
    sock: str
    state: Path
    server: subprocess.Popen[bytes]
    min_free_before: str
    boost_before: str | None
    pids: list[int] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    cgroups: list[Path] = field(default_factory=list)

    @property
    def uri(self) -> str:
        return f"nbd+unix:///?socket={self.sock}"

    def server_data_bytes(self) -> int:
        """Bytes the NBD server holds as data (not holes), as reported by nbdinfo."""
        res = subprocess.run(
            [NBDINFO or "nbdinfo", "--map", "--totals", "--json", self.uri],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return sum(e["size"] for e in json.loads(res.stdout) if e["type"] & 1 == 0)

    def attach(self) -> attach_state.Attachment:
        att = attach.attach(
            self.sock, self.state, run_dir=self.base / "run", method=attach_state.METHOD_FUSE
        )
        self.pids += [p for p in (att.nbdfuse_pid,) if p]
        self.devices += [d for d in (att.device,) if d]
        return att

    def cgroup(self) -> cgroup.MemoryCgroup:
        cg = cgroup.MemoryCgroup(LIMIT_MIB << 20, prefix="duvmtest")
        self.cgroups.append(cg.path)
        return cg

    def leftovers(self) -> list[str]:
        """Everything this stack created that still exists (empty list: clean)."""
        left = []
        for bf in Path("/sys/block").glob("loop*/loop/backing_file"):
            if bf.read_text().startswith(str(self.base)):
                left.append(f"loop device {bf.parent.parent.name}")
        for line in Path("/proc/mounts").read_text().splitlines():
            if line.split()[1].startswith(str(self.base)):
                left.append(f"mount {line}")
        swaps = {e.filename for e in kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())}
        left += [f"swap {d}" for d in self.devices if d in swaps]
        left += [f"cgroup {p}" for p in self.cgroups if p.exists()]
        left += [f"process {p}" for p in self.pids if processes.pid_alive(p)]
        if self.state.exists():
            left.append(f"state file {self.state}")
        if Path("/proc/sys/vm/min_free_kbytes").read_text() != self.min_free_before:
            left.append("vm.min_free_kbytes not restored")
        if BOOST.exists() and BOOST.read_text() != self.boost_before:
            left.append("vm.watermark_boost_factor not restored")
        return left


@contextlib.contextmanager
def swap_stack() -> Iterator[Stack]:
    """nbdkit memory on a short Unix socket path; tears down whatever the test built."""
    base = Path(tempfile.mkdtemp(prefix="duvm-e2e-", dir="/tmp"))  # sun_path is 108 bytes
    sock = str(base / "nbd.sock")
    server = subprocess.Popen(
        [NBDKIT or "nbdkit", "-f", "-U", sock, "memory", f"{SERVER_MIB}M"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stack = Stack(
        base,
        sock,
        base / "state.json",
        server,
        Path("/proc/sys/vm/min_free_kbytes").read_text(),
        BOOST.read_text() if BOOST.exists() else None,
        pids=[server.pid],
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock):
            assert server.poll() is None and time.monotonic() < deadline, "nbdkit did not start"
            time.sleep(0.02)
        yield stack
    finally:
        # cgroups first (their processes hold swap), then the device, then the server
        for path in stack.cgroups:
            if path.exists():
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
                for _ in range(200):
                    with contextlib.suppress(OSError):
                        path.rmdir()
                    if not path.exists():
                        break
                    time.sleep(0.02)
        with contextlib.suppress(attach_state.AttachError):
            attach.detach(stack.state, force=True)
        server.terminate()
        server.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def _workload(cg: cgroup.MemoryCgroup, *extra: str) -> subprocess.Popen[str]:
    return cg.popen(
        [sys.executable, "-m", "duvm.cli.workload", "--mib", str(WORKLOAD_MIB), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


FOREIGN_MIB = 16  # other programs' pages the machine-wide top-priority device may hold


def test_workload_swaps_through_nbd_and_every_byte_comes_back() -> None:
    with swap_stack() as stack:
        assert stack.server_data_bytes() == 0
        att = stack.attach()
        entry = kernel_swap.swap_entry(att.device or "")
        assert entry is not None and entry.priority == attach_state.DEFAULT_PRIORITY
        assert att.direct_io is True
        assert att.size_bytes == SERVER_MIB << 20
        floor = kernel_swap.safe_min_free_kbytes(kernel_swap.mem_total_kb())
        assert int(Path("/proc/sys/vm/min_free_kbytes").read_text()) >= floor
        assert not BOOST.exists() or BOOST.read_text().strip() == "0"

        before = vmstat()
        with stack.cgroup() as cg:
            proc = _workload(cg, "--hold")
            assert proc.stderr is not None
            assert proc.stderr.readline().strip() == "filled"
            # while held: most of the data is out of RAM, on the NBD server
            swapped_mib = (kernel_swap.swap_entry(att.device or "").used_kb) >> 10
            held_mib = stack.server_data_bytes() >> 20
            group_mib = cg.swap_bytes()
            assert swapped_mib >= WORKLOAD_MIB - 2 * LIMIT_MIB, swapped_mib
            assert held_mib >= WORKLOAD_MIB - 2 * LIMIT_MIB, held_mib
            if group_mib is not None:
                assert group_mib >> 20 >= WORKLOAD_MIB - 2 * LIMIT_MIB, group_mib
            out, err = proc.communicate("go\n", timeout=300)
            # the workload is gone: the kernel freed every slot it held. Counted on its own
            # cgroup, so pages other programs put on the device meanwhile do not blur it.
            if group_mib is not None:
                deadline = time.monotonic() + 10
                while (cg.swap_bytes() or 0) > 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert cg.swap_bytes() == 0
        assert proc.returncode == 0, err[-2000:]
        result = json.loads(out.splitlines()[-1])
        assert result["intact"] is True and result["chunks"] == WORKLOAD_MIB
        after = vmstat()
        min_pages = ((WORKLOAD_MIB - 2 * LIMIT_MIB) << 20) // PAGE
        assert after["pswpout"] - before["pswpout"] >= min_pages
        assert after["pswpin"] - before["pswpin"] >= min_pages

        # The device is the machine's top-priority swap, so other programs' pages land on it
        # while the test runs (reclaim, or DAMON's proactive reclaim where it runs: a CI run
        # once found one 4 KiB page; beside other work, some MiB, in swap cache and tmpfs that
        # no process's VmSwap counts). The workload's hundreds of MiB must be gone from it.
        deadline = time.monotonic() + 10
        while kernel_swap.swap_entry(att.device or "").used_kb >> 10 > FOREIGN_MIB:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert kernel_swap.swap_entry(att.device or "").used_kb >> 10 <= FOREIGN_MIB
        # discard reached the server. Not to the last byte: the kernel discards whole free
        # 2 MiB swap clusters, and the few it keeps as per-CPU allocation clusters stay until
        # reuse or swapoff (seen: 32 KiB to 8 MiB left), so allow 16 MiB of ~200 MiB. The kernel
        # issues those discards from a workqueue after the slots are freed, and each one travels
        # loop -> FUSE punch-hole -> NBD trim, so wait for them rather than read once (a fresh CI
        # machine once read 17.9 MiB straight after used_kb reached 0).
        deadline = time.monotonic() + 15
        while stack.server_data_bytes() > 16 << 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stack.server_data_bytes() <= 16 << 20

        removed = attach.detach(stack.state)
        assert removed is not None and "discard_error" not in removed.extra
        assert stack.server_data_bytes() == 0, "swapoff + blkdiscard leaves nothing on the server"
        assert stack.leftovers() == [f"process {stack.server.pid}"]
    assert not stack.leftovers()


def test_disable_refuses_while_a_cgroup_cannot_take_its_pages_back() -> None:
    """swapoff would OOM-kill the held workload; detach refuses, nothing is lost."""
    with swap_stack() as stack:
        att = stack.attach()
        with stack.cgroup() as cg:
            proc = _workload(cg, "--hold")
            assert proc.stderr is not None and proc.stderr.readline().strip() == "filled"
            with pytest.raises(attach_state.SwapoffFailed, match=f"{cg.name} has .* in swap"):
                attach.detach(stack.state)
            entry = kernel_swap.swap_entry(att.device or "")
            assert entry is not None and entry.used_kb > 0, "still attached, pages still out"
            assert attach_state.load_state(stack.state) == att
            out, err = proc.communicate("go\n", timeout=300)
            assert proc.returncode == 0, err[-2000:]
            assert json.loads(out.splitlines()[-1])["intact"] is True
        assert attach.detach(stack.state) is not None
    assert not stack.leftovers()


def test_attaching_twice_says_already_attached() -> None:
    with swap_stack() as stack:
        att = stack.attach()
        with pytest.raises(attach_state.AttachError, match="already attached"):
            attach.attach(stack.sock, stack.state, run_dir=stack.base / "run")
        assert kernel_swap.swap_entry(att.device or "") is not None
        attach.detach(stack.state)
    assert not stack.leftovers()


def test_failure_midway_leaves_nothing_behind() -> None:
    """A test that dies with swap active and a workload holding pages is still cleaned up."""
    with pytest.raises(RuntimeError, match="simulated failure"), swap_stack() as stack:
        stack.attach()
        cg = stack.cgroup().create()
        proc = _workload(cg, "--hold")
        assert proc.stderr is not None and proc.stderr.readline().strip() == "filled"
        stack.pids.append(proc.pid)
        raise RuntimeError("simulated failure")
    proc.wait(10)
    assert not stack.leftovers()


def test_detach_leaves_alone_a_device_number_someone_else_reused() -> None:
    """Loop numbers are reused as soon as they are free: if someone detached duvm's device by
    hand and the number now backs their own swap, disable must not swapoff or discard it."""
    other = Path(tempfile.mkdtemp(prefix="duvm-other-", dir="/tmp"))
    image = other / "their-swap.img"
    reused: str | None = None
    try:
        with swap_stack() as stack:
            att = stack.attach()
            dev = att.device or ""
            subprocess.run(["swapoff", dev], check=True, timeout=60)
            subprocess.run(["losetup", "-d", dev], check=True, timeout=30)
            image.write_bytes(os.urandom(16 << 20))
            for _ in range(100):  # the loop driver lets go of the old file asynchronously
                if (
                    subprocess.run(
                        ["losetup", dev, str(image)], capture_output=True, timeout=30
                    ).returncode
                    == 0
                ):
                    reused = dev
                    break
                time.sleep(0.05)
            assert reused == dev, f"could not bind {dev} again"
            subprocess.run(["mkswap", dev], check=True, capture_output=True, timeout=30)
            # lowest priority and plenty of free RAM: nothing is paged to it meanwhile
            subprocess.run(["swapon", "-p", "-2", dev], check=True, timeout=30)
            header = image.read_bytes()[:8192]

            removed = attach.detach(stack.state)
            assert removed is not None
            assert "not by duvm's" in str(removed.extra.get("device_problem")), removed.extra
            # their swap is still on, their bytes untouched (no blkdiscard), the loop kept
            assert kernel_swap.swap_entry(dev) is not None
            assert image.read_bytes()[:8192] == header
            backing = Path("/sys/block", Path(dev).name, "loop", "backing_file")
            assert backing.read_text().strip() == str(image)
            # and what was duvm's is gone: mount, nbdfuse, state file (the swap on `dev` that
            # leftovers() reports is theirs now)
            assert not stack.state.exists()
            assert stack.leftovers() == [f"swap {dev}", f"process {stack.server.pid}"]
    finally:
        if reused is not None:
            subprocess.run(["swapoff", reused], capture_output=True, timeout=60)
            subprocess.run(["losetup", "-d", reused], capture_output=True, timeout=30)
        shutil.rmtree(other, ignore_errors=True)


def test_a_state_dir_reached_through_a_symlink_is_still_recognised() -> None:
    """The kernel names a loop device's backing file by its resolved path; the state file
    may name it through a symlink (an older state file, or /var/run -> /run): disable must
    still see its own device and swap it off."""
    with swap_stack() as stack:
        link = stack.base / "via-link"
        (stack.base / "real").mkdir()
        link.symlink_to(stack.base / "real")
        att = attach.attach(stack.sock, stack.state, run_dir=link, method=attach_state.METHOD_FUSE)
        stack.pids += [p for p in (att.nbdfuse_pid,) if p]
        stack.devices += [d for d in (att.device,) if d]
        assert att.fuse_file is not None and att.fuse_file.startswith(str(stack.base / "real"))
        # as an older duvm wrote it: through the link
        saved = json.loads(stack.state.read_text())
        saved["fuse_file"] = saved["fuse_file"].replace(str(stack.base / "real"), str(link))
        saved["mountdir"] = saved["mountdir"].replace(str(stack.base / "real"), str(link))
        stack.state.write_text(json.dumps(saved))
        assert attach.device_problem(attach_state.load_state(stack.state)) is None
        removed = attach.detach(stack.state)
        assert removed is not None and "device_problem" not in removed.extra
        assert kernel_swap.swap_entry(att.device or "") is None
        assert stack.leftovers() == [f"process {stack.server.pid}"]
