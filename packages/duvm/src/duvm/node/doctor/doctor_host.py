"""`duvm doctor`'s checks of this machine: root, a way to attach a block device (kernel nbd or
nbdfuse + FUSE + loop), the swap tools, a memory cgroup, the network reserve
(``vm.min_free_kbytes``), the daemon's protections against memory pressure and the RT throttling
that bounds them, and uvloop. Each looks and changes nothing; where it looks is a `Probe`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from duvm.base import accel, cgroup, pressure
from duvm.node.attach import attach_fuse, attach_state, kernel_swap, systools
from duvm.node.doctor.doctor_check import FAIL, OK, SKIP, WARN, Check, verdict

SWAP_TOOLS = ("mkswap", "swapon", "swapoff", "blkdiscard")
FUSE_TOOLS = ("nbdfuse", "fusermount3", "losetup")


@dataclass(frozen=True)
class Probe:
    """Where the checks look; the defaults are the places `duvm enable` uses."""

    tool_dirs: tuple[str, ...] = systools.TOOL_DIRS
    dev: Path = Path("/dev")
    sys_module: Path = Path("/sys/module")
    cgroup_root: Path = cgroup.CGROUP_ROOT
    min_free: Path = kernel_swap.MIN_FREE_SYSCTL
    meminfo: Path = Path("/proc/meminfo")
    proc: Path = Path("/proc")
    rt_runtime: Path = pressure.RT_RUNTIME
    rt_period: Path = pressure.RT_PERIOD

    def tool(self, name: str) -> str | None:
        return systools.find_tool(name, self.tool_dirs)


def _package(tool: str) -> str:
    return systools.TOOL_PACKAGES.get(tool, "util-linux")


def check_root() -> Check:
    euid = os.geteuid()
    return verdict(
        "root",
        euid != 0,
        True,
        "running as root" if euid == 0 else f"running as uid {euid}, not root",
        "enable/disable attach devices and call swapon: run as root (sudo duvm ...)",
    )


def kernel_nbd(probe: Probe) -> tuple[bool, Check]:
    """(usable, check): loaded, or a module `modprobe -n` finds (enable then loads it)."""
    devices = sorted(p.name for p in probe.dev.glob("nbd*") if p.name[3:].isdigit())
    if devices or (probe.sys_module / "nbd").exists():
        return True, Check(
            "kernel-nbd", OK, False, f"nbd loaded, {len(devices)} device(s) /dev/nbd*"
        )
    modprobe = probe.tool("modprobe")
    if modprobe is not None:
        res = subprocess.run(
            [modprobe, "-n", "-q", "nbd"], capture_output=True, timeout=30, check=False
        )
        if res.returncode == 0:
            return True, Check(
                "kernel-nbd",
                OK,
                False,
                "nbd module available, not loaded (enable runs modprobe nbd)",
            )
        why = "this kernel has no nbd module"
        fix = (
            "install the kernel's extra modules (e.g. linux-modules-extra-$(uname -r)) or "
            'accept the nbdfuse+loop fallback\'s risk (method = "nbdfuse-loop")'
        )
    else:
        why = "nbd not loaded and modprobe is missing"
        fix = f"apt-get install {_package('modprobe')}, then modprobe nbd"
    return False, Check("kernel-nbd", WARN, False, why, fix)


def fuse_loop(probe: Probe) -> tuple[bool, Check]:
    """(usable, check) for the fallback: nbdfuse, fusermount3, losetup, /dev/fuse, loop."""
    missing, fixes = [], []
    for t in FUSE_TOOLS:
        if probe.tool(t) is None:
            missing.append(t)
            fixes.append(f"apt-get install {_package(t)}")
    for node, module in (("fuse", "fuse"), ("loop-control", "loop")):
        if not (probe.dev / node).exists():
            missing.append(f"/dev/{node}")
            fixes.append(f"modprobe {module}")
    if not missing:
        return True, Check(
            "fuse-loop",
            OK,
            False,
            "nbdfuse, fusermount3, losetup, /dev/fuse and /dev/loop-control present",
        )
    return False, Check(
        "fuse-loop", WARN, False, "missing: " + ", ".join(missing), "; ".join(dict.fromkeys(fixes))
    )


def check_block_device(method: str, nbd: tuple[bool, Check], fuse: tuple[bool, Check]) -> Check:
    """Required: a path `method` may take exists (auto: kernel nbd first, else the fallback)."""
    paths = {
        attach_state.METHOD_KERNEL: [nbd],
        attach_state.METHOD_FUSE: [fuse],
        "auto": [nbd],  # never the fallback: attach_fuse.AUTO_REFUSES_FALLBACK
    }
    if method not in paths:
        return Check(
            "block-device",
            FAIL,
            True,
            f"unknown method {method!r}",
            f"set method to one of {', '.join(sorted(paths))}",
        )
    candidates = paths[method]
    for usable, c in candidates:
        if usable:
            via = "kernel nbd" if c.name == "kernel-nbd" else "nbdfuse + loop"
            if c.name == "fuse-loop":
                via += f" (chosen by name: {attach_fuse.FALLBACK_UNDER_PRESSURE})"
            return Check("block-device", OK, True, f"method {method}: {via}")
    if method == "auto":
        return Check(
            "block-device", FAIL, True, attach_fuse.AUTO_REFUSAL_WHY, attach_fuse.AUTO_REFUSAL_FIX
        )
    fixes = [c.fix for _, c in candidates if c.fix]
    return Check(
        "block-device",
        FAIL,
        True,
        f"method {method}: no way to attach a block device "
        f"({'; '.join(c.detail for _, c in candidates)})",
        " or ".join(fixes) or None,
    )


def check_nbdfuse_unswappable(method: str, fuse: tuple[bool, Check], probe: Probe) -> Check:
    """Where the nbdfuse + loop fallback is the path taken: whether nbdfuse can be kept out of
    swap (a cgroup v2 memory controller); swapped out to the device it serves, it would wait
    for itself once the whole machine runs short of memory."""
    taken = fuse[0] and method == attach_state.METHOD_FUSE
    if not taken:
        return Check("nbdfuse-unswappable", SKIP, False, "the nbdfuse + loop path is not taken")
    try:
        version = cgroup.detect_version(probe.cgroup_root)
    except OSError:
        version = None
    return verdict(
        "nbdfuse-unswappable",
        version != 2,
        False,
        "nbdfuse runs in a cgroup v2 group that is never swapped out"
        if version == 2
        else "no cgroup v2 memory controller: nbdfuse can be swapped out to the device it "
        "serves, and hang the swap path when the whole machine runs short of memory",
        "use kernel nbd (modprobe nbd), or boot with the unified cgroup hierarchy "
        "(systemd.unified_cgroup_hierarchy=1)",
    )


def check_swap_tools(probe: Probe) -> Check:
    missing = [t for t in SWAP_TOOLS if probe.tool(t) is None]
    pkgs = sorted({_package(t) for t in missing})
    return verdict(
        "swap-tools",
        bool(missing),
        True,
        "missing: " + ", ".join(missing) if missing else ", ".join(SWAP_TOOLS),
        f"apt-get install {' '.join(pkgs)}",
    )


def check_cgroup(probe: Probe) -> Check:
    try:
        version = cgroup.detect_version(probe.cgroup_root)
    except OSError as exc:
        version, err = None, f" ({exc})"
    else:
        err = ""
    return verdict(
        "cgroup-memory",
        version is None,
        False,
        f"cgroup v{version} memory controller"
        if version
        else f"no usable memory cgroup at {probe.cgroup_root}{err}",
        "needed by duvm demo and disable's swapoff safety check: mount cgroup2 on "
        "/sys/fs/cgroup with the memory controller enabled (or boot with cgroup_enable=memory)",
    )


def check_min_free(probe: Probe) -> Check:
    try:
        now = int(probe.min_free.read_text())
        want = kernel_swap.safe_min_free_kbytes(kernel_swap.mem_total_kb(probe.meminfo.read_text()))
    except (OSError, ValueError, attach_state.AttachError) as exc:
        return Check(
            "min-free-kbytes",
            WARN,
            False,
            f"cannot read {probe.min_free}: {exc}",
            "check that /proc is mounted",
        )
    return verdict(
        "min-free-kbytes",
        now < want,
        False,
        f"vm.min_free_kbytes = {now} (swap over the network wants >= {want})",
        f"enable raises it to {want} while attached; to keep it: "
        f"echo 'vm.min_free_kbytes = {want}' > /etc/sysctl.d/90-duvm.conf && sysctl --system",
    )


# the capability each protection needs (duvm.base.pressure), and what else can refuse it
_PROTECTION_CAP = {
    "mlock": "CAP_IPC_LOCK",
    "io-flusher": "CAP_SYS_RESOURCE",
    "realtime": "CAP_SYS_NICE",
    "oom-score": "CAP_SYS_RESOURCE",
}
_PROTECTION_NOTE = {
    "mlock": "or raise the locked-memory limit (systemd: LimitMEMLOCK=infinity)",
    "io-flusher": "PR_SET_IO_FLUSHER needs Linux 5.6",
    "realtime": "under a cgroup v1 cpu controller with RT group scheduling, give duvm's group "
    "cpu.rt_runtime_us; systemd units must not set RestrictRealtime=yes",
}


def protection_fix(refused: list[str], as_root: bool) -> str:
    """What to do about the refused protections: each capability named once. Root that lacks
    one runs in a container or sandbox that dropped it, so it is told how to grant it."""
    caps = list(dict.fromkeys(_PROTECTION_CAP[k] for k in refused))
    if as_root:
        them = "it" if len(caps) == 1 else "them"
        first = (
            f"grant {', '.join(caps)} (root here runs without {them}: a container or sandbox "
            f"dropped {them}; systemd: AmbientCapabilities={' '.join(caps)}, docker/podman: "
            + " ".join(f"--cap-add {c.removeprefix('CAP_')}" for c in caps)
            + ")"
        )
    else:
        first = f"run duvm enable as root ({', '.join(caps)})"
    return "; ".join([first, *(_PROTECTION_NOTE[k] for k in refused if k in _PROTECTION_NOTE)])


# the daemon's flags that turn a protection off (duvm.node.daemon.daemon), by the name
# pressure.probe uses
_OPT_OUTS = {"--no-realtime": "realtime", "--no-mlock": "mlock", "--no-io-flusher": "io-flusher"}


def check_swap_path(daemon_args: list[str], python: str = sys.executable) -> Check:
    """Can the daemon take every protection against memory pressure (`duvm.base.pressure`)? Tried
    in a throwaway child process, so this process changes nothing."""
    code = "import json; from duvm.base import pressure; print(json.dumps(pressure.probe()))"
    try:
        res = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
        got = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        return Check("swap-path-protection", WARN, False, f"could not try them: {exc}")
    opted_out = {name: flag for flag, name in _OPT_OUTS.items() if flag in daemon_args}
    for name, flag in opted_out.items():
        got[name] = f"turned off by {flag} in daemon_args"
    bad = {k: v for k, v in got.items() if v}
    if not bad:
        return Check(
            "swap-path-protection",
            OK,
            False,
            "the daemon can lock itself in RAM, run realtime (SCHED_RR), be an I/O "
            "flusher and lower its OOM score",
        )
    fixes = [f"remove {opted_out[k]} from daemon_args" for k in bad if k in opted_out]
    refused = [k for k in bad if k not in opted_out]
    if refused:
        fixes.append(protection_fix(refused, os.geteuid() == 0))
    return Check(
        "swap-path-protection",
        WARN,
        False,
        "; ".join(f"{v}" for v in bad.values())
        + ": under memory pressure the node can hang on its own swap device",
        "; ".join(fixes),
    )


def check_rt_throttle(probe: Probe) -> Check:
    """RT throttling bounds what a realtime daemon can take from the other tasks on a CPU."""
    got = pressure.rt_throttle(probe.rt_runtime, probe.rt_period)
    if got is None:
        return Check("rt-throttling", SKIP, False, "cannot read /proc/sys/kernel/sched_rt_*")
    runtime, period = got
    if runtime < 0:
        return Check(
            "rt-throttling",
            WARN,
            False,
            "kernel.sched_rt_runtime_us = -1: realtime tasks (the duvm daemon "
            "included) may take a whole CPU with nothing left for the others",
            "sysctl kernel.sched_rt_runtime_us=950000 (the kernel's default: 95 %)",
        )
    return Check(
        "rt-throttling",
        OK,
        False,
        f"realtime tasks get at most {100 * runtime / max(period, 1):.0f} % of each "
        f"CPU ({runtime} of {period} µs)",
    )


def check_uvloop() -> Check:
    try:
        import uvloop
    except ImportError:
        return Check(
            "uvloop",
            WARN,
            False,
            "uvloop not importable: asyncio's default loop is used (slower fault path)",
            "reinstall duvm with its dependencies (e.g. uv tool install --reinstall duvm)",
        )
    return Check("uvloop", OK, False, f"uvloop {getattr(uvloop, '__version__', 'n/a')}")


def check_request_path() -> Check:
    """Which request path the daemon and memservers run (duvm.base.accel): the compiled one,
    the pure-Python reference chosen with DUVM_PURE_PYTHON, or the reference for want of a
    build (a warning: several times the CPU per request)."""
    rep = accel.report()
    if rep.path == "compiled":
        return Check("request-path", OK, False, "compiled (" + ", ".join(rep.modules) + ")")
    if rep.chosen:
        return Check("request-path", OK, False, f"pure Python: {rep.why}")
    return Check(
        "request-path",
        WARN,
        False,
        f"pure Python, several times the CPU per request: {rep.why}",
        accel.BUILD_FIX,
    )
