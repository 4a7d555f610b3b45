"""`duvm disable`: swapoff first (refusing with a reason if pages cannot come home), then detach
and stop the daemon, which releases the reservations on the peers (root)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from duvm.node.attach import attach_state
from duvm.node.lifecycle import control


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=control.DEFAULT_STATE_DIR,
        help=f"as given to enable (default {control.DEFAULT_STATE_DIR})",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="skip the check that swapoff would not OOM-kill memory-limited "
        "cgroups (swapoff itself still refuses when RAM is short)",
    )


def run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    try:
        was = control.disable(args.state_dir, force=args.force, notes=notes)
    except attach_state.SwapoffFailed as exc:
        print(f"duvm disable: {exc}", file=sys.stderr)
        return 3
    except (control.ControlError, attach_state.AttachError) as exc:
        print(f"duvm disable: {exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"duvm disable: {note}", file=sys.stderr)
    print("duvm disabled" if was else "duvm was not enabled")
    return 0
