"""``gputaskman replay FILE``: play a record file offline in the TUI (`replay_app`); the
frames and the clock are `playback`'s, which knows nothing of terminals. A fleet record
(``gputaskman fleet record``) is played one host at a time: ``--host NAME``."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from gputaskman.offline.playback import RecordSource
from gputaskman.offline.recordfile import fleet_hosts, is_fleet_file


def _speed(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return v


class _ScanProgress:
    """``reading: 42%`` on a terminal while a long file is scanned."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if self.out.isatty() and total:
            self.out.write(f"\rreading: {done * 100 // total}%")
            self.out.flush()
            self.shown = True

    def done(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="record file written by gputaskman record")
    p.add_argument(
        "--speed", type=_speed, default=1.0, metavar="X", help="playback speed (default 1)"
    )
    p.add_argument("--paused", action="store_true", help="start paused on the first snapshot")
    p.add_argument(
        "--host",
        metavar="NAME",
        help="in a fleet record (gputaskman fleet record): play this host's snapshots",
    )


def run(args: argparse.Namespace) -> int:
    progress = _ScanProgress(sys.stderr)
    try:
        source = RecordSource.open(args.file, progress=progress, host=args.host)
        # no frame without --host: a fleet record needs one (each line holds many hosts)
        hosts = (
            fleet_hosts(args.file)
            if args.host is None and not source.frames and is_fleet_file(args.file)
            else None
        )
    except OSError as exc:
        print(f"gputaskman replay: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    progress.done()
    if hosts is not None:
        print(
            f"gputaskman replay: {args.file} is a fleet record; name a host with --host "
            f"(hosts: {', '.join(hosts)})",
            file=sys.stderr,
        )
        return 2
    for line in source.report.lines():
        print(f"gputaskman replay: {line}", file=sys.stderr)
    if not source.frames:
        whose = f" of host {args.host}" if args.host else ""
        print(f"gputaskman replay: no snapshot{whose} to replay in {args.file}", file=sys.stderr)
        return 1
    if not sys.stdout.isatty():
        print(
            f"gputaskman replay: {len(source.frames)} snapshots in {args.file}; replay is "
            "interactive and needs a terminal (use 'gputaskman summary' for text)",
            file=sys.stderr,
        )
        return 2
    from gputaskman.tui.replay_app import create_replay_app

    app = create_replay_app(source, speed=args.speed, gpu=args.gpu, playing=not args.paused)
    app.run()
    return int(app.return_code or 0)
