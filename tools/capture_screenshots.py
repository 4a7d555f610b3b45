#!/usr/bin/env python3
"""Render gputaskman's TUI to SVG from a recorded session, with command lines and paths
stripped, for the README.

Usage (from the repository root)::

    uv run python tools/capture_screenshots.py RECORD.jsonl [--frame N ...] [--out docs/screenshots]
    uv run python tools/capture_screenshots.py --demo  # gputaskman.fixtures.demo's made-up data
    uv run python tools/capture_screenshots.py --fleet FLEET.json [--label TEXT]  # fleet --json

Theory of operation
-------------------
A recording (``gputaskman record FILE``: one ``--json`` object per line) is first rewritten
through `redact`, line by line, into a temporary file: every ``cmdline`` becomes null and
every absolute path in any string becomes ``…/NAME`` for a file (``…`` for a directory-like
last part, which is often a user name), except kernel interfaces under /proc, /sys and /dev,
which are the same on every machine and name where a number came from. Lines that are not
JSON are dropped (the replay would skip them anyway). The redacted file is played by the real
replay TUI (`gputaskman.tui.replay_app`, the live app's screens fed from a file, never sampling a
GPU) in Textual's headless test driver at a fixed size; for each requested frame the app
shows that snapshot and `App.export_screenshot` writes the SVG. The header's subtitle, which
names the recording's path, is replaced by a fixed label, and local time is UTC, so a render
says nothing about the machine it was made on.

``--demo`` records `gputaskman.fixtures.demo`'s hand-written snapshot (synthetic, not measured; the
subtitle says so) for when no GPU recording is at hand. SVG only: GitHub renders it in a
README, and PNG would need a browser or cairo.

``--fleet FLEET.json`` renders the fleet TUI (`gputaskman.tui.fleet_app`) over a ``gputaskman
fleet --json`` document: redacted the same way (every host's snapshot), read back as host
states (`fleet.output.states_of`) and shown by a fixed source, never polling anything.
``--label`` says what the hosts were (the SVG's title).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "screenshots"
SIZE = (140, 42)
KEEP_PREFIXES = ("/proc/", "/sys/", "/dev/")
# An absolute path inside any text: "/" not preceded by a word character (so "MiB/s" and
# "1/2" are left alone), then one or more segments. A segment ends at whitespace, quotes,
# brackets, commas and at ":" that ends a word ("/x: denied"), not at one inside a name, and
# at "…", the mark a redacted path leaves ("//x" becomes "/…", which must stay as it is).
_SEG = r"(?:[^\s/'\"(),;:=\[\]{}<>|…]|:(?=[^\s/'\"(),;:=\[\]{}<>|…]))"
_PATH = re.compile(rf"(?<![\w.~…-])/{_SEG}+(?:/{_SEG}*)*")


def _redact_path(m: re.Match[str]) -> str:
    return redact_path(m.group(0))


def redact_path(path: str) -> str:
    """``…/NAME`` for a file, ``…`` for a directory-like last part; kernel paths kept."""
    if path.startswith(KEEP_PREFIXES):
        return path
    last = path.rstrip("/").rsplit("/", 1)[-1]
    # a file name says which model; a bare directory name is often a user or project name
    return f"…/{last}" if "." in last.strip(".") else "…"


def redact_text(text: str) -> str:
    return _PATH.sub(_redact_path, text)


def redact(obj: Any) -> Any:
    """A copy of a ``--json`` object with command lines and absolute paths stripped.

    A string value that is one path (it starts with "/" and has no line break: ``exe``,
    ``path``, model files) is redacted whole, spaces and all; in other text a path ends at
    whitespace, because there nothing says where a path with spaces would end."""
    if isinstance(obj, dict):
        return {k: (None if k == "cmdline" else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        if obj.startswith("/") and "\n" not in obj and not obj.startswith(KEEP_PREFIXES):
            return redact_path(obj)
        return redact_text(obj)
    return obj


def redact_record(src: Path, dst: Path) -> int:
    """Write the redacted lines of `src` to `dst`; returns how many snapshots were kept."""
    from gputaskman.offline.record import encode_line

    kept = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for raw in fin:
            try:
                doc = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(doc, dict):
                fout.write(encode_line(redact(doc)))
                kept += 1
    return kept


def demo_system(snapshot: Any) -> Any:
    """A host sample in host.py's own shape with `gputaskman.fixtures.demo.DemoSystem`'s figures
    (synthetic), so the replayed system panel and RAM/CPU columns look as they do live."""
    from types import MappingProxyType

    from gputaskman.base.readings import Reading
    from gputaskman.fixtures.demo import GIB, DemoSystem
    from gputaskman.sampling import host

    def r(v: float) -> Reading:
        return Reading.measured(v, "demo:synthetic")

    demo = DemoSystem()
    procs = {}
    for p in snapshot.processes:
        got = demo.process_readings(p.pid, p.create_time)
        if got:
            procs[p.pid] = host.ProcessUsage(
                p.pid,
                p.create_time,
                p.name,
                int(got["ram_bytes"].value),
                float(got["cpu_percent"].value),
            )
    total, avail = 32 * GIB, 20 * GIB
    return host.SystemInfo(
        taken=snapshot.taken,
        memory=host.MemoryInfo(
            r(total), r(avail), r(total - avail), r(8 * GIB), r(10 * GIB), r(GIB // 2), r(GIB)
        ),
        swap=host.SwapInfo(
            r(8 * GIB),
            r(8 * GIB),
            r(0),
            (host.SwapDevice("/dev/zram0", "partition", 8 * GIB, 0, 100),),
        ),
        cpu=host.CpuInfo(r(16), r(5.2), r(4.8), r(4.1), r(37.5)),
        processes=MappingProxyType(procs),
    )


def write_demo_record(path: Path, frames: int = 3) -> None:
    """A short recording of gputaskman.fixtures.demo's synthetic snapshot (not measured)."""
    import dataclasses

    from gputaskman.fixtures.demo import demo_snapshot
    from gputaskman.offline.record import encode_line
    from gputaskman.render import report

    base = demo_snapshot()
    with open(path, "wb") as f:
        for i in range(frames):
            snap = dataclasses.replace(base, taken=base.taken + i)
            system = dataclasses.replace(demo_system(snap), taken=snap.taken)
            doc = json.loads(json.dumps(report.to_json_dict(snap, system)))
            f.write(encode_line(doc))


async def _render(
    record: Path, out_dir: Path, frames: Iterable[int], label: str, size: tuple[int, int], stem: str
) -> list[Path]:
    from gputaskman.cli.replay import RecordSource
    from gputaskman.tui.replay_app import create_replay_app

    source = RecordSource.open(record)
    if not source.frames:
        raise SystemExit(f"capture_screenshots: no snapshot in {record}")
    count = len(source.frames)
    wanted = [f if f >= 0 else count + f for f in frames]
    bad = [f for f in wanted if not 0 <= f < count]
    if bad:
        raise SystemExit(f"capture_screenshots: frame(s) {bad} outside 0..{count - 1}")
    app = create_replay_app(source, playing=False)
    written = []
    async with app.run_test(size=size) as pilot:
        app.sub_title = label  # not the recording's path (the SVG title says it too)
        for i in wanted:
            app.playback.seek_index(i)
            app.show_frame()
            await pilot.pause()
            await pilot.pause(0.2)  # let the table and panels lay out
            path = out_dir / (f"{stem}.svg" if len(wanted) == 1 else f"{stem}-{i}.svg")
            path.write_text(app.export_screenshot(title=f"gputaskman · {label}"), encoding="utf-8")
            written.append(path)
    return written


def capture(
    record: Path | None,
    out_dir: Path,
    frames: list[int],
    *,
    demo: bool = False,
    size: tuple[int, int] = SIZE,
    stem: str = "gputaskman",
) -> list[Path]:
    """Redact `record` (or record the demo), render `frames` to SVG files in `out_dir`."""
    os.environ["TZ"] = "UTC"  # the status line shows the snapshot's time
    time.tzset()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gtm-shots-") as tmp:
        clean = Path(tmp) / "session.jsonl"
        if demo:
            raw = Path(tmp) / "demo.jsonl"
            write_demo_record(raw)
            label = "synthetic demo data (not measured)"
        else:
            assert record is not None
            raw, label = record, "recorded session"
        if redact_record(raw, clean) == 0:
            raise SystemExit(f"capture_screenshots: no JSON snapshot in {raw}")
        return asyncio.run(_render(clean, out_dir, frames, label, size, stem))


async def _render_fleet(doc: Any, path: Path, label: str, size: tuple[int, int]) -> Path:
    from gputaskman.fleet.output import states_of
    from gputaskman.fleet.source import FixedSource
    from gputaskman.tui.fleet_app import FleetApp

    app = FleetApp(
        FixedSource(
            states_of(doc),
            interval=float(doc.get("interval_s") or 1.0),
            timeout=float(doc.get("timeout_s") or 2.0),
        )
    )
    async with app.run_test(size=size) as pilot:
        app.sub_title = label
        for _ in range(5):
            await pilot.pause()
        await pilot.pause(0.2)
        path.write_text(
            app.export_screenshot(title=f"gputaskman fleet · {label}"), encoding="utf-8"
        )
    return path


def capture_fleet(
    fleet: Path,
    out_dir: Path,
    label: str,
    size: tuple[int, int] = SIZE,
    stem: str = "gputaskman-fleet",
) -> Path:
    """Redact a ``fleet --json`` document and render the fleet TUI over it to one SVG."""
    os.environ["TZ"] = "UTC"
    time.tzset()
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = redact(json.loads(fleet.read_text(encoding="utf-8")))
    return asyncio.run(_render_fleet(doc, out_dir / f"{stem}.svg", label, size))


def _size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or not (40 <= int(m[1]) <= 400 and 10 <= int(m[2]) <= 200):
        raise argparse.ArgumentTypeError(f"size must be COLSxROWS, e.g. 140x42: {text!r}")
    return int(m[1]), int(m[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("record", nargs="?", type=Path, help="record file (gputaskman record)")
    src.add_argument("--demo", action="store_true", help="render gputaskman.fixtures.demo's data")
    src.add_argument("--fleet", type=Path, help="render the fleet TUI over a fleet --json file")
    p.add_argument("--label", default="saved fleet", help="--fleet: what the hosts were")
    p.add_argument(
        "--frame",
        type=int,
        action="append",
        metavar="N",
        help="snapshot index to render (negative: from the end; default -1)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--size", type=_size, default=SIZE, metavar="COLSxROWS")
    p.add_argument("--name", default=None, help="file name stem (default gputaskman[-demo])")
    args = p.parse_args(argv)
    if args.record is not None and not args.record.is_file():
        print(f"capture_screenshots: {args.record} is not a file", file=sys.stderr)
        return 2
    if args.fleet is not None:
        print(
            capture_fleet(
                args.fleet, args.out, args.label, args.size, args.name or "gputaskman-fleet"
            )
        )
        return 0
    stem = args.name or ("gputaskman-demo" if args.demo else "gputaskman")
    for path in capture(
        args.record, args.out, args.frame or [-1], demo=args.demo, size=args.size, stem=stem
    ):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
