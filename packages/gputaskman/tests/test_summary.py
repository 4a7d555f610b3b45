"""`gputaskman summary`: real record files from `gputaskman record` on this GPU-less
machine, and record files of mocked NVML snapshots for the GPU fields."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gputaskman.base.readings import Reason
from gputaskman.offline import plot, summary
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "mocked_snapshots", Path(__file__).with_name("mocked_snapshots.py")
)
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)
GIB = ms.GIB


def gtm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", *args], capture_output=True, text=True, timeout=60
    )


def gpu_doc(t: float, used=4 * GIB, *, procs=(), bus=ms.BUS0, backend="nvml", **metric_kw):
    a = ms.adapter(bus=bus)
    return ms.doc(
        ms.snapshot(
            ms.T0 + t,
            adapters=[a],
            metrics_by_bus={bus: ms.metrics(used=used, **metric_kw)},
            procs=procs,
            backend=backend,
        )
    )


def summarize(tmp_path: Path, docs) -> summary.Summary:
    return summary.summarize(ms.write_record(tmp_path / "rec.jsonl", docs))


def metric(run_json: dict, name: str, kind: str = "measured") -> dict | None:
    entries = run_json["adapters"][0]["metrics"]
    return next((e for e in entries if e["metric"] == name and e["kind"] == kind), None)


def test_summary_of_a_real_record_file(tmp_path: Path) -> None:
    rec = tmp_path / "real.jsonl"
    r = gtm("record", str(rec), "--interval", "0.2", "--count", "4")
    assert r.returncode == 0, r.stderr
    docs = [json.loads(line) for line in rec.read_text().splitlines()]
    res = gtm("summary", str(rec), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["snapshots"] == 4 and out["unparseable"]["count"] == 0
    (run,) = out["runs"]
    assert run["adapters"] == []  # no GPU here: nothing made up
    system = {e["metric"]: e for e in run["system"]}
    cpu = [d["system"]["cpu"]["percent"]["value"] for d in docs]
    known = [v for v in cpu if v is not None]
    assert cpu[0] is None  # the first sample has no CPU rate: recorded as null
    assert system["cpu_percent"]["readings"] == len(known)
    assert system["cpu_percent"]["avg"] == pytest.approx(sum(known) / len(known))
    ram = [d["system"]["memory"]["used_bytes"]["value"] for d in docs]
    assert system["ram_used_bytes"]["peak"] == max(ram)
    text = gtm("summary", str(rec)).stdout
    assert "no GPU listed in this run" in text and "RAM used" in text


def test_system_numbers_of_early_files_are_read_too(tmp_path: Path) -> None:
    # files written before the system section used reading objects held plain numbers
    docs = [gpu_doc(t) for t in range(3)]
    for i, d in enumerate(docs):
        d["system"] = {
            "taken": d["taken"],
            "kind": "measured",
            "memory": {"used_bytes": (i + 1) * GIB, "reasons": {}},
            "swap": {"used_bytes": None, "reasons": {"used_bytes": "unavailable"}},
            "cpu": {"percent": 10.0 * i, "reasons": {}},
        }
    system = {e["metric"]: e for e in summary.run_json(summarize(tmp_path, docs).runs[0])["system"]}
    assert system["ram_used_bytes"]["peak"] == 3 * GIB and system["cpu_percent"]["avg"] == 10
    assert "swap_used_bytes" not in system


def test_gtt_is_summarised_like_other_device_readings(tmp_path: Path) -> None:
    docs = [gpu_doc(t) for t in range(2)]
    for i, d in enumerate(docs):
        d["adapters"][0]["extra_metrics"] = {
            "gtt_used_bytes": {
                "value": (i + 1) * GIB,
                "kind": "measured",
                "source": "sysfs",
                "reason": None,
                "detail": None,
            }
        }
    assert (
        metric(summary.run_json(summarize(tmp_path, docs).runs[0]), "gtt_used_bytes")["peak"]
        == 2 * GIB
    )


def test_runs_split_at_gap_longer_than_the_minimum(tmp_path: Path) -> None:
    # 1 s interval: the limit is RUN_GAP_MIN (10 s), not 5 x 1 s
    times = [0, 1, 2, 3, 4, 13, 24, 25]
    s = summarize(tmp_path, [gpu_doc(t) for t in times])
    assert s.median_interval == 1 and s.gap_limit == summary.RUN_GAP_MIN
    assert [len(r.samples) for r in s.runs] == [6, 2]  # 9 s gap kept, 11 s gap splits
    assert s.runs[1].split.startswith("gap of 11.0 s")


def test_runs_split_at_gap_longer_than_factor_times_median(tmp_path: Path) -> None:
    times = [0, 5, 10, 15, 20, 44, 49, 75]  # median 5 s -> limit 25 s
    s = summarize(tmp_path, [gpu_doc(t) for t in times])
    assert s.gap_limit == summary.RUN_GAP_FACTOR * 5
    assert [len(r.samples) for r in s.runs] == [7, 1]  # a 24 s gap stays, 26 s splits


def test_runs_split_at_backwards_time_gpu_and_backend_change(tmp_path: Path) -> None:
    docs = [
        gpu_doc(0),
        gpu_doc(1),
        gpu_doc(0.5),  # time went backwards
        gpu_doc(1.5, bus=ms.BUS1),  # another GPU
        gpu_doc(2.5, bus=ms.BUS1),
        gpu_doc(3.5, bus=ms.BUS1, backend="drm"),  # another backend
        ms.doc(ms.snapshot(ms.T0 + 4.5, unavailable=Reason.GPU_LOST, backend="drm")),
    ]
    s = summarize(tmp_path, docs)
    splits = [r.split for r in s.runs]
    assert [len(r.samples) for r in s.runs] == [2, 1, 2, 1, 1]
    assert splits[1].startswith("time went backwards")
    assert splits[2] == "GPU set changed"
    assert splits[3].startswith("backend changed (nvml -> drm)")
    assert splits[4] == "GPU set changed"  # the GPU was lost


def test_null_is_skipped_never_counted_as_zero(tmp_path: Path) -> None:
    s = summarize(tmp_path, [gpu_doc(0, 4 * GIB), gpu_doc(1, None), gpu_doc(2, 8 * GIB)])
    used = metric(summary.run_json(s.runs[0]), "memory_used_bytes")
    assert used["readings"] == 2 and used["avg"] == 6 * GIB and used["peak"] == 8 * GIB


def test_a_metric_with_no_readings_is_omitted(tmp_path: Path) -> None:
    s = summarize(tmp_path, [gpu_doc(t, None, power=None) for t in range(3)])
    j = summary.run_json(s.runs[0])
    assert metric(j, "memory_used_bytes") is None and metric(j, "power_w") is None
    assert metric(j, "memory_total_bytes")["readings"] == 3
    text = summary.render_text(s)
    labels = [line.strip().split("  ")[0] for line in text.splitlines()]
    assert "memory total" in labels and "power limit" in labels
    assert "memory used" not in labels and "power" not in labels


def test_readings_are_never_capped(tmp_path: Path) -> None:
    s = summarize(tmp_path, [gpu_doc(0, 20 * GIB, util=130), gpu_doc(1, 2 * GIB, util=10)])
    j = summary.run_json(s.runs[0])
    assert metric(j, "memory_used_bytes")["peak"] == 20 * GIB  # above the 16 GiB total
    assert metric(j, "util_gpu_percent")["peak"] == 130
    assert metric(j, "util_gpu_percent")["avg"] == 70


def test_kinds_are_never_mixed(tmp_path: Path) -> None:
    docs = [gpu_doc(0, 4 * GIB), gpu_doc(1, 10 * GIB, kind_used="inferred")]
    j = summary.run_json(summarize(tmp_path, docs).runs[0])
    assert metric(j, "memory_used_bytes")["peak"] == 4 * GIB
    assert metric(j, "memory_used_bytes", "inferred")["peak"] == 10 * GIB


def test_process_peaks_use_measured_bytes_summed_per_name(tmp_path: Path) -> None:
    p = ms.proc
    s1 = [
        p(10, 3 * GIB, name="llama-server"),
        p(11, 2 * GIB, name="llama-server"),  # a second worker: same name, summed
        p(12, None, name="python3", inferred=10 * GIB),  # hidden: never a peak
        p(13, 1 * GIB, name="whisper"),
    ]
    s2 = [p(10, 4 * GIB, name="llama-server"), p(13, None, name="whisper")]
    docs = [gpu_doc(0, procs=s1), gpu_doc(1, procs=s2)]
    # the same name on another host (the WSL host) is kept apart
    docs[1]["processes"].append({**docs[1]["processes"][0], "host": "windows", "pid": 99})
    j = summary.run_json(summarize(tmp_path, docs).runs[0])
    peaks = {(x["host"], x["name"]): x for x in j["process_vram_peaks"]}
    assert peaks[(None, "llama-server")]["peak_bytes"] == 5 * GIB
    assert peaks[(None, "llama-server")]["peak_at"] == ms.T0
    assert peaks[("windows", "llama-server")]["peak_bytes"] == 4 * GIB
    assert peaks[(None, "whisper")]["peak_bytes"] == 1 * GIB
    assert peaks[(None, "whisper")]["samples_measured"] == 1
    assert (None, "python3") not in peaks


def test_unparseable_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    good = gpu_doc(0)
    docs = [
        good,
        "not json\n",
        '{"schema": "other"}\n',
        gpu_doc(1),
        b"\xff\xfe\n",
        gpu_doc(2),
        json.dumps(gpu_doc(3))[:80],  # the recorder was killed mid-line
    ]
    s = summarize(tmp_path, docs)
    assert s.lines == 7 and s.snapshots == 3
    assert s.unparseable == [2, 3, 5, 7] and s.incomplete_last_line
    text = summary.render_text(s)
    assert "skipped 4 unparseable line(s): 2, 3, 5, 7" in text
    out = summary.to_json_dict(s)
    reasons = out["unparseable"].pop("reasons")
    assert out["unparseable"] == {"count": 4, "lines": [2, 3, 5, 7], "incomplete_last_line": True}
    assert reasons["2"].startswith("not JSON") and "schema" in reasons["3"]
    assert "UTF-8" in reasons["5"] and reasons["7"].startswith("incomplete last line")


def test_chart_draws_missing_as_dots_and_zero_as_empty() -> None:
    pts = [(0.0, 0.0), (1.0, None), (2.0, 8.0), (3.0, 4.0)]
    lines = plot.chart(pts, width=4, height=2, top=8.0, fmt=lambda v: f"{v:g}")
    bars = [line.split("┤", 1)[1].ljust(4) for line in lines[:2]]
    assert bars == ["  █ ", " ·██"]  # zero: nothing; null: a dot; 4 of 8: the lower row full
    assert lines[0].strip().startswith("8 ┤") and lines[1].strip().startswith("0 ┤")


def test_chart_scale_grows_instead_of_capping() -> None:
    lines = plot.chart([(0.0, 4.0), (1.0, 12.0)], width=2, height=1, top=8.0, fmt=str)
    assert lines[0].startswith(" " * 6 + "12.0 ┤")


def test_plot_renders_a_chart_per_run(tmp_path: Path) -> None:
    rec = ms.write_record(
        tmp_path / "r.jsonl",
        [gpu_doc(t, (t + 1) * GIB) for t in range(5)] + [gpu_doc(100, 2 * GIB)],
    )
    res = gtm("summary", str(rec), "--plot")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("memory used (measured)") == 2  # one chart per run
    assert "16.0 GiB ┤" in res.stdout and "█" in res.stdout


def test_summary_exit_codes(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert gtm("summary", str(empty)).returncode == 1
    missing = gtm("summary", str(tmp_path / "missing.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=200), max_size=8), st.booleans())
def test_summary_fuzz_never_crashes(tmp_path: Path, chunks: list[bytes], newline: bool) -> None:
    path = tmp_path / "fuzz.jsonl"
    good = ms.write_record(tmp_path / "g.jsonl", [gpu_doc(0)]).read_bytes()
    tmp_path.joinpath("g.jsonl").unlink()
    data = good + b"\n".join(chunks) + (b"\n" if newline else b"")
    path.write_bytes(data)
    s = summary.summarize(path)
    assert s.snapshots + len(s.unparseable) == s.lines
    assert s.snapshots >= 1
    summary.render_text(s, plot=True, width=30)
    json.dumps(summary.to_json_dict(s))
