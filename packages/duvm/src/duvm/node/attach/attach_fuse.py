"""The nbdfuse + loop path of `duvm.node.attach.attach`, the fallback where the kernel has no nbd.

``nbdfuse`` (libnbd) shows the daemon's export as one file on a FUSE mount; ``losetup
--direct-io=on`` puts a loop device on that file, so swap I/O goes straight to nbdfuse without
a second copy in the page cache. Detach undoes it in reverse: loop device, mount, nbdfuse.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

from duvm.base import cgroup, pressure
from duvm.node.attach import processes, systools
from duvm.node.attach.attach_state import AttachError, Attachment, Saver
from duvm.node.attach.systools import SYSTEM_TOOLS, Tools

# QEMU guests pushed past their RAM (tools/qemu_guest/stress.py --method nbdfuse-loop) still
# hang sometimes on this path with nbdfuse kept in RAM (docs/BENCHMARKS.md, D38).
MEASURED_RISK = "2 of 8 stress runs in QEMU guests hung; kernel nbd: none of 20"

# Said by enable when the fallback was asked for by name.
FALLBACK_UNDER_PRESSURE = (
    f"the nbdfuse + loop fallback can hang when the whole machine runs short of memory "
    f"({MEASURED_RISK}): on such nodes use a kernel with nbd"
)

# Why `auto` never takes the fallback (doctor's detail), the two ways forward (doctor's fix),
# and both in enable's one error line.
AUTO_REFUSAL_WHY = (
    "this kernel has no nbd driver, and method auto does not take the nbdfuse + loop fallback: "
    f"it can hang the node when the whole machine runs short of memory ({MEASURED_RISK})"
)
AUTO_REFUSAL_FIX = (
    "run a kernel with nbd (modprobe nbd; on Debian/Ubuntu the module is in linux-image-* or "
    "linux-modules-extra-$(uname -r)), or accept the risk with --method nbdfuse-loop "
    '(method = "nbdfuse-loop" in the config)'
)
AUTO_REFUSES_FALLBACK = f"{AUTO_REFUSAL_WHY}. Either {AUTO_REFUSAL_FIX}"


def problems(tools: Tools = SYSTEM_TOOLS) -> list[str]:
    """Why the nbdfuse+loop path cannot work here (empty list: it can)."""
    found = [
        f"{t} missing (Debian package {systools.TOOL_PACKAGES[t]})"
        for t in ("nbdfuse", "fusermount3", "losetup")
        if tools.find(t) is None
    ]
    if not Path("/dev/fuse").exists():
        found.append("/dev/fuse missing (kernel without FUSE; try modprobe fuse)")
    if not Path("/dev/loop-control").exists():
        found.append("/dev/loop-control missing (kernel without loop; try modprobe loop)")
    return found


def attach(
    att: Attachment,
    run_dir: Path,
    save: Saver,
    realtime: bool = True,
    tools: Tools = SYSTEM_TOOLS,
) -> None:
    """Start nbdfuse on a new mount under `run_dir` and a loop device on its file;
    `att.device` is the loop device."""
    nbdfuse = tools.require("nbdfuse")
    tools.require("fusermount3")
    mountdir = run_dir.resolve() / f"fuse-{uuid.uuid4().hex[:8]}"  # as the kernel names it
    mountdir.mkdir(parents=True)
    att.mountdir = str(mountdir)
    att.fuse_file = str(mountdir / "swap")
    save()
    pidfile = run_dir / f"{mountdir.name}.pid"
    logpath = run_dir / f"{mountdir.name}.log"
    # nbdfuse is on the swap path like the daemon: realtime and an I/O flusher from its first
    # instruction (both survive exec). mlockall does not, so it cannot be locked from here:
    # it runs in a cgroup whose memory is never swapped out instead, or, swapped out to the
    # device it serves, it would wait for itself (seen hang a 256 MiB guest under pressure)
    protect = pressure.inherited_protections if realtime else pressure.become_io_flusher
    att.extra["swap_path_problem"] = FALLBACK_UNDER_PRESSURE
    try:
        group = cgroup.unswappable_group()
    except cgroup.CgroupError as exc:
        att.extra["swap_path_problem"] = (
            f"nbdfuse can be swapped out to the device it serves ({exc}), and "
            + FALLBACK_UNDER_PRESSURE
        )
        preexec = protect
    else:
        att.nbdfuse_cgroup = str(group)
        join = cgroup.joiner(group)

        def preexec() -> None:
            join()
            protect()

    proc = processes.spawn_detached(
        [nbdfuse, "-P", str(pidfile), att.fuse_file, "--unix", att.socket],
        logpath,
        preexec=preexec,
    )
    att.nbdfuse_pid, att.nbdfuse_start = proc.pid, processes.start_time(proc.pid)
    save()
    # nbdfuse sits on the swap path: if the OOM killer picked it, every swapped page would be
    # unreachable and the processes owning them would die on swap-in errors
    with contextlib.suppress(OSError):
        Path(f"/proc/{proc.pid}/oom_score_adj").write_text("-1000")
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not os.path.exists(att.fuse_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AttachError(
                f"nbdfuse could not expose {att.socket}: {logpath.read_text()[-800:].strip()}"
            )
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    att.size_bytes = os.stat(att.fuse_file).st_size
    loop = tools.run("losetup", "--find", "--show", "--direct-io=on", att.fuse_file).strip()
    att.loop_device = loop
    save()
    dio = Path("/sys/block", Path(loop).name, "loop", "dio")
    att.direct_io = dio.exists() and dio.read_text().strip() == "1"
    att.device = loop


def device_problem(att: Attachment, sys_root: Path = Path("/sys")) -> str | None:
    """Why `att.device` is no longer the loop device this attachment made, or None: the number
    is reused as soon as it is free, so it must still be backed by our FUSE file (as sysfs
    under `sys_root` reports it)."""
    assert att.device is not None
    if att.device != att.loop_device:
        return None
    found = _loop_backing(att.device, sys_root)
    if found is None:
        return f"{att.device} is no longer a loop device"
    if not _same_path(found, att.fuse_file):
        return f"{att.device} is now backed by {found}, not by duvm's {att.fuse_file}"
    return None


def _loop_backing(device: str, sys_root: Path = Path("/sys")) -> str | None:
    backing = sys_root / "block" / Path(device).name / "loop" / "backing_file"
    try:
        return backing.read_text().strip()
    except OSError:
        return None


def _same_path(kernel_path: str, ours: str | None) -> bool:
    """The kernel reports a loop device's backing file resolved; ours may name it through a
    symlink or a relative state directory."""
    return ours is not None and os.path.realpath(kernel_path) == os.path.realpath(ours)


def detach(att: Attachment, errors: list[str], tools: Tools = SYSTEM_TOOLS) -> None:
    """Loop device, mount, nbdfuse, mount directory; what failed is appended to `errors`."""
    if att.loop_device:
        found = _loop_backing(att.loop_device)
        if found is not None and _same_path(found, att.fuse_file):
            try:
                tools.run("losetup", "-d", att.loop_device)
            except AttachError as exc:
                errors.append(str(exc))
                return
        att.loop_device = None
    if att.mountdir and _is_mounted(att.mountdir):
        # the loop driver drops its file reference asynchronously after losetup -d
        for attempt in range(50):
            try:
                tools.run("fusermount3", "-u", att.mountdir)
                break
            except AttachError as exc:
                if attempt == 49:
                    errors.append(str(exc))
                    return
                time.sleep(0.1)
    if (
        att.nbdfuse_pid
        and processes.pid_runs(att.nbdfuse_pid, "nbdfuse", att.nbdfuse_start)
        and not processes.wait_pid_exit(att.nbdfuse_pid, 30, att.nbdfuse_start)
    ):
        errors.append(f"nbdfuse {att.nbdfuse_pid} still runs after unmount")
        return
    att.nbdfuse_pid = att.nbdfuse_start = None
    if att.nbdfuse_cgroup:
        cgroup.remove_if_empty(Path(att.nbdfuse_cgroup))
        att.nbdfuse_cgroup = None
    if att.mountdir:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(att.mountdir)
        run_dir = Path(att.mountdir).parent
        with contextlib.suppress(FileNotFoundError):
            (run_dir / f"{Path(att.mountdir).name}.log").unlink()


def _is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[1].replace("\\040", " ") == real:
            return True
    return False
