"""`duvm node`: run this node's provider side — its memserver and the local control socket.

Theory of operation
-------------------
Every node of a cluster is both a provider and a consumer. The provider side is this command,
a long-running service (systemd unit duvm-node.service): a memserver lending ``[node]
capacity`` of this node's RAM to the pool on ``[node] listen``, authenticated with the
cluster's ``secret_file``. The consumer side is `duvm enable`, reading the same config file's
top-level keys (and skipping this node's own memserver in ``peers``), so one file copied to
every node configures both.

It is the memserver itself, run in this process (`duvm.memserver.command.run`), not a wrapper
around a child: there is one process to supervise, signals reach it directly and its exit code
is the command's. The settings become the memserver's own command line and are parsed by its own
parser, so `duvm node` and `duvm memserver` cannot drift apart. What the node adds:

- the config file (``--config``; flags override its values);
- a control socket by default (``/run/duvm/memserver.ctl``; `duvm.base.control_socket`'s protocol:
  owner-only 0600, only root and the owner answered, JSON lines, ``{"cmd": "status"}`` returns
  the memserver's STATUS with ``"role": "memserver"``: capacity, used and reserved pages,
  counters, connections and each namespace's reserved and stored pages). `duvm status` and
  gputaskman's pool panel read it;
- a refusal to start when another node already answers on that control socket (a second
  memserver would silently take the socket path over).

Signals are the memserver's: SIGTERM and SIGINT stop it cleanly (connections closed, the
control socket removed, exit 0); SIGHUP re-reads the secret file for a rotation, keeping every
page it holds (systemd's ``ExecReload``); without a secret file SIGHUP is ignored, so a reload
never kills a node and the pages it holds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from duvm.base import control_socket
from duvm.base.units import parse_size
from duvm.node.lifecycle import config

DEFAULT_CONFIG = Path("/etc/duvm/duvm.toml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"config file with a [node] table (e.g. {DEFAULT_CONFIG}); the "
        "flags below override its values",
    )
    parser.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="address the memserver listens on (port 0 picks a free port)",
    )
    parser.add_argument(
        "--capacity",
        metavar="SIZE",
        help="RAM lent to the pool, e.g. 4G (preallocated and locked at start)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="how long a disconnected client's pages are kept",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        metavar="PATH",
        help="cluster secret file (mode 0600); required off loopback",
    )
    parser.add_argument(
        "--control-socket",
        type=Path,
        metavar="PATH",
        help=f"local status socket, owner-only (default {config.DEFAULT_NODE_CONTROL_SOCKET})",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every connection")


def node_config(args: argparse.Namespace) -> config.NodeConfig:
    """The node's settings: the config file's [node] table, overridden by the flags."""
    if args.config is not None:
        node = config.load_node_config(args.config)
    elif args.listen is None or args.capacity is None:
        raise config.ControlError(
            "give --config FILE (with a [node] table), or --listen HOST:PORT and --capacity SIZE"
        )
    else:
        node = config.NodeConfig(listen=args.listen, capacity=0)
    if args.listen is not None:
        try:
            config.parse_listen(args.listen)
        except ValueError as exc:
            raise config.ControlError(f"--listen: {exc}") from None
        node.listen = args.listen
    if args.capacity is not None:
        try:
            node.capacity = parse_size(args.capacity)
        except ValueError as exc:
            raise config.ControlError(f"--capacity: {exc}") from None
    if args.lease is not None:
        if not 0 < args.lease < float("inf"):
            raise config.ControlError("--lease must be a positive number of seconds")
        node.lease = args.lease
    for key in ("secret_file", "control_socket", "metrics"):
        if getattr(args, key) is not None:
            setattr(node, key, getattr(args, key))
    return node


def memserver_args(node: config.NodeConfig, verbose: bool = False) -> argparse.Namespace:
    """`node` as `duvm memserver` arguments, parsed by the memserver's own parser."""
    from duvm.memserver import command as memserver

    parser = argparse.ArgumentParser(prog="duvm node", add_help=False, exit_on_error=False)
    memserver.add_arguments(parser)
    argv = node.memserver_argv() + (["--verbose"] if verbose else [])
    try:
        ns, extra = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:  # a bad value in memserver_args
        raise config.ControlError(f"memserver_args {node.memserver_args}: {exc}") from None
    if extra:
        raise config.ControlError(f"memserver_args: not memserver flags: {extra}")
    return ns


def check_control_socket(path: Path) -> None:
    """Make the socket's directory; refuse when a live node already answers there."""
    if path.exists():
        try:
            control_socket.query(str(path), timeout=1.0)
        except (OSError, ValueError):
            pass  # stale socket of a node that is gone: the memserver replaces it
        else:
            raise config.ControlError(
                f"a duvm node already answers on {path}: stop it first "
                "(systemctl stop duvm-node), or give --control-socket"
            )
    try:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        raise config.ControlError(f"cannot create {path.parent}: {exc.strerror or exc}") from None
    if not os.access(path.parent, os.W_OK):
        raise config.ControlError(
            f"cannot create the control socket in {path.parent}: not "
            "writable (run as root, or give --control-socket)"
        )


def run(args: argparse.Namespace) -> int:
    from duvm.memserver import command as memserver

    try:
        node = node_config(args)
        if node.capacity < 4096:
            raise config.ControlError("--capacity must be at least one page (4096 bytes)")
        ms_args = memserver_args(node, args.verbose)
        check_control_socket(node.control_socket)
    except config.ControlError as exc:
        print(f"duvm node: {exc}", file=sys.stderr)
        return 2
    if node.secret_file is None:
        # The memserver handles SIGHUP only to re-read a secret file; without one, a reload
        # (systemctl reload) must not kill it with every page it holds.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    print(
        f"duvm node: memserver on {node.listen}, {node.capacity >> 20} MiB, control socket "
        f"{node.control_socket}",
        flush=True,
    )
    return memserver.run(ms_args)
