"""The `duvm` command: one subcommand per piece, and the commands that use every layer
(`duvm demo`, `duvm secret`, the demo's workload).

May import: any layer.

Each subcommand lives in its own module, which exports `add_arguments(parser)` and
`run(args) -> int`; this file only wires them, so pieces can grow without touching each other.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from duvm import __version__

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "memserver": (
        "duvm.memserver.command",
        "serve this node's spare RAM to the pool (page server)",
    ),
    "node": (
        "duvm.node.lifecycle.node_command",
        "run this node's memserver and control socket from the config file "
        "(the provider side; systemd: duvm-node.service)",
    ),
    "daemon": (
        "duvm.node.daemon.daemon",
        "NBD server for the local kernel; its blocks live on memservers",
    ),
    "enable": (
        "duvm.node.lifecycle.enable",
        "start the daemon, attach its device and swap to the pool (root)",
    ),
    "supervise": (
        "duvm.node.lifecycle.supervise",
        "restart a crashed daemon onto its live kernel nbd device (started by enable)",
    ),
    "disable": (
        "duvm.node.lifecycle.disable",
        "swapoff, detach, stop the daemon; refuses if pages can't go home",
    ),
    "status": (
        "duvm.node.lifecycle.status",
        "enabled or not, device, swap used, pages and health per peer",
    ),
    "doctor": (
        "duvm.node.doctor.doctor",
        "check this node's prerequisites and say how to fix each gap",
    ),
    "demo": ("duvm.cli.demo", "a whole pool on this machine: 3 memservers, a workload, verified"),
    "secret": ("duvm.cli.secret", "create, show and rotate the cluster secret file (0600)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `duvm` command line. With `only`, just that subcommand gets its arguments (its module
    is imported); the others are listed by name and help alone. Starting one command then
    imports only its own layers: the supervisor restarts the daemon under memory pressure, when
    every module read from disk costs time the kernel's held swap I/O is waiting for."""
    parser = argparse.ArgumentParser(
        prog="duvm",
        description="Pool RAM across a cluster: the kernel swaps cold pages to a duvm block "
        "device whose pages live in other nodes' RAM.",
    )
    parser.add_argument("--version", action="version", version=f"duvm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # duvm's own options (--help, --version) take no value: the first word is the command
    command = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(command if command in SUBCOMMANDS else "")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
