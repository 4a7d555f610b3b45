#!/usr/bin/env python3
"""Summarise a `duvm daemon --trace FILE` request trace: where a workload's time goes.

For each file: requests per command with the time each spent inside the daemon (decoded to
reply queued: median, 90th percentile, sum); reads split into sequential ones (starting where
the previous read ended: the kernel's swap-in of consecutive slots) and jumps; how many
writes were already in flight when each write arrived; and the wall time with a read, a write
or nothing in flight (the idle part is the kernel, the frontend and the program working).

    uv run python benchmarks/nbd_trace.py TRACE [TRACE...] [--json]

`bench_swap.py --trace DIR` writes one trace per duvm run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from duvm.wire.nbdtrace import FORMAT


class TraceError(Exception):
    pass


def load(path: Path) -> list[tuple[int, int, str, int, int, int]]:
    """The trace's requests as (arrival_ns, done_ns, command, offset, length, errno), by
    arrival. Raises TraceError on a file that is not a trace; a last line cut short (a
    daemon killed while writing) is skipped."""
    rows = []
    with open(path) as f:
        head = f.readline()
        if not head.startswith(f"# {FORMAT}"):
            raise TraceError(f"{path}: not a duvm NBD trace (first line {head.strip()[:60]!r})")
        for n, line in enumerate(f, 2):
            parts = line.split()
            try:
                t0, t1, off, length, err = (int(parts[i]) for i in (0, 1, 3, 4, 5))
                rows.append((t0, t1, parts[2], off, length, err))
            except (IndexError, ValueError):
                if line.endswith("\n"):
                    raise TraceError(f"{path}:{n}: malformed line {line.strip()[:80]!r}") from None
    rows.sort()
    return rows


def _times(us: list[float]) -> dict:
    if not us:
        return {"n": 0, "median_us": None, "p90_us": None, "sum_s": 0.0}
    us = sorted(us)
    return {
        "n": len(us),
        "median_us": round(statistics.median(us), 1),
        "p90_us": round(us[math.ceil(0.9 * len(us)) - 1], 1),  # nearest rank
        "sum_s": round(sum(us) / 1e6, 3),
    }


def _busy_ns(rows: list) -> int:
    """Wall time covered by the union of the requests' [arrival, done] intervals."""
    total, cur_start, cur_end = 0, None, -1
    for t0, t1, *_ in rows:
        if cur_start is None or t0 > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = t0, t1
        else:
            cur_end = max(cur_end, t1)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def summarise(rows: list) -> dict:
    if not rows:
        return {"requests": 0}
    span = max(r[1] for r in rows) - rows[0][0]
    by_cmd: dict[str, list[float]] = {}
    for t0, t1, cmd, *_ in rows:
        by_cmd.setdefault(cmd, []).append((t1 - t0) / 1e3)
    reads = [r for r in rows if r[2] == "read"]
    writes = [r for r in rows if r[2] == "write"]
    seq, jump, prev_end = [], [], None
    for t0, t1, _, off, length, _ in reads:
        (seq if off == prev_end else jump).append((t1 - t0) / 1e3)
        prev_end = off + length
    # writes in flight when each write arrived
    events = sorted([(t0, 1) for t0, *_ in writes] + [(t1, -1) for _, t1, *_ in writes])
    in_flight, at_arrival = 0, Counter()
    for _, step in events:
        if step == 1:
            at_arrival[in_flight] += 1
        in_flight += step
    return {
        "requests": len(rows),
        "span_s": round(span / 1e9, 6),
        "errors": sum(1 for r in rows if r[5]),
        "commands": {cmd: _times(us) for cmd, us in sorted(by_cmd.items())},
        "read_sizes_kib": dict(Counter(r[4] >> 10 for r in reads).most_common(6)),
        "reads_sequential": _times(seq),
        "reads_jump": _times(jump),
        "write_sizes_kib": dict(Counter(r[4] >> 10 for r in writes).most_common(6)),
        "writes_in_flight_at_arrival": dict(sorted(at_arrival.items())),
        "wall_s_with_read_in_flight": round(_busy_ns(reads) / 1e9, 6),
        "wall_s_with_write_in_flight": round(_busy_ns(writes) / 1e9, 6),
        "wall_s_idle": round((span - _busy_ns(rows)) / 1e9, 6),
    }


def _fmt(t: dict) -> str:
    if not t["n"]:
        return "none"
    return f"{t['n']}: median {t['median_us']} us, p90 {t['p90_us']} us, sum {t['sum_s']} s"


def report(name: str, s: dict) -> str:
    if not s["requests"]:
        return f"{name}: no requests"
    lines = [f"{name}: {s['requests']} requests over {s['span_s']} s, {s['errors']} failed"]
    lines += [f"  {cmd:<12} {_fmt(t)}" for cmd, t in s["commands"].items()]
    lines += [
        f"  reads, sequential  {_fmt(s['reads_sequential'])}",
        f"  reads, jumps       {_fmt(s['reads_jump'])}",
        f"  read sizes KiB (count)   {s['read_sizes_kib']}",
        f"  write sizes KiB (count)  {s['write_sizes_kib']}",
        f"  writes already in flight when a write arrived (count)  "
        f"{s['writes_in_flight_at_arrival']}",
        f"  wall time with a read in flight {s['wall_s_with_read_in_flight']} s, with a write "
        f"in flight {s['wall_s_with_write_in_flight']} s, nothing in flight "
        f"{s['wall_s_idle']} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    ap.add_argument("--json", action="store_true", help="one JSON object per file, by name")
    args = ap.parse_args(argv)
    out = {}
    try:
        for p in args.traces:
            out[str(p)] = summarise(load(p))
    except (OSError, TraceError) as e:
        print(f"nbd_trace: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print("\n\n".join(report(name, s) for name, s in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
