"""`duvm status [--json]`: enabled or not, device and path, swap used, pages and health per peer,
and what this node lends when `duvm node` runs here (its control socket)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from duvm.node.attach import attach_state
from duvm.node.lifecycle import control
from duvm.node.lifecycle.config import DEFAULT_NODE_CONTROL_SOCKET


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=control.DEFAULT_STATE_DIR,
        help=f"as given to enable (default {control.DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--node-socket",
        type=Path,
        default=DEFAULT_NODE_CONTROL_SOCKET,
        metavar="PATH",
        help=f"control socket of `duvm node` (default {DEFAULT_NODE_CONTROL_SOCKET})",
    )


def run(args: argparse.Namespace) -> int:
    try:
        st = control.status(args.state_dir, args.node_socket)
    except (control.ControlError, attach_state.AttachError, OSError) as exc:
        print(f"duvm status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(st, indent=2) if args.json else control.format_status(st))
    return 0
