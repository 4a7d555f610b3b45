"""`gputaskman diff`: the command, and its text form of the comparison `diff.diff` returns
(sections of measured, runtime-reported, estimated and inferred changes per GPU and per
process). The comparison itself is `diff`'s, which knows nothing of terminals."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from typing import Any

from gputaskman.core import report
from gputaskman.offline.diff import (
    EXIT_BAD_INPUT,
    EXIT_REFUSED,
    SECTION_TITLES,
    SECTIONS,
    Refused,
    Value,
    _bus,
    diff,
)
from gputaskman.offline.recordfile import SnapshotError, load_snapshot_file

FIELD_LABELS = {
    "memory_used_bytes": "memory used",
    "memory_total_bytes": "memory total",
    "memory_reserved_bytes": "memory reserved",
    "attributed_bytes": "attributed to processes",
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
    gpu = gpu_index.get(_bus(side.get("gpu")), side.get("gpu") or "none")
    return f"{p['pid']} {p['name'] or 'n/a'} (GPU {gpu})"


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
                gpu_index[_bus(e[side].get("pci_bus_id"))] = str(e[side].get("index"))
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
        if blocks:
            out += ["", SECTION_TITLES[section], *blocks]
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
    p.add_argument("before", metavar="BEFORE.json", help="saved snapshot (gputaskman --json)")
    p.add_argument("after", metavar="AFTER.json", help="saved snapshot to compare with it")
    p.add_argument("--json", dest="diff_json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    try:
        before = load_snapshot_file(args.before)
        after = load_snapshot_file(args.after)
    except SnapshotError as exc:
        print(f"gputaskman diff: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        d = diff(before, after)
    except Refused as exc:  # the only error `diff` raises on checked documents (fuzzed)
        print(f"gputaskman diff: refused: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    sys.stdout.write(
        json.dumps(d, indent=2) + "\n"
        if args.diff_json
        else render_text(d, args.before, args.after)
    )
    for w in d["warnings"]:
        if args.diff_json:
            print(f"gputaskman diff: warning {w['code']}: {w['message']}", file=sys.stderr)
    return 0
