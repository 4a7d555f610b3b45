"""`duvm doctor`: check every prerequisite of this node, and say what to do about each gap.

Theory of operation
-------------------
Each check is a small function that looks (never changes anything: no ``modprobe`` without
``-n``, no sysctl write, no mount) and returns a `Check`: a name, a status, whether duvm
cannot work without it (``required``), what was found, and, when something is wrong, the fix
(the Debian package to install or the command to run). A required check that fails makes the
command exit 1; warnings (a slower fallback path, a low ``vm.min_free_kbytes`` that enable
raises anyway, no uvloop, the pure-Python request path) keep exit 0. ``--json`` prints the
same list as data.

What is checked is what `duvm enable` will need, found the way enable finds it. This
machine's checks are in :mod:`duvm.node.doctor.doctor_host`: system tools in the fixed sbin/bin
directories `duvm.node.attach.systools` uses (never $PATH, so a doctor verdict cannot differ from
enable's), the kernel nbd device or the nbdfuse + FUSE + loop fallback for the configured
method, the swap tools, a memory cgroup, the network reserve, the protections the daemon takes
against memory pressure (tried in a throwaway child) and the RT throttling that bounds its
realtime class. For GPU work, :mod:`duvm.node.doctor.doctor_gpu` reports how much RAM processes
keep locked or pinned (the pool never holds it) and whether the NVIDIA driver has HMM active
(read through NVML where the driver is installed, skipped where it is not). The cluster's are
in :mod:`duvm.node.doctor.doctor_cluster`: the cluster secret file (root-owned, no group/other
access, lines that are secrets), how the daemon will authenticate to its peers (decided by the
daemon's own rule, `client_flags.client_security_from_args`, over the security flags in the
config's ``daemon_args``), and each peer: a TCP connect with a timeout, then a page-protocol
STATUS under that same authentication, so a port that answers but is not a memserver, or a
memserver that refuses our secret, is caught. This module reads the command
line and the config into `Options` (:mod:`duvm.node.doctor.doctor_check`), runs the checks in a
fixed order and reports them.

Where it looks is a `Probe` (tool directories, /dev, /sys/module, the cgroup root, the sysctl
file), so tests point checks at directories that lack one piece and see the real check fail.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from duvm.node.attach import attach_state
from duvm.node.doctor import doctor_cluster, doctor_gpu, doctor_host, doctor_rdma
from duvm.node.doctor.doctor_check import (
    FAIL,
    OK,
    PEER_TIMEOUT_S,
    SKIP,
    WARN,
    Check,
    Options,
    verdict,
)
from duvm.node.lifecycle import control


def check_config(opts: Options) -> Check:
    if opts.config_path is None:
        return Check("config", SKIP, True, "no --config given")
    return verdict(
        "config",
        opts.config_error is not None,
        True,
        opts.config_error or f"{opts.config_path} is valid",
        f"fix {opts.config_path} (see duvm.example.toml in the duvm sources)",
    )


def run_checks(opts: Options, probe: doctor_host.Probe | None = None) -> list[Check]:
    probe = probe or doctor_host.Probe()
    nbd, fuse = doctor_host.kernel_nbd(probe), doctor_host.fuse_loop(probe)
    peer_auth = doctor_cluster.check_peer_auth(opts)
    return [
        check_config(opts),
        doctor_host.check_root(),
        nbd[1],
        fuse[1],
        doctor_host.check_block_device(opts.method, nbd, fuse),
        doctor_host.check_nbdfuse_unswappable(opts.method, fuse, probe),
        doctor_host.check_swap_tools(probe),
        doctor_host.check_cgroup(probe),
        doctor_host.check_min_free(probe),
        doctor_host.check_swap_path(opts.daemon_args),
        doctor_host.check_rt_throttle(probe),
        doctor_gpu.check_pinned(probe.proc, probe.meminfo),
        doctor_gpu.check_gpu_hmm(),
        doctor_cluster.check_secret(doctor_cluster.secret_path(opts)),
        peer_auth[1],
        doctor_cluster.check_peers(opts.peers, opts.peer_timeout, peer_auth[0]),
        *doctor_rdma.check_rdma(opts),
        doctor_host.check_uvloop(),
        doctor_host.check_request_path(),
    ]


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
