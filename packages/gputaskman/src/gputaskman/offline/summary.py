"""``gputaskman summary FILE``: averages and peaks per run of a record file.

Theory of operation
-------------------
One pass over the file (`recordfile.iter_record`) reads every snapshot line
(`reader.read_document`) into a compact `Sample`: its time, its GPU identity, and the
readings worth summarising, keyed by (scope, metric, kind). Lines that cannot be read are
skipped and counted with their line numbers; nothing else is held, so a day-long
recording summarises in bounded memory.

Runs. Samples are split into runs where averaging across the boundary would mix
different things: a change of backend or of the GPU set (vendor, PCI address, UUID; a GPU
lost or back counts), a `taken` that goes backwards (a clock change, or two files
concatenated), or a gap longer than ``max(RUN_GAP_FACTOR x median interval,
RUN_GAP_MIN)`` seconds (recording stopped and restarted). The median is over the whole
file's forward intervals, so one long gap cannot stretch its own limit.

Statistics, kept honest:

* Readings are used as recorded: never capped (a utilisation over 100 stays), never
  converted. ``null`` is skipped, never counted as 0, and a metric with no readings in a
  run is omitted rather than shown as 0 or n/a rows.
* The average is the mean of the readings present (samples are evenly spaced within a
  run by construction of the split), and ``readings`` says how many there were.
* A metric whose kind changes (measured in one sample, inferred in another) is kept as
  separate entries per kind; numbers of different kinds are never mixed.
* Process VRAM peaks use measured ``vram_bytes`` only. Rows with the same (host, name)
  are summed within one sample (a server with several worker processes, a process on two
  GPUs), then the peak of those per-sample sums is taken. Inferred or unknown memory is
  never part of a peak.

``--plot`` draws memory over time per run with text blocks (`plot.py`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputaskman.base.frozen import fields_of
from gputaskman.base.readings import DeviceMetrics, Kind, Reading
from gputaskman.document.reader import AdapterDoc, Document, SnapshotError, SystemDoc, read_document
from gputaskman.offline.plot import run_charts
from gputaskman.offline.recordfile import Entry, describe_lines, is_fleet_file, iter_record
from gputaskman.render import report

RUN_GAP_FACTOR = 5.0
RUN_GAP_MIN = 10.0  # seconds

SYSTEM_METRICS = (
    ("memory", "used_bytes", "ram_used_bytes"),
    ("memory", "total_bytes", "ram_total_bytes"),
    ("swap", "used_bytes", "swap_used_bytes"),
    ("cpu", "percent", "cpu_percent"),
)
ADAPTER_METRICS = (
    *DeviceMetrics.__slots__,
    "gtt_used_bytes",
    "gtt_total_bytes",
    "attributed_bytes",
)

MetricKey = tuple[str, str, str]  # (scope: pci bus id or "system", metric, kind)


@dataclass(slots=True)
class Sample:
    lineno: int
    taken: float
    identity: tuple[Any, ...]
    adapters: tuple[dict[str, Any], ...]  # identity fields, for display
    backend: str
    values: dict[MetricKey, float]
    proc_vram: dict[tuple[str | None, str], int]  # (host, name) -> measured bytes, summed


def _adapter_readings(a: AdapterDoc) -> Iterator[tuple[str, Reading]]:
    if a.metrics is not None:
        yield from fields_of(a.metrics).items()
    yield from a.extra_metrics.items()


def _system_readings(s: SystemDoc) -> Iterator[tuple[str, Reading | None]]:
    for section, key, metric in SYSTEM_METRICS:
        if section == "swap":
            yield metric, None if s.swap is None else s.swap.used_bytes
        else:
            yield metric, (s.memory if section == "memory" else s.cpu).get(key)


def sample_from_doc(doc: Document, lineno: int) -> Sample:
    """The summary's view of one snapshot document."""
    values: dict[MetricKey, float] = {}
    adapters = []
    for a in doc.adapters:
        adapters.append(a.identity())
        scope = str(a.pci_bus_id)
        for name, r in _adapter_readings(a):
            if r.value is not None:
                values[(scope, name, str(r.kind))] = r.value
        # a sum of measured readings, null when nothing was measured
        if a.attributed_bytes is not None:
            values[(scope, "attributed_bytes", "measured")] = a.attributed_bytes
    if doc.system is not None:
        for metric, r in _system_readings(doc.system):
            if r is not None and r.value is not None:
                values[("system", metric, str(r.kind))] = r.value
    proc_vram: dict[tuple[str | None, str], int] = {}
    for row in doc.processes:
        p = row.proc
        r = p.dedicated
        if r.kind is not Kind.MEASURED or r.value is None:
            continue
        name = p.name if p.name is not None else f"pid {p.pid}"
        proc_vram[(p.host, name)] = proc_vram.get((p.host, name), 0) + int(r.value)
    identity = (
        doc.backend,
        tuple(sorted((a.vendor, str(a.pci_bus_id), str(a.uuid)) for a in doc.adapters)),
    )
    return Sample(
        lineno, float(doc.taken), identity, tuple(adapters), doc.backend, values, proc_vram
    )


@dataclass(slots=True)
class Stat:
    readings: int = 0
    total: float = 0.0
    peak: float | None = None
    peak_at: float | None = None

    def add(self, v: float, t: float) -> None:
        self.readings += 1
        self.total += v
        if self.peak is None or v > self.peak:
            self.peak, self.peak_at = v, t

    @property
    def avg(self) -> float:
        return self.total / self.readings


@dataclass
class Run:
    index: int
    split: str  # why this run starts here
    samples: list[Sample] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.samples[0].taken

    @property
    def end(self) -> float:
        return self.samples[-1].taken

    def median_interval(self) -> float | None:
        gaps = [b.taken - a.taken for a, b in itertools.pairwise(self.samples)]
        return statistics.median(gaps) if gaps else None

    def stats(self) -> dict[MetricKey, Stat]:
        out: dict[MetricKey, Stat] = {}
        for s in self.samples:
            for key, v in s.values.items():
                out.setdefault(key, Stat()).add(v, s.taken)
        return out

    def proc_peaks(self) -> dict[tuple[str | None, str], Stat]:
        out: dict[tuple[str | None, str], Stat] = {}
        for s in self.samples:
            for key, v in s.proc_vram.items():
                out.setdefault(key, Stat()).add(v, s.taken)
        return out

    def series(self, key: MetricKey) -> list[tuple[float, float | None]]:
        """(taken, value or None) for every sample of the run, for plotting."""
        return [(s.taken, s.values.get(key)) for s in self.samples]


@dataclass
class Summary:
    path: str
    lines: int = 0
    runs: list[Run] = field(default_factory=list)
    unparseable: list[int] = field(default_factory=list)
    unparseable_why: dict[int, str] = field(default_factory=dict)
    incomplete_last_line: bool = False
    median_interval: float | None = None
    gap_limit: float | None = None

    @property
    def snapshots(self) -> int:
        return sum(len(r.samples) for r in self.runs)


def gap_limit(median_interval: float | None) -> float:
    return max(RUN_GAP_FACTOR * (median_interval or 0.0), RUN_GAP_MIN)


def split_runs(samples: list[Sample]) -> tuple[list[Run], float | None, float]:
    """Runs, the file's median forward interval, and the gap limit used."""
    forward = [
        b.taken - a.taken
        for a, b in itertools.pairwise(samples)
        if a.identity == b.identity and b.taken > a.taken
    ]
    median = statistics.median(forward) if forward else None
    limit = gap_limit(median)
    runs: list[Run] = []
    prev: Sample | None = None
    for s in samples:
        why = None
        if prev is None:
            why = "start of file"
        elif s.identity[0] != prev.identity[0]:
            why = f"backend changed ({prev.identity[0]} -> {s.identity[0]})"
        elif s.identity != prev.identity:
            why = "GPU set changed"
        elif s.taken < prev.taken:
            why = f"time went backwards by {prev.taken - s.taken:.1f} s"
        elif s.taken - prev.taken > limit:
            why = f"gap of {s.taken - prev.taken:.1f} s (limit {limit:.1f} s)"
        if why is not None:
            runs.append(Run(len(runs) + 1, why))
        runs[-1].samples.append(s)
        prev = s
    return runs, median, limit


def _take(out: Summary, samples: list[Sample], entry: Entry) -> None:
    """One entry of the file into `out` (a bad line) or `samples`."""
    if entry.doc is None:
        out.unparseable.append(entry.lineno)
        out.unparseable_why[entry.lineno] = entry.error or "?"
        out.incomplete_last_line = entry.incomplete
        return
    try:
        samples.append(sample_from_doc(read_document(entry.doc), entry.lineno))
    except SnapshotError as exc:
        out.unparseable.append(entry.lineno)
        out.unparseable_why[entry.lineno] = f"bad snapshot ({exc})"


def summarize(path: str | Path, host: str | None = None) -> Summary:
    """Read a record file and split it into runs (raises OSError when unreadable). With
    `host`, the file is a fleet record and the snapshots are that host's."""
    out = Summary(str(path) if host is None else f"{path} (host {host})")
    samples: list[Sample] = []
    with open(path, "rb") as f:
        for entry in iter_record(f, host):
            out.lines = entry.lineno
            _take(out, samples, entry)
    out.runs, out.median_interval, out.gap_limit = split_runs(samples)
    return out


def summarize_hosts(path: str | Path) -> dict[str, Summary]:
    """A fleet record summarised per host, in one pass: {host: its summary}, hosts in the
    order first seen. A line no host can be read from counts against every host."""
    per: dict[str, tuple[Summary, list[Sample]]] = {}
    bad = Summary(str(path))
    lines = 0
    with open(path, "rb") as f:
        for entry in iter_record(f, every_host=True):
            lines = max(lines, entry.lineno)
            if entry.host is None:
                if entry.doc is not None:
                    entry = Entry(
                        entry.lineno, entry.offset, entry.length, None, "not a fleet line"
                    )
                _take(bad, [], entry)
                continue
            if entry.host not in per:
                per[entry.host] = (Summary(f"{path} (host {entry.host})"), [])
            _take(*per[entry.host], entry)
    for out, samples in per.values():
        out.lines = lines
        out.unparseable = sorted(out.unparseable + bad.unparseable)
        out.unparseable_why.update(bad.unparseable_why)
        out.incomplete_last_line = out.incomplete_last_line or bad.incomplete_last_line
        out.runs, out.median_interval, out.gap_limit = split_runs(samples)
    return {host: out for host, (out, _) in per.items()}


# ---------------------------------------------------------------------------- output

UNITS = {
    "bytes": "bytes",
    "percent": "%",
    "_c": " C",
    "_w": " W",
    "_mhz": " MHz",
}
LABELS = {
    "memory_total_bytes": "memory total",
    "memory_used_bytes": "memory used",
    "memory_reserved_bytes": "memory reserved",
    "util_gpu_percent": "gpu load",
    "util_memory_percent": "memory load",
    "encoder_percent": "encoder",
    "decoder_percent": "decoder",
    "temperature_c": "temperature",
    "power_w": "power",
    "power_limit_w": "power limit",
    "clock_graphics_mhz": "clock graphics",
    "clock_sm_mhz": "clock sm",
    "clock_memory_mhz": "clock memory",
    "attributed_bytes": "attributed to processes",
    "gtt_used_bytes": "GTT used",
    "gtt_total_bytes": "GTT total",
    "ram_used_bytes": "RAM used",
    "ram_total_bytes": "RAM total",
    "swap_used_bytes": "swap used",
    "cpu_percent": "CPU",
}


def fmt_value(metric: str, v: float) -> str:
    if metric.endswith("_bytes"):
        return report.fmt_bytes(v)
    for suffix, unit in UNITS.items():
        if metric.endswith(suffix) and suffix != "bytes":
            text = f"{v:.1f}" if isinstance(v, float) and not v.is_integer() else f"{v:g}"
            return text + unit
    return f"{v:g}"


def _iso(t: float) -> str:
    return (
        dt.datetime.fromtimestamp(t, tz=dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _hms(t: float) -> str:
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%H:%M:%S")


def _duration(s: float) -> str:
    s = round(s)
    return (
        f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    )


def _metric_entries(stats: Mapping[MetricKey, Stat], scope: str) -> list[dict[str, Any]]:
    order = {m: i for i, m in enumerate((*ADAPTER_METRICS, *(m for _, _, m in SYSTEM_METRICS)))}
    keys = sorted((k for k in stats if k[0] == scope), key=lambda k: (order.get(k[1], 99), k[2]))
    return [
        {
            "metric": metric,
            "kind": kind,
            "avg": stats[(scope, metric, kind)].avg,
            "peak": stats[(scope, metric, kind)].peak,
            "peak_at": stats[(scope, metric, kind)].peak_at,
            "readings": stats[(scope, metric, kind)].readings,
        }
        for _, metric, kind in keys
    ]


def run_json(run: Run) -> dict[str, Any]:
    stats = run.stats()
    adapters = []
    for a in run.samples[0].adapters:
        adapters.append({**a, "metrics": _metric_entries(stats, str(a["pci_bus_id"]))})
    peaks = sorted(run.proc_peaks().items(), key=lambda kv: -(kv[1].peak or 0))
    return {
        "index": run.index,
        "starts_because": run.split,
        "start": run.start,
        "start_iso": _iso(run.start),
        "end": run.end,
        "end_iso": _iso(run.end),
        "duration_s": run.end - run.start,
        "samples": len(run.samples),
        "median_interval_s": run.median_interval(),
        "backend": run.samples[0].backend,
        "adapters": adapters,
        "system": _metric_entries(stats, "system"),
        "process_vram_peaks": [
            {
                "host": host,
                "name": name,
                "peak_bytes": st.peak,
                "peak_at": st.peak_at,
                "samples_measured": st.readings,
            }
            for (host, name), st in peaks
        ],
    }


def to_json_dict(s: Summary) -> dict[str, Any]:
    return {
        "schema": "gputaskman.offline.summary",
        "schema_version": 1,
        "file": s.path,
        "lines": s.lines,
        "snapshots": s.snapshots,
        "unparseable": {
            "count": len(s.unparseable),
            "lines": s.unparseable,
            "incomplete_last_line": s.incomplete_last_line,
            # why, for the first few (a file of garbage must not make a huge report)
            "reasons": {str(n): s.unparseable_why[n] for n in s.unparseable[:20]},
        },
        "run_split": {
            "gap_factor": RUN_GAP_FACTOR,
            "gap_min_s": RUN_GAP_MIN,
            "median_interval_s": s.median_interval,
            "gap_limit_s": s.gap_limit,
        },
        "runs": [run_json(r) for r in s.runs],
    }


def _metric_lines(entries: Iterable[Mapping[str, Any]]) -> list[str]:
    rows = []
    for e in entries:
        label = LABELS.get(e["metric"], e["metric"])
        mark = report.KIND_MARK.get(report.Kind(e["kind"]), "") if e["kind"] in KINDS else "?"
        if e["kind"] != "measured":
            label += f" ({e['kind']})"
        rows.append(
            (
                label,
                mark + fmt_value(e["metric"], e["avg"]),
                mark + fmt_value(e["metric"], e["peak"]),
                _hms(e["peak_at"]),
                str(e["readings"]),
            )
        )
    if not rows:
        return ["    no readings"]
    header = ("", "avg", "peak", "peak at", "readings")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    return [
        "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]


KINDS = {"measured", "inferred", "estimated", "runtime"}


def render_text(s: Summary, *, plot: bool = False, width: int | None = None) -> str:
    out = [f"gputaskman summary {s.path}: {s.snapshots} snapshots in {len(s.runs)} run(s)"]
    if s.unparseable and not s.snapshots:
        first = s.unparseable[0]
        out.append(
            f"not a gputaskman record file: none of its {s.lines} line(s) is a snapshot "
            f"(line {first}: {s.unparseable_why[first]}); record one with "
            "`gputaskman record FILE`, or save one snapshot with `gputaskman --json > FILE`"
        )
    elif s.unparseable:
        why = "; last line incomplete (recording interrupted)" if s.incomplete_last_line else ""
        first = s.unparseable[0]
        out.append(
            f"skipped {len(s.unparseable)} unparseable line(s): "
            f"{describe_lines(s.unparseable)}{why} (line {first}: {s.unparseable_why[first]})"
        )
    out.append(
        "averages are means of the readings present; null readings are skipped, never "
        "counted as 0; readings are shown as recorded"
    )
    for run in s.runs:
        j = run_json(run)
        med = j["median_interval_s"]
        every = f", every {med:.3g} s" if med is not None else ""
        out += [
            "",
            f"RUN {run.index}  {j['start_iso']} -> {_hms(run.end)}  "
            f"({_duration(j['duration_s'])}, {j['samples']} samples{every})  "
            f"backend {j['backend']}  [starts: {run.split}]",
        ]
        if not j["adapters"]:
            out.append("  no GPU listed in this run")
        for a in j["adapters"]:
            out.append(f"  GPU {a['index']}  {a['name'] or 'n/a'}  {a['pci_bus_id']}")
            out += _metric_lines(a["metrics"])
        if j["system"]:
            out.append("  SYSTEM (OS-reported, not GPU)")
            out += _metric_lines(j["system"])
        peaks = j["process_vram_peaks"]
        if peaks:
            out.append("  PROCESS VRAM PEAKS (measured bytes only; same name summed per sample)")
            for p in peaks[:15]:
                who = p["name"] if p["host"] is None else f"{p['host']}:{p['name']}"
                out.append(
                    f"    {who:<24} {report.fmt_bytes(p['peak_bytes']):>10}  at "
                    f"{_hms(p['peak_at'])}  ({p['samples_measured']} samples measured)"
                )
            if len(peaks) > 15:
                out.append(f"    ... {len(peaks) - 15} more (--json lists all)")
        else:
            out.append("  PROCESS VRAM PEAKS: no measured per-process VRAM in this run")
        if plot:
            out += ["", *run_charts(run, width=width)]
    return "\n".join(out) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="record file written by gputaskman record")
    p.add_argument("--json", dest="summary_json", action="store_true", help="print JSON")
    p.add_argument("--plot", action="store_true", help="chart memory over time per run")
    p.add_argument(
        "--host",
        metavar="NAME",
        help="in a fleet record: this host only (default: a section per host)",
    )


def run(args: argparse.Namespace) -> int:
    host = args.host
    try:
        if host is None and is_fleet_file(args.file):
            summaries = summarize_hosts(args.file)
        else:
            summaries = {host: summarize(args.file, host)}
    except OSError as exc:
        print(
            f"gputaskman summary: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr
        )
        return 2
    if args.summary_json:
        if host is None and None not in summaries:
            doc: Any = {
                "schema": "gputaskman.offline.fleet_summary",
                "schema_version": 1,
                "file": str(args.file),
                "hosts": [{"host": h, **to_json_dict(s)} for h, s in summaries.items()],
            }
        else:
            doc = to_json_dict(summaries[host])
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write("\n".join(render_text(s, plot=args.plot) for s in summaries.values()))
    if not any(s.runs for s in summaries.values()):
        whose = f" of host {host}" if host else ""
        print(f"gputaskman summary: no snapshot{whose} in {args.file}", file=sys.stderr)
        return 1
    return 0
