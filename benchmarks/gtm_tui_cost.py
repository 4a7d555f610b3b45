"""Cost of the gputaskman TUI itself at 1 Hz with N processes: CPU per second, first paint.

Usage::

    uv run python benchmarks/gtm_tui_cost.py                 # 1,000 processes, 30 s, 2 starts
    uv run python benchmarks/gtm_tui_cost.py -n 200 --seconds 10 --starts 3
    uv run python benchmarks/gtm_tui_cost.py --fleet 200 2000 --against HEAD  # the fleet table

What it does
------------
1. Starts the real TUI (`gputaskman.tui.app.create_app`, Textual's own terminal driver, the
   table, header, inspector and system panel) in a child Python on a pseudo-terminal of
   ``--size`` (default 160x45), refreshing every second. Its collector is a fake that
   returns a made-up snapshot (not measured) of N GPU processes spread over the demo's two
   GPUs, each with RAM and CPU%, one with a model; four variants whose VRAM, RAM and CPU%
   differ are served in turn, so every refresh changes rows the way a live machine does.
   So the figures are the TUI's own cost; the collector's (the host sampler's /proc pass,
   about 20 ms per refresh with 1,000 processes, see the README's cost table and
   ``gtm_refresh.py``) comes on top of them.
2. The parent reads the terminal as a terminal would and notes the first paint: the time
   from the child's start until both the footer (``quit``) and the first row of data (the
   largest process, ``bench-top``) have been written to it.
3. After ``--settle`` seconds it reads the child's CPU time (user + system, psutil) over
   ``--seconds`` of wall time: CPU % of one core, with the bytes written to the terminal.
4. Does that ``--starts`` times: the first start is the cold one, the later ones warm
   (bytecode and files cached). Targets: warm first paint under 1 s, CPU under 3 %.
5. Quits each child with ``q`` (killed if it has not gone after 10 s), also on error.

Peers (nvitop, nvtop, gpustat) read NVIDIA's driver (nvtop also AMD/Intel DRM devices) and
the real process list; none can be handed 1,000 made-up GPU processes, and on a machine
without a GPU they have nothing to show, so there is no side-by-side figure here.

The machine is shared (other work running), so every figure is wall time or CPU time of
the child on this machine, with the load average printed beside it.

Fleet table (``--fleet N ...``)
-------------------------------
The fleet TUI's table (`tui.widgets.fleet_table.FleetTable`) refreshed in this process, in a
headless Textual app of ``--size``: N made-up rows (not measured), N/2 hosts of the demo's
two GPUs (every 25th host unreachable: one row with its reason instead), whose GPU memory
used differs between four variants shown in turn, so every refresh changes every row's
numbers. Per refresh: ``show(rows, width)``'s own wall time, and the process's CPU time from
before ``show`` until the screen has been drawn (Textual's compositor asks the table for the
lines on screen): medians over ``--rounds`` rounds of ``--refreshes`` refreshes (each round a
new app, after two warm-up refreshes), with the rows built per refresh where the table counts
them (`rows_built`). Making the rows (`fleet.view.fleet_rows`, the fleet screen's part of a
refresh) is outside both figures and printed apart. With ``--against REF`` REF's
fleet_table.py (``git show``, loaded as a module beside the working tree's) is measured too,
its rounds alternating with the working tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import fcntl
import json
import os
import pstats
import pty
import select
import signal
import statistics
import struct
import subprocess
import sys
import termios
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputaskman.base.readings import ModelRef, ProcDetail, ProcGpu, Reading, Snapshot
from gputaskman.fixtures.demo import BUS0, BUS1, DemoSystem, demo_snapshot

MIB = 1024**2
ROOT = Path(__file__).resolve().parents[1]
FLEET_TABLE = "packages/gputaskman/src/gputaskman/tui/widgets/fleet_table.py"
VARIANTS = 4  # snapshots served in turn, so consecutive refreshes differ
TOP_NAME = "bench-top"  # the process with the most VRAM: the first row once data is painted
FOOTER_TEXT = b"quit"  # in the footer of every frame


class BenchSystem(DemoSystem):
    """The demo's host sample, with RAM and CPU% for every benchmark process."""

    def __init__(self, variant: int) -> None:
        self.variant = variant

    def process_readings(self, pid: int, create_time: float | None) -> Mapping[str, Reading]:
        return {
            "ram_bytes": Reading.measured((pid % 97 + self.variant) * MIB, "procfs"),
            "cpu_percent": Reading.measured(float((pid + self.variant) % 13), "procfs"),
        }


def bench_snapshot(n: int, variant: int) -> Snapshot:
    """N GPU processes on the demo's GPUs; VRAM moves by a few MiB between variants."""
    base = demo_snapshot()
    procs = []
    for i in range(n):
        pid = 100_000 + i
        top = i == 0
        procs.append(
            ProcGpu(
                pid,
                base.taken - 60 - i,
                TOP_NAME if top else f"worker-{i}",
                BUS1 if i % 3 == 1 else BUS0,  # the top one on GPU 0, shown first
                ("compute",),
                Reading.measured(
                    (8192 if top else 64 + (i * 7 + variant * 3) % 900) * MIB,
                    "nvml:nvmlDeviceGetComputeRunningProcesses",
                ),
                detail=ProcDetail(
                    cmdline=("python", "-m", "serve", "--port", str(8000 + i)),
                    runtimes=("CUDA runtime", "PyTorch"),
                    category="inference",
                    scanned=True,
                ),
                model=ModelRef("qwen2.5-7b-q4_k_m", "mapped", False, "/models/q.gguf")
                if top
                else None,
            )
        )
    return dataclasses.replace(base, processes=tuple(procs))


class FakeCollector:
    """Serves the variants in turn with the current time; builds nothing per sample."""

    def __init__(self, n: int) -> None:
        self.samples = [(bench_snapshot(n, v), BenchSystem(v)) for v in range(VARIANTS)]
        self.calls = 0

    def sample_with_system(self) -> tuple[Snapshot, BenchSystem]:
        snap, system = self.samples[self.calls % VARIANTS]
        self.calls += 1
        return dataclasses.replace(snap, taken=time.time()), system

    def rescan(self, pid: int, create_time: float | None) -> None:
        return None  # made-up processes: nothing to scan

    def close(self) -> None:
        pass


def child(n: int, profile: str | None) -> int:
    """The TUI under test (run by the parent on a pseudo-terminal); with `profile`, the
    main thread (Textual's event loop: layout, rendering, the table) is profiled into it."""
    from gputaskman.tui.app import create_app

    fake = FakeCollector(n)
    app = create_app(collector_factory=lambda: fake, interval=1.0)
    if profile is None:
        app.run()
        return 0
    prof = cProfile.Profile()
    prof.runcall(app.run)
    prof.dump_stats(profile)
    return 0


@dataclass
class StartResult:
    first_paint_s: float | None
    cpu_percent: float | None
    wall_s: float
    terminal_bytes_per_s: float | None


class Terminal:
    """A pseudo-terminal of cols x rows whose output is drained and searched."""

    def __init__(self, cols: int, rows: int) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.tail = b""  # the last bytes read, so a marker split across reads is still found
        self.bytes = 0

    def drain(self, timeout: float) -> bytes:
        """What arrived within `timeout` seconds (b"" when nothing did)."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return b""
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            return b""
        self.bytes += len(data)
        window = self.tail + data
        self.tail = window[-64:]
        return window

    def close(self) -> None:
        os.close(self.master)


def one_start(args: argparse.Namespace) -> StartResult:
    import psutil  # the parent's only: the child (the TUI) must not pay for its import

    cols, rows = args.size
    term = Terminal(cols, rows)
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "-n", str(args.n)]
        + (["--profile", args.profile] if args.profile else []),
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env=env,
        start_new_session=True,
    )
    os.close(term.slave)
    seen: set[bytes] = set()
    try:
        deadline = t0 + args.timeout
        while len(seen) < 2 and time.perf_counter() < deadline:
            window = term.drain(0.05)
            seen.update(m for m in (FOOTER_TEXT, TOP_NAME.encode()) if m in window)
            if proc.poll() is not None:
                raise RuntimeError(f"the TUI exited early (status {proc.returncode})")
        if len(seen) < 2:
            return StartResult(None, None, 0.0, None)
        first_paint = time.perf_counter() - t0
        settle_end = time.perf_counter() + args.settle
        while time.perf_counter() < settle_end:
            term.drain(0.05)
        ps = psutil.Process(proc.pid)
        c0, w0, b0 = ps.cpu_times(), time.perf_counter(), term.bytes
        end = w0 + args.seconds
        while time.perf_counter() < end:
            term.drain(0.05)
        c1, w1, b1 = ps.cpu_times(), time.perf_counter(), term.bytes
        wall = w1 - w0
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        os.write(term.master, b"q")
        quit_end = time.perf_counter() + 10
        while proc.poll() is None and time.perf_counter() < quit_end:
            term.drain(0.05)
        return StartResult(first_paint, 100 * cpu / wall, wall, (b1 - b0) / wall)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        term.close()


# ---------------------------------------------------------------------------- fleet table


def fleet_variants(n: int) -> list[list[Any]]:
    """`VARIANTS` lists of about `n` fleet rows (see the module docstring)."""
    from gputaskman.document.fleetdoc import HostStatus
    from gputaskman.document.reader import read_document
    from gputaskman.fleet.poller import HostState
    from gputaskman.fleet.targets import parse_target
    from gputaskman.fleet.view import fleet_rows
    from gputaskman.render import report

    doc = read_document(json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem()))))
    out = []
    for v in range(VARIANTS):
        states = []
        for h in range(n // 2 + n // 50 + 1):  # enough hosts for n rows, cut to n below
            target = dataclasses.replace(parse_target(f"node-{h:05d}"), name=f"node-{h:05d}")
            if h % 25 == 24:
                states.append(HostState(target, HostStatus.UNREACHABLE, "connection refused"))
                continue
            adapters = tuple(
                dataclasses.replace(
                    a,
                    metrics=dataclasses.replace(
                        a.metrics,
                        memory_used_bytes=Reading.measured(
                            (h * 37 + g * 11 + v * 5) % 97 * 160 * MIB, "bench"
                        ),
                    ),
                )
                if a.metrics is not None
                else a
                for g, a in enumerate(doc.adapters)
            )
            answer = dataclasses.replace(doc, adapters=adapters)
            states.append(HostState(target, HostStatus.UP, None, answer, seq=v + 1))
        out.append(fleet_rows(states)[:n])
    return out


def table_class(ref: str | None) -> type:
    """The working tree's FleetTable, or `ref`'s (its file from ``git show``, as a module)."""
    if ref is None:
        from gputaskman.tui.widgets.fleet_table import FleetTable

        return FleetTable
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:{FLEET_TABLE}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"fleet_table_at_{ref}")
    sys.modules[module.__name__] = module
    exec(compile(text, f"{ref}:{FLEET_TABLE}", "exec"), module.__dict__)
    return module.FleetTable


async def fleet_refreshes(
    cls: type, variants: list[list[Any]], size: tuple[int, int], refreshes: int
) -> tuple[list[float], list[float], list[int]]:
    """`refreshes` refreshes of a `cls` table: show's wall time and show-to-drawn CPU time
    (seconds), and rows built per refresh where the table counts them (`rows_built`)."""
    from textual.app import App, ComposeResult

    class Bench(App[None]):
        def compose(self) -> ComposeResult:
            yield cls()

    shown, cpu, built = [], [], []
    app = Bench()
    async with app.run_test(size=size) as pilot:
        table = app.query_one(cls)
        table.focus()
        for i in range(refreshes + 2):
            rows = variants[i % len(variants)]
            c0, w0 = time.process_time(), time.perf_counter()
            table.show(rows, app.size.width)
            w1 = time.perf_counter()
            await pilot.pause()  # ends with the screen drawn
            c1 = time.process_time()
            if i >= 2:  # two warm-ups
                shown.append(w1 - w0)
                cpu.append(c1 - c0)
                if hasattr(table, "rows_built"):
                    built.append(table.rows_built)
    return shown, cpu, built


def fleet_main(args: argparse.Namespace) -> int:
    tables = [("working tree", table_class(None))]
    if args.against:
        tables.append((args.against, table_class(args.against)))
    cols, rows = args.size
    print(
        f"fleet table refresh, {cols}x{rows} headless, {args.refreshes} refreshes a round, "
        f"{args.rounds} round(s); {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  {'rows':>6}  {'table':<14} {'show() median':>14} {'show+draw CPU median':>21}"
        f" {'rows built':>11}"
    )
    for n in args.fleet:
        t0 = time.perf_counter()
        variants = fleet_variants(n)
        made = (time.perf_counter() - t0) / VARIANTS
        results: dict[str, tuple[list[float], list[float], list[int]]] = {
            name: ([], [], []) for name, _ in tables
        }
        for _ in range(args.rounds):
            for name, cls in tables:
                got = asyncio.run(fleet_refreshes(cls, variants, args.size, args.refreshes))
                for into, part in zip(results[name], got, strict=True):
                    into.extend(part)  # type: ignore[arg-type]
        for name, (shown, cpu, built) in results.items():
            nb = f"{statistics.median(built):.0f}" if built else "all"
            print(
                f"  {len(variants[0]):>6}  {name:<14} {statistics.median(shown) * 1e3:>11.1f} ms"
                f" {statistics.median(cpu) * 1e3:>18.1f} ms {nb:>11}"
            )
        print(f"  {'':>6}  (making the rows, fleet_rows, outside these: {made * 1e3:.1f} ms)")
    print(f"  load {os.getloadavg()[0]:.2f}")
    return 0


def _size(text: str) -> tuple[int, int]:
    cols, _, rows = text.partition("x")
    return int(cols), int(rows)


def _fmt(v: float | None, unit: str, scale: float = 1.0) -> str:
    return "n/a" if v is None else f"{v * scale:.2f} {unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=1000, help="GPU processes in the snapshot")
    ap.add_argument("--seconds", type=float, default=30.0, help="CPU measuring window")
    ap.add_argument("--settle", type=float, default=3.0, help="wait after the first data paint")
    ap.add_argument("--starts", type=int, default=2, help="starts (the first is cold)")
    ap.add_argument("--size", type=_size, default=(160, 45), help="terminal COLSxROWS")
    ap.add_argument("--timeout", type=float, default=60.0, help="give up on a first paint")
    ap.add_argument(
        "--profile", metavar="FILE", help="cProfile the (last) TUI start into FILE, print its top"
    )
    ap.add_argument(
        "--fleet", type=int, nargs="+", metavar="N", help="the fleet table with N rows instead"
    )
    ap.add_argument("--against", metavar="REF", help="--fleet: REF's fleet table too (git)")
    ap.add_argument("--refreshes", type=int, default=15, help="--fleet: refreshes a round")
    ap.add_argument("--rounds", type=int, default=2, help="--fleet: rounds of each table")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.n, args.profile)
    if args.fleet:
        return fleet_main(args)
    cols, rows = args.size
    print(
        f"gputaskman TUI at 1 Hz, {args.n} processes, {cols}x{rows} pseudo-terminal; "
        f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  {'start':<6} {'first paint':>12} {'CPU of one core':>16} {'to terminal':>14}"
        f"  (over {args.seconds:.0f} s)"
    )
    for i in range(args.starts):
        r = one_start(args)
        label = "cold" if i == 0 else "warm"
        print(
            f"  {label:<6} {_fmt(r.first_paint_s, 's'):>12} {_fmt(r.cpu_percent, '%'):>16} "
            f"{_fmt(r.terminal_bytes_per_s, 'KB/s', 1e-3):>14}  load {os.getloadavg()[0]:.2f}"
        )
    if args.profile:  # profiling slows the child: its CPU figure above is not the real one
        print(f"\nprofile of the last start (main thread, by own time): {args.profile}")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
