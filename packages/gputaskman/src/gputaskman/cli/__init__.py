"""The `gputaskman` / `gtm` command, and the subcommands that span layers (`serve`, `replay`).

May import: any layer.

Without a subcommand it runs the TUI (or, when stdout is not a terminal, prints the
``--once`` report). ``--once`` prints a text report, ``--json`` the JSON object of
`report.to_json_dict`, ``--list-gpus`` the adapters this platform's backend enumerates
(`registry.gpu_source`: NVML + DRM (+ Ascend) on Linux, DXGI/PDH (+ TCC) on
Windows, NVML + host counters under WSL, IOKit on macOS), followed by one line per probe
that found nothing, failed or answered only in part, so an empty successful probe never
looks like a failed one. ``--json --compact`` prints the object on one line, exactly as
``record`` writes it, so ``>> FILE`` builds a record file. ``--watch`` (`watch`) prints a
compact per-GPU report every interval. One-shot output scans every process
(``scan_budget=None``); the TUI and ``--watch`` spread scans across refreshes.
``--no-color`` (or a non-empty ``NO_COLOR``) turns colour off everywhere; the text outputs
carry none in any case.

Subcommands (record, replay, diff, summary, ...) plug in through `SUBCOMMANDS`: each
module exports ``add_arguments(parser)`` and ``run(args) -> int``, so adding one never
touches the flags above. On a machine with no GPU, driver or NVML every mode says so and
why, still shows the system panel, and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from gputaskman import __version__
from gputaskman.base.argtypes import gpu_index, positive_count, positive_seconds

if TYPE_CHECKING:
    from gputaskman.base.gpusource import GpuSource
    from gputaskman.base.readings import Snapshot
    from gputaskman.sampling.collector import Collector
    from gputaskman.tui.app import GtmApp

# subcommand -> (module, one-line help); the module exports add_arguments() and run().
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "record": (
        "gputaskman.offline.record",
        "append one --json snapshot per interval to a record file",
    ),
    "summary": ("gputaskman.offline.summary", "averages and peaks per run of a record file"),
    "diff": ("gputaskman.offline.diff_report", "compare two saved --json snapshots"),
    "replay": ("gputaskman.cli.replay", "play a record file in the TUI (offline, never samples)"),
    "serve": (
        "gputaskman.cli.serve",
        "serve Prometheus metrics and the snapshot document (sampled like the TUI)",
    ),
    "fleet": ("gputaskman.cli.fleet", "every host's gputaskman serve in one view (TUI, --json)"),
}

NO_COLOR_HELP = (
    "no colour in the TUI (monochrome) or any output; the NO_COLOR environment variable, "
    "set to any non-empty value, does the same"
)

# How long one-shot output waits between the priming host sample and the real one, so
# CPU% (a rate) has two samples. Short enough not to be noticed.
CPU_RATE_WINDOW_S = 0.25


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gputaskman",
        description="What is inside GPU memory: per-process VRAM, engine load, runtimes and "
        "models, with the provenance of every number (measured, inferred, estimated, "
        "runtime-reported). Runs the TUI unless told otherwise.",
    )
    parser.add_argument("--version", action="version", version=f"gputaskman {__version__}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one text report and exit")
    mode.add_argument("--json", action="store_true", help="print one JSON snapshot and exit")
    mode.add_argument("--list-gpus", action="store_true", help="list GPUs and exit")
    mode.add_argument(
        "--watch",
        action="store_true",
        help="print one line per GPU and its top processes every --interval seconds, like "
        "gpustat --watch (redrawn on a terminal, appended into a pipe); Ctrl-C stops",
    )
    parser.add_argument(
        "--compact",
        action="store_true",
        help="with --json: one line, so `>> FILE` builds a record file for summary, diff "
        "and replay",
    )
    parser.add_argument("--gpu", type=gpu_index, metavar="N", help="select GPU N (index)")
    parser.add_argument(
        "--interval",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="TUI and --watch refresh interval in seconds (default 1.0; a value given here "
        "is kept in the TUI's settings for next time)",
    )
    parser.add_argument("--no-color", action="store_true", help=NO_COLOR_HELP)
    # Hidden: --watch stops after N samples (tests, scripts that want a bounded run). Its
    # own dest, since `record --count` fills the same namespace.
    parser.add_argument(
        "--count", dest="watch_count", type=positive_count, metavar="N", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--readonly",
        action="store_true",
        help="TUI: no key acts on a process (k, which signals the highlighted one, is removed)",
    )
    # Hidden: read /sys and /proc below DIR instead of the machine's (a fixture tree from
    # `python -m gputaskman.fixtures.drm_fixtures DIR`); NVML is not asked. For demos and tests.
    parser.add_argument("--sysroot", metavar="DIR", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        # also after the subcommand; SUPPRESS keeps a --no-color given before it
        p.add_argument(
            "--no-color", action="store_true", default=argparse.SUPPRESS, help=NO_COLOR_HELP
        )
        p.set_defaults(_module=module)
    return parser


def _one_shot(args: argparse.Namespace) -> int:
    from gputaskman.render import report, text_report

    collector = _collector(args, scan_budget=None)
    try:
        collector.prime()
        time.sleep(CPU_RATE_WINDOW_S)
        snap, system = collector.sample_with_system()
    finally:
        collector.close()
    rc = _check_gpu_index(snap, args.gpu)
    if args.json:
        doc = report.to_json_dict(snap, system, selected_gpu=args.gpu)
        if args.compact:  # exactly a record line, so `>> FILE` builds a record file
            from gputaskman.offline.record import encode_line

            sys.stdout.write(encode_line(doc).decode("ascii"))
        else:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(text_report.render_text(snap, system, selected_gpu=args.gpu))
    return rc


def _collector(args: argparse.Namespace, scan_budget: float | None) -> Collector:
    """The real collector, or one reading the tree under ``--sysroot``."""
    from gputaskman.sampling.collector import Collector, sysroot_collector

    if args.sysroot:
        if not os.path.isdir(args.sysroot):
            raise SystemExit(f"gputaskman: --sysroot {args.sysroot}: not a directory")
        return sysroot_collector(args.sysroot, args.gpu, scan_budget)
    return Collector(gpu=args.gpu, scan_budget=scan_budget)


def _check_gpu_index(snap: Snapshot, gpu: int | None) -> int:
    """Exit code for `--gpu N`: 2 when NVML works and lists no GPU N (a usage error);
    0 when there is no backend at all (the report already says why)."""
    if gpu is None or not snap.available:
        return 0
    if any(a.index == gpu for a in snap.adapters):
        return 0
    count = len(snap.adapters)
    print(f"gputaskman: no GPU {gpu}; NVML lists {count} GPU(s)", file=sys.stderr)
    return 2


def _list_gpus(args: argparse.Namespace, source: GpuSource | None = None) -> int:
    """Print the adapters, then a line for every probe that is not a plain success.

    `source` replaces `registry.gpu_source()` (tests pass a mocked backend).
    """
    from gputaskman.backends import registry
    from gputaskman.render import report, text_report

    if source is None and args.sysroot:
        if not os.path.isdir(args.sysroot):
            raise SystemExit(f"gputaskman: --sysroot {args.sysroot}: not a directory")
        source = registry.sysroot_gpu_source(args.sysroot)
    src = source if source is not None else registry.gpu_source()
    try:
        s = src.sample()
    finally:
        src.close()
    for a in s.adapters:
        m = s.metrics.get(a.pci_bus_id)
        total = report.fmt_reading(m.memory_total_bytes, as_bytes=True, reason=True) if m else "n/a"
        print(
            f"{a.index}  {a.name or 'n/a'}  {a.pci_bus_id}  {a.uuid or 'n/a'}  {total}"
            f"  [{a.backend}]"
        )
    # A failed probe is not an empty list: each probe says which it was, and why. The
    # sample's parts are its sources' own probes (NVML's beside DRM, TCC's, Ascend's).
    for pr in s.probes:
        if pr.status != "ok" or pr.partial:
            print(pr.line())
    for p in s.problems:
        if p is not s.backend_problem:
            print("problem: " + text_report.describe_problem(p))
    for note in s.notes:
        print("note: " + note)
    return 0


def _watch(args: argparse.Namespace) -> int:
    from gputaskman.cli.watch import watch
    from gputaskman.sampling.collector import SCAN_BUDGET

    collector = _collector(args, SCAN_BUDGET)
    try:
        return watch(
            collector,
            sys.stdout,
            interval=args.interval or 1.0,
            count=args.watch_count,
            selected_gpu=args.gpu,
            terminal=sys.stdout.isatty(),
        )
    except BrokenPipeError:  # the reader went away (`| head`): done, quietly
        # Python flushes stdout once more at exit; point it at /dev/null so that flush
        # cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def apply_color_choice(no_color: bool, environ: MutableMapping[str, str]) -> None:
    """--no-color sets NO_COLOR, which Textual reads when an app is created. no-color.org
    counts only a non-empty NO_COLOR, while Textual takes an empty one as set too: an empty
    one is dropped so that colour stays on."""
    if no_color:
        environ["NO_COLOR"] = "1"
    elif environ.get("NO_COLOR") == "":
        del environ["NO_COLOR"]


def tui_app(args: argparse.Namespace) -> GtmApp:
    """The TUI for these arguments (real collector, or the tree under --sysroot)."""
    from gputaskman.tui.app import create_app

    factory = None
    if args.sysroot:
        from gputaskman.sampling.collector import SCAN_BUDGET

        def factory() -> Any:
            return _collector(args, SCAN_BUDGET)

    from gputaskman.tui.settings import default_path

    return create_app(
        gpu=args.gpu,
        interval=args.interval,
        collector_factory=factory,
        readonly=args.readonly,
        settings_path=default_path(),
    )


def run_app(app: GtmApp) -> None:
    """Run `app` in this terminal until it exits."""
    app.run()


def _tui(args: argparse.Namespace, run: Callable[[GtmApp], object] = run_app) -> int:
    """Build the TUI for `args` (`tui_app`), run it and return its exit code; `run` runs the
    built app (tests pass one that keeps the app instead of taking the terminal)."""
    app = tui_app(args)
    run(app)
    return int(app.return_code or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compact and not args.json:
        parser.error("--compact needs --json (it prints the JSON snapshot on one line)")
    if args.watch_count is not None and not args.watch:
        parser.error("--count needs --watch")
    apply_color_choice(args.no_color, os.environ)
    if args.command:
        return int(args._module.run(args) or 0)
    if args.list_gpus:
        return _list_gpus(args)
    if args.watch:
        return _watch(args)
    if args.once or args.json:
        return _one_shot(args)
    if not sys.stdout.isatty():
        print("gputaskman: stdout is not a terminal; printing the --once report", file=sys.stderr)
        args.once = True
        return _one_shot(args)
    return _tui(args)


if __name__ == "__main__":
    sys.exit(main())
