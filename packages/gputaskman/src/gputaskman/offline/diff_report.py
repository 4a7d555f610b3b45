"""`gputaskman diff`: the command, and its text form of the comparison `diff.diff` returns
(sections of measured, runtime-reported, estimated and inferred changes per GPU and per
process). The comparison itself is `diff`'s, which knows nothing of terminals. Fleet files
(``fleet --json``, ``fleet record``) are compared per host: ``--host NAME``, or a section
for each host both files name."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gputaskman.document.reader import Document, read_document
from gputaskman.offline.diff import (
    EXIT_BAD_INPUT,
    EXIT_REFUSED,
    SECTION_TITLES,
    SECTIONS,
    Refused,
    Value,
    diff,
)
from gputaskman.offline.recordfile import (
    SnapshotError,
    fleet_hosts,
    is_fleet_file,
    load_snapshot_arg,
)
from gputaskman.render import report

FIELD_LABELS = {
    "memory_used_bytes": "memory used",
    "memory_total_bytes": "memory total",
    "memory_reserved_bytes": "memory reserved",
    "attributed_bytes": "attributed to processes",
}
SYSTEM_LABELS = {
    "memory.total_bytes": "RAM total",
    "memory.used_bytes": "RAM used",
    "memory.available_bytes": "RAM available",
    "memory.free_bytes": "RAM free",
    "memory.cached_bytes": "RAM cached",
    "memory.buffers_bytes": "RAM buffers",
    "memory.shared_bytes": "RAM shared",
    "swap.total_bytes": "swap total",
    "swap.used_bytes": "swap used",
    "swap.free_bytes": "swap free",
}
CHANGE_NOTES = {
    "not listed before": "new (not listed before)",
    "not listed after": "gone (not listed after)",
}


def _fmt(v: Value | None, listed: bool) -> str:
    if not listed:
        return "not listed"
    if v is None:
        return "not recorded"
    if v.value is None:
        return f"n/a ({v.reason})"
    mark = report.KIND_MARK.get(report.Kind(v.kind), "") if v.kind in SECTIONS else ""
    return mark + report.fmt_bytes(v.value)


def _change_text(f: Mapping[str, Any]) -> str:
    if f["change"] == "changed":
        d = f["delta"]
        return ("+" if d > 0 else "-") + report.fmt_bytes(abs(d))
    return CHANGE_NOTES.get(f["change"], f["change"])


def _field_row(label: str, f: Mapping[str, Any]) -> tuple[str, str, str]:
    b = None if f["before"] is None else Value(**f["before"])
    a = None if f["after"] is None else Value(**f["after"])
    return (
        label,
        f"{_fmt(b, f['change'] != 'not listed before')} -> "
        f"{_fmt(a, f['change'] != 'not listed after')}",
        _change_text(f),
    )


def _gpu_name(entry: Mapping[str, Any]) -> str:
    a = entry["after"] or entry["before"]
    return f"GPU {a.get('index')} {a.get('name') or 'n/a'} [{a.get('pci_bus_id') or 'no address'}]"


def _table(rows: list[tuple[str, str, str]], indent: str) -> list[str]:
    if not rows:
        return []
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return [f"{indent}{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}".rstrip() for r in rows]


def _proc_label(p: Mapping[str, Any], gpu_index: Mapping[str | None, str]) -> str:
    side = p["after"] or p["before"]
    gpu = gpu_index.get(side["gpu"], side["gpu"] or "none")
    return f"{p['pid']} {p['name'] or 'n/a'} (GPU {gpu})"


def _vram_was(p: Mapping[str, Any]) -> str:
    """A process that came or went, in one cell: its measured VRAM on the side it is on."""
    for f in p["fields"]:
        if f["field"] == "vram_bytes":
            side = f["before"] if f["before"] is not None else f["after"]
            return f"VRAM {_fmt(Value(**side), True)}" if side is not None else "VRAM not recorded"
    return "no VRAM recorded"


def render_text(d: Mapping[str, Any], before_path: str, after_path: str) -> str:
    out = ["gputaskman diff"]
    for side, path in (("before", before_path), ("after", after_path)):
        s = d[side]
        out.append(f"  {side:<6} {path}  {s['taken_iso'] or s['taken']}  backend {s['backend']}")
    if d["elapsed_s"] is not None:
        out[-1] += f"  ({d['elapsed_s']:+.1f} s)"
    for w in d["warnings"]:
        out.append(f"WARNING {w['code']}: {w['message']}")
    gpu_index: dict[str | None, str] = {}
    for e in d["adapters"]:
        for side in ("before", "after"):
            if e[side] is not None:
                gpu_index[e[side]["pci_bus_id"]] = str(e[side]["index"])
    unchanged = unknown = 0
    for section in SECTIONS:
        blocks: list[str] = []
        for e in d["adapters"]:
            rows = [
                _field_row(FIELD_LABELS.get(f["field"], f["field"]), f)
                for f in e["fields"]
                if f["section"] == section
            ]
            if rows:
                how = f"paired by {e['paired_by']}" if e["paired_by"] else e["status"]
                blocks.append(f"  {_gpu_name(e)}  ({how})")
                blocks += _table(rows, "    ")
        prow = []
        for p in d["processes"]:
            if p["status"] != "paired" and not p["pid_reused"]:
                continue  # one line each, after the sections
            for f in p["fields"]:
                if f["section"] != section:
                    continue
                if f["change"] == "unchanged":
                    unchanged += 1
                    continue
                if f["change"] == "unknown in both":
                    unknown += 1
                    continue
                label = _proc_label(p, gpu_index)
                if f["field"] != "vram_bytes":
                    label += f" {f['field']}"
                change = _change_text(f)
                if p["pid_reused"]:
                    change += "; PID reused by a different process (start times differ), not paired"
                prow.append((label, *_field_row(label, f)[1:2], change))
        if prow:
            blocks.append("  PROCESSES (VRAM)")
            blocks += _table(prow, "    ")
        srow = [
            _field_row(SYSTEM_LABELS.get(f["field"], f["field"]), f)
            for f in d.get("system", ())
            if f["section"] == section and f["change"] not in ("unchanged", "unknown in both")
        ]
        if srow:
            blocks.append("  SYSTEM (RAM and swap, as the OS counts them; not GPU memory)")
            blocks += _table(srow, "    ")
        if blocks:
            out += ["", SECTION_TITLES[section], *blocks]
    for status, title in (
        ("not listed after", "PROCESSES GONE (not listed after)"),
        ("not listed before", "PROCESSES NEW (not listed before)"),
    ):
        rows = [
            (_proc_label(p, gpu_index), _vram_was(p), "")
            for p in d["processes"]
            if p["status"] == status and not p["pid_reused"]
        ]
        if rows:
            out += ["", title, *_table(rows, "  ")]
    if not d["adapters"]:
        out += ["", "no GPU listed in either snapshot"]
    tail = []
    if unchanged:
        tail.append(f"{unchanged} process value(s) unchanged")
    if unknown:
        tail.append(f"{unknown} unknown in both snapshots (not compared)")
    if tail:
        out += ["", "; ".join(tail)]
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "before",
        metavar="BEFORE",
        help="a saved snapshot (gputaskman --json > FILE), or FILE@N: the Nth snapshot of a "
        "record file (N from 1; -1 is the last)",
    )
    p.add_argument("after", metavar="AFTER", help="the snapshot to compare with it, the same way")
    p.add_argument("--json", dest="diff_json", action="store_true", help="print JSON")
    p.add_argument(
        "--host",
        metavar="NAME",
        help="fleet files (fleet --json, fleet record): compare this host (default: each host "
        "in both)",
    )


def read_arg(arg: str, host: str | None = None) -> tuple[Document, str]:
    """The snapshot a command-line argument names (FILE or FILE@N; with `host`, that host's
    in a fleet file), read, and its name for the user; `SnapshotError` says why it cannot be
    compared."""
    doc, name = load_snapshot_arg(arg, host)
    if host is not None:
        name = f"{name} (host {host})"
    try:
        return read_document(doc), name
    except SnapshotError as exc:
        raise SnapshotError(f"{name}: {exc}") from None


def _hosts(arg: str) -> list[str] | None:
    """The hosts of the fleet file an argument names; None when it is not one."""
    path, at, n_text = arg.rpartition("@")
    if not at or Path(arg).exists() or not n_text.lstrip("-").isdigit():
        path = arg
    try:
        return fleet_hosts(path) if is_fleet_file(path) else None
    except OSError:
        return None  # load_snapshot_arg says why


def _one(args: argparse.Namespace, host: str | None) -> tuple[int, str, dict[str, Any] | None]:
    """(exit code, text or the error, the comparison) for one host (None: plain files)."""
    try:
        before, before_name = read_arg(args.before, host)
        after, after_name = read_arg(args.after, host)
    except SnapshotError as exc:
        return EXIT_BAD_INPUT, str(exc), None
    try:
        d = diff(before, after)
    except Refused as exc:  # the only error `diff` raises on documents read (fuzzed)
        return EXIT_REFUSED, f"refused: {exc}", None
    return 0, render_text(d, before_name, after_name), d


def run(args: argparse.Namespace) -> int:
    host = args.host
    hosts: list[str | None] = [host]
    if host is None:
        before, after = _hosts(args.before), _hosts(args.after)
        if before is not None and after is not None:
            hosts = [h for h in before if h in after]  # a section per host in both
            if not hosts:
                print("gputaskman diff: the two fleet files share no host", file=sys.stderr)
                return EXIT_BAD_INPUT
    rc = 0
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for h in hosts:
        code, text, d = _one(args, h)
        if d is None:
            print(f"gputaskman diff: {text}", file=sys.stderr)
            rc = rc or code
            continue
        texts.append(text if h is None or len(hosts) == 1 else f"== host {h} ==\n{text}")
        results.append(d if h is None else {"host": h, **d})
        if args.diff_json:
            for w in d["warnings"]:
                print(f"gputaskman diff: warning {w['code']}: {w['message']}", file=sys.stderr)
    if args.diff_json and results:
        out: Any = results[0] if len(hosts) == 1 else {"hosts": results}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    elif texts:
        sys.stdout.write("\n".join(texts))
    return rc
