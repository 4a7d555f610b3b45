"""`duvm doctor`: check every prerequisite of this node, and say what to do about each gap.

Theory of operation
-------------------
Each check is a small function that looks (never changes anything: no ``modprobe`` without
``-n``, no sysctl write, no mount) and returns a `Check`: a name, a status, whether duvm
cannot work without it (``required``), what was found, and, when something is wrong, the fix
(the Debian package to install or the command to run). A required check that fails makes the
command exit 1; warnings (a slower fallback path, a low ``vm.min_free_kbytes`` that enable
raises anyway, no uvloop) keep exit 0. ``--json`` prints the same list as data.

What is checked is what `duvm enable` will need, found the way enable finds it: system tools
in the fixed sbin/bin directories `duvm.node.systools` uses (never $PATH, so a doctor verdict cannot
differ from enable's), the kernel nbd device or the nbdfuse + FUSE + loop fallback for the
configured method, the swap tools, a memory cgroup, the network reserve, the protections the
daemon takes against memory pressure (tried in a throwaway child) and the RT throttling that
bounds its realtime class, the cluster secret
file (root-owned, no group/other access, lines that are secrets), how the daemon will
authenticate to its peers (decided by the daemon's own rule, `auth.client_security_from_args`,
over the security flags in the config's ``daemon_args``), and each peer: a TCP connect with a
timeout, then a page-protocol STATUS under that same authentication, so a port that answers
but is not a memserver, or a memserver that refuses our secret, is caught.

Where it looks is a `Probe` (tool directories, /dev, /sys/module, the cgroup root, the sysctl
file), so tests point checks at directories that lack one piece and see the real check fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import stat
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from duvm.base import cgroup, pressure
from duvm.base.units import parse_hostport
from duvm.node import attach_state, control, kernel_swap, systools
from duvm.wire import auth

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PEER_TIMEOUT_S = 3.0
SWAP_TOOLS = ("mkswap", "swapon", "swapoff", "blkdiscard")
FUSE_TOOLS = ("nbdfuse", "fusermount3", "losetup")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    required: bool
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Probe:
    """Where the checks look; the defaults are the places `duvm enable` uses."""

    tool_dirs: tuple[str, ...] = systools.TOOL_DIRS
    dev: Path = Path("/dev")
    sys_module: Path = Path("/sys/module")
    cgroup_root: Path = cgroup.CGROUP_ROOT
    min_free: Path = kernel_swap.MIN_FREE_SYSCTL
    meminfo: Path = Path("/proc/meminfo")
    rt_runtime: Path = pressure.RT_RUNTIME
    rt_period: Path = pressure.RT_PERIOD

    def tool(self, name: str) -> str | None:
        return systools.find_tool(name, self.tool_dirs)


@dataclass
class Options:
    peers: list[str] = field(default_factory=list)
    method: str = "auto"
    secret_file: Path | None = None
    config_error: str | None = None
    config_path: Path | None = None
    peer_timeout: float = PEER_TIMEOUT_S
    # the config's daemon_args: security flags (--secret-file, --tls-*, --insecure), --no-realtime
    daemon_args: list[str] = field(default_factory=list)


def _verdict(
    name: str, problem: bool, required: bool, detail: str, fix: str | None = None
) -> Check:
    if not problem:
        return Check(name, OK, required, detail)
    return Check(name, FAIL if required else WARN, required, detail, fix)


def _package(tool: str) -> str:
    return systools.TOOL_PACKAGES.get(tool, "util-linux")


# --- checks ------------------------------------------------------------------------------------


def check_root() -> Check:
    euid = os.geteuid()
    return _verdict(
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
            "install the kernel's extra modules (e.g. linux-modules-extra-$(uname -r)) or use "
            'the nbdfuse+loop fallback (method = "nbdfuse-loop")'
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
        "auto": [nbd, fuse],
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
            if method == "auto" and c.name == "fuse-loop":
                via += " (no kernel nbd; slower)"
            return Check("block-device", OK, True, f"method {method}: {via}")
    fixes = [c.fix for _, c in candidates if c.fix]
    return Check(
        "block-device",
        FAIL,
        True,
        f"method {method}: no way to attach a block device "
        f"({'; '.join(c.detail for _, c in candidates)})",
        " or ".join(fixes) or None,
    )


def check_swap_tools(probe: Probe) -> Check:
    missing = [t for t in SWAP_TOOLS if probe.tool(t) is None]
    pkgs = sorted({_package(t) for t in missing})
    return _verdict(
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
    return _verdict(
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
    return _verdict(
        "min-free-kbytes",
        now < want,
        False,
        f"vm.min_free_kbytes = {now} (swap over the network wants >= {want})",
        f"enable raises it to {want} while attached; to keep it: "
        f"echo 'vm.min_free_kbytes = {want}' > /etc/sysctl.d/90-duvm.conf && sysctl --system",
    )


_PROTECTION_FIX = {
    "mlock": "run duvm enable as root (CAP_IPC_LOCK), or raise the locked-memory limit "
    "(systemd: LimitMEMLOCK=infinity)",
    "io-flusher": "run duvm enable as root (CAP_SYS_RESOURCE; PR_SET_IO_FLUSHER needs Linux 5.6)",
    "realtime": "run duvm enable as root (CAP_SYS_NICE); under a cgroup v1 cpu controller with "
    "RT group scheduling, give duvm's group cpu.rt_runtime_us; systemd units must "
    "not set RestrictRealtime=yes",
    "oom-score": "run duvm enable as root (CAP_SYS_RESOURCE)",
}


# the daemon's flags that turn a protection off (duvm.node.daemon), by the name pressure.probe uses
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
    fixes = [
        f"remove {opted_out[k]} from daemon_args" if k in opted_out else _PROTECTION_FIX[k]
        for k in bad
    ]
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


def _tcp(host: str, port: int, timeout: float) -> str | None:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def daemon_security(opts: Options) -> argparse.Namespace:
    """The daemon's security flags as its own parser reads them (other flags ignored);
    doctor's --secret-file, when given, stands in for the daemon's."""
    parser = argparse.ArgumentParser(add_help=False)
    auth.add_client_arguments(parser)
    ns, _ = parser.parse_known_args(opts.daemon_args)
    if opts.secret_file is not None:
        ns.secret_file = str(opts.secret_file)
    return ns


def check_peer_auth(opts: Options) -> tuple[auth.PeerSecurity | None, Check]:
    """How the daemon will authenticate to the peers, by the daemon's own rule (memservers
    off loopback need a secret or TLS unless --insecure). Returns the security doctor then
    uses for its STATUS requests, so an authenticating memserver answers it."""
    if not opts.peers:
        return None, Check("peer-auth", SKIP, True, "no peers given")
    try:
        addrs = [parse_hostport(p, control.MEMSERVER_PORT) for p in opts.peers]
        ns = daemon_security(opts)
        security = auth.client_security_from_args(ns, addrs)
    except (ValueError, OSError, auth.SecretError) as exc:
        return None, Check("peer-auth", FAIL, True, str(exc), _AUTH_FIX)
    if security is None:
        how = (
            "--insecure: pages go to unauthenticated peers"
            if ns.insecure and not auth.all_loopback(addrs)
            else "all peers on loopback, no authentication needed"
        )
        return None, Check(
            "peer-auth", WARN if ns.insecure else OK, False, how, _AUTH_FIX if ns.insecure else None
        )
    how = [f"secret file {ns.secret_file}"] if security.keyring else []
    how += ["TLS"] if security.tls else []
    return security, Check("peer-auth", OK, True, " + ".join(how))


_AUTH_FIX = (
    "duvm secret generate /etc/duvm/cluster.secret on one node, copy it (mode 0600, "
    'root) to every node, give memservers --secret-file and add "--secret-file", '
    '"/etc/duvm/cluster.secret" to daemon_args in duvm.toml'
)


async def _statuses(
    addrs: dict[str, tuple[str, int]], timeout: float, security: auth.PeerSecurity | None
) -> dict[str, dict[str, Any] | str]:
    from duvm.store.memclient import query_status  # the page protocol is only needed here

    async def one(host: str, port: int) -> dict[str, Any] | str:
        try:
            return await query_status(host, port, timeout=timeout, security=security)
        except Exception as exc:  # unreachable, refused auth, or not a memserver at all
            return str(exc)

    got = await asyncio.gather(*(one(h, p) for h, p in addrs.values()))
    return dict(zip(addrs, got, strict=True))


def check_peers(
    peers: list[str], timeout: float, security: auth.PeerSecurity | None = None
) -> Check:
    if not peers:
        return Check("peers", SKIP, True, "no peers given (--peers or --config)")
    problems, good, addrs = [], [], {}
    for p in peers:
        try:
            addrs[p] = parse_hostport(p, control.MEMSERVER_PORT)
        except ValueError as exc:
            problems.append(f"{p}: {exc}")
    # Connect to all peers at once, so N dead peers cost one timeout, not N.
    with ThreadPoolExecutor(max_workers=min(16, len(addrs) or 1)) as pool:
        errors = dict(
            zip(addrs, pool.map(lambda hp: _tcp(*hp, timeout), addrs.values()), strict=True)
        )
    problems += [f"{p}: {err}" for p, err in errors.items() if err]
    reachable = {p: addrs[p] for p, err in errors.items() if not err}
    fix = (
        "on each failing peer run `duvm memserver --listen HOST:PORT --capacity SIZE` (or "
        "its systemd unit duvm-node.service) and open that TCP port"
    )
    for peer, st in asyncio.run(_statuses(reachable, timeout, security)).items():
        if isinstance(st, str):
            problems.append(f"{peer}: port open but no duvm memserver STATUS ({st})")
            if "authentication required" in st and security is None:
                fix = "the peers require authentication: " + _AUTH_FIX
            elif "has no cluster secret" in st:  # it runs; it cannot prove the secret
                fix = (
                    f"the memserver at {peer} runs without the cluster secret: restart it with "
                    "--secret-file and this node's secret file (duvm node: secret_file in "
                    "duvm.toml)"
                )
            continue

        def mib(pages: object) -> str:
            return f"{pages * 4096 >> 20} MiB" if isinstance(pages, int) else "n/a"

        good.append(
            f"{peer} (capacity {mib(st.get('capacity_pages'))}, reserved "
            f"{mib(st.get('reserved_pages'))})"
        )
    detail = "; ".join([*problems, f"ok: {', '.join(good)}"] if good else problems)
    return _verdict("peers", bool(problems), True, detail, fix)


def check_secret(path: Path | None) -> Check:
    if path is None:
        return Check("secret-file", SKIP, True, "no cluster secret configured")
    fix = f"chown root:root {path} && chmod 0600 {path}"
    try:
        st = path.lstat()
    except OSError as exc:
        return Check(
            "secret-file",
            FAIL,
            True,
            f"{path}: {exc.strerror or exc}",
            f"duvm secret generate {path} (on one node; copy it to the others)",
        )
    problems = []
    if not stat.S_ISREG(st.st_mode):
        problems.append("not a regular file" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else ""))
    if st.st_uid != 0:
        problems.append(f"owned by uid {st.st_uid}, not root")
    if st.st_mode & 0o077:
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o} lets others read or write it")
    if not problems:  # safe to read: are the lines secrets (`duvm secret generate`)?
        try:
            n = len(auth.load_secrets(path))
        except auth.SecretError as exc:
            problems.append(str(exc))
            fix = f"duvm secret generate {path} (or fix the line it names)"
    return _verdict(
        "secret-file",
        bool(problems),
        True,
        f"{path}: "
        + (
            "; ".join(problems)
            if problems
            else f"{n} secret(s), root-owned, mode {stat.S_IMODE(st.st_mode):04o}"
        ),
        fix,
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


def check_config(opts: Options) -> Check:
    if opts.config_path is None:
        return Check("config", SKIP, True, "no --config given")
    return _verdict(
        "config",
        opts.config_error is not None,
        True,
        opts.config_error or f"{opts.config_path} is valid",
        f"fix {opts.config_path} (see duvm.example.toml in the duvm sources)",
    )


def run_checks(opts: Options, probe: Probe | None = None) -> list[Check]:
    probe = probe or Probe()
    nbd, fuse = kernel_nbd(probe), fuse_loop(probe)
    peer_auth = check_peer_auth(opts)
    return [
        check_config(opts),
        check_root(),
        nbd[1],
        fuse[1],
        check_block_device(opts.method, nbd, fuse),
        check_swap_tools(probe),
        check_cgroup(probe),
        check_min_free(probe),
        check_swap_path(opts.daemon_args),
        check_rt_throttle(probe),
        check_secret(secret_path(opts)),
        peer_auth[1],
        check_peers(opts.peers, opts.peer_timeout, peer_auth[0]),
        check_uvloop(),
    ]


def secret_path(opts: Options) -> Path | None:
    """--secret-file, else the daemon's --secret-file from daemon_args."""
    found = daemon_security(opts).secret_file
    return Path(found) if found else None


def passed(checks: list[Check]) -> bool:
    return not any(c.status == FAIL and c.required for c in checks)


# --- CLI ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the config enable will use (peers, method, daemon_args)",
    )
    parser.add_argument(
        "--peers",
        metavar="HOST:PORT[,...]",
        help="memservers to check (instead of / besides the config's)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        metavar="FILE",
        help="cluster secret file to check (else the --secret-file in the config's daemon_args)",
    )
    parser.add_argument(
        "--method",
        choices=("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE),
        help="attach method to check for (default: the config's, else auto)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="as the daemon's --insecure: peers off loopback without a secret",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=PEER_TIMEOUT_S,
        metavar="S",
        help=f"per-peer connect timeout (default {PEER_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def options_from_args(args: argparse.Namespace) -> Options:
    opts = Options(peer_timeout=args.timeout, config_path=args.config)
    raw: dict[str, Any] = {}
    if args.config is not None:
        # Read the file raw too, so a config enable would refuse still has its peers and
        # daemon flags checked.
        try:
            raw = tomllib.loads(args.config.read_text())
        except (OSError, ValueError):  # unreadable, not UTF-8, not TOML: load_config says
            raw = {}
        try:
            cfg = control.load_config(args.config)
            opts.peers, opts.method = list(cfg.peers), cfg.method
            opts.daemon_args = list(cfg.daemon_args)
        except (control.ControlError, ValueError) as exc:  # ValueError: bytes that are not UTF-8
            opts.config_error = (
                str(exc)
                if isinstance(exc, control.ControlError)
                else f"config {args.config} cannot be read as text: {exc}"
            )
            peers = raw.get("peers", [])
            opts.peers = [p for p in peers if isinstance(p, str)] if isinstance(peers, list) else []
    if args.peers:
        extra = [p.strip() for p in args.peers.split(",") if p.strip()]
        opts.peers = list(dict.fromkeys([*opts.peers, *extra]))
    if args.method:
        opts.method = args.method
    if opts.config_error is not None:  # still check what the file asks for
        dargs = raw.get("daemon_args", [])
        opts.daemon_args = [str(a) for a in dargs] if isinstance(dargs, list) else []
    opts.secret_file = args.secret_file
    if args.insecure:
        opts.daemon_args.append("--insecure")
    return opts


def render(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL, SKIP)}
    verdict = "ready" if passed(checks) else "NOT ready"
    lines = [
        f"duvm doctor: {verdict} ({counts[OK]} ok, {counts[WARN]} warning(s), "
        f"{counts[FAIL]} failed, {counts[SKIP]} skipped)"
    ]
    width = max(len(c.name) for c in checks)
    for c in checks:
        lines.append(f"  {c.status.upper():<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print("duvm doctor: --timeout must be positive", file=sys.stderr)
        return 2
    checks = run_checks(options_from_args(args))
    ok = passed(checks)
    if args.json:
        doc = {"ok": ok, "checks": [asdict(c) for c in checks]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(render(checks))
    return 0 if ok else 1
