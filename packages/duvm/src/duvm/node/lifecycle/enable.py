"""`duvm enable`: start the daemon, reserve capacity on peers, attach, activate swap (root)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from duvm.base.units import parse_size
from duvm.node.attach import attach_state
from duvm.node.lifecycle import control, resume, supervisor_process
from duvm.node.lifecycle.config import with_secret


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="TOML config, e.g. /etc/duvm/duvm.toml (peers, size, replicas, "
        "priority, secret_file, state_dir, daemon_args, workers; see duvm.example.toml)",
    )
    parser.add_argument(
        "--peers", metavar="HOST:PORT[,...]", help="memservers to reserve on (instead of --config)"
    )
    parser.add_argument("--size", metavar="SIZE", help="swap device size, e.g. 4G")
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="copies of each page, on distinct peers (default 2 with 2 or more "
        "peers, which survives the loss of any one memserver; else 1)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        metavar="PATH",
        help="cluster secret file (mode 0600); required for peers off loopback",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=attach_state.DEFAULT_PRIORITY,
        help=f"swap priority (default {attach_state.DEFAULT_PRIORITY})",
    )
    parser.add_argument(
        "--method",
        choices=("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE),
        default="auto",
        help="auto (the default) takes kernel nbd and refuses to run without it; "
        "nbdfuse-loop is the fallback for kernels without nbd, which can hang the node when "
        "the whole machine runs short of memory",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=control.DEFAULT_STATE_DIR,
        help=f"where state, sockets and logs live (default {control.DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--no-supervise",
        dest="supervise",
        action="store_false",
        help="do not start `duvm supervise`, which restarts a crashed daemon "
        "onto the live device (kernel nbd over netlink only)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="serve the device with N daemon processes, one kernel nbd connection each (the "
        "kernel spreads requests over them by CPU); default 1 (workers = N in the config). "
        "No standby then: a crash costs a restart (DECISIONS.md D49)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="the daemon died: restart it from its saved state and hand it the "
        "live kernel nbd device again (pages kept; no other option is needed)",
    )


def config_from_args(args: argparse.Namespace) -> control.Config:
    if args.config is not None:
        if args.peers or args.size or args.secret_file:
            raise control.ControlError(
                "give either --config or --peers/--size/--secret-file, not both"
            )
        cfg = control.load_config(args.config)
        cfg.supervise = args.supervise
        if args.workers is not None:
            cfg.workers = args.workers
        return cfg.validate()
    if not args.peers or not args.size:
        raise control.ControlError("give --config FILE, or both --peers and --size")
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        raise control.ControlError(str(exc)) from exc
    return control.Config(
        peers=[p.strip() for p in args.peers.split(",") if p.strip()],
        size=size,
        priority=args.priority,
        replicas=args.replicas,
        method=args.method,
        state_dir=args.state_dir,
        daemon_args=with_secret([], args.secret_file),
        secret_file=args.secret_file,
        supervise=args.supervise,
        workers=1 if args.workers is None else args.workers,
    ).validate()


def say_supervisor(pid: int | None, problem: str | None, doing: str) -> None:
    """Tell the user how starting the supervisor went (after enable, or enable --resume)."""
    if problem:
        print(
            f"duvm enable: warning: {problem}; nothing will restart a crashed daemon "
            "(`duvm enable --resume` does it by hand)",
            file=sys.stderr,
        )
    elif pid:
        print(f"duvm enable: supervisor pid {pid} {doing}")


def run(args: argparse.Namespace) -> int:
    if args.resume:
        try:
            info, att = resume.resume(args.state_dir)
        except (control.ControlError, attach_state.AttachError) as exc:
            print(f"duvm enable --resume: {exc}", file=sys.stderr)
            return 1
        print(f"duvm resumed: daemon pid {info.pid} serves {att.device} again")
        if (
            att.extra.get("supervise")
            and supervisor_process.wanted(att, info.daemon_args)
            and not supervisor_process.alive(supervisor_process.load(args.state_dir))
        ):
            pid, problem = supervisor_process.start(
                args.state_dir
            )  # it had given up, or was killed
            say_supervisor(pid, problem, "watches the daemon again")
        return 0
    try:
        cfg = config_from_args(args)
        # the daemon keeps its state on files so `--resume` can restart it
        # (duvm.node.lifecycle.resume)
        cfg.daemon_args = resume.with_state_dir(cfg.daemon_args, cfg.state_dir)
        att = control.enable(cfg)
    except (control.ControlError, attach_state.AttachError) as exc:
        print(f"duvm enable: {exc}", file=sys.stderr)
        return 1
    if cfg.skipped_self:
        print(f"duvm enable: skipping this node's own memserver {', '.join(cfg.skipped_self)}")
    print(
        f"duvm enabled: {att.device} via {att.method}, {(att.size_bytes or 0) >> 20} MiB of "
        f"swap at priority {att.priority} on {len(cfg.peers)} peer(s), "
        f"{cfg.replicas} cop{'y' if cfg.replicas == 1 else 'ies'} of each page"
    )
    say_supervisor(
        att.extra.get("supervisor_pid"),
        att.extra.get("supervisor_problem"),
        "restarts the daemon onto the live device if it crashes",
    )
    if att.extra.get("supervisor_pid") and (why := no_standby(args.state_dir)):
        print(
            f"duvm enable: warning: no standby daemon fits ({why}): "
            f"{supervisor_process.NO_STANDBY}",
            file=sys.stderr,
        )
    for warning in (
        replica_warning(cfg),
        att.extra.get("state_problem"),
        att.extra.get("swap_path_problem"),
    ):
        if warning:
            print(f"duvm enable: warning: {warning}", file=sys.stderr)
    return 0


def no_standby(state_dir: Path, wait_s: float = 2.0) -> str | None:
    """Why the supervisor keeps no standby, when memory is too short for one: it decides on
    its first look, right after it starts (`standby_process.Spares`); None when it starts
    one (recorded as starting), or has said nothing within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        sb = supervisor_process.standby_status(state_dir)
        if sb is not None or time.monotonic() >= deadline:
            return sb.get("none") if sb is not None else None
        time.sleep(0.05)


def replica_warning(cfg: control.Config) -> str | None:
    """What a single copy of each page risks, and the fix; None when pages are replicated."""
    if cfg.replicas != 1:
        return None
    fix = "add a second peer" if len(cfg.peers) < 2 else "use --replicas 2 (replicas = 2)"
    return (
        "one copy of each page: a memserver that dies or restarts takes its pages with it "
        f"and the programs that own them get I/O errors; {fix}"
    )
