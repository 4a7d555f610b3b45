"""Record files written by a released gputaskman (tests/recordings: the changing demo and the
DRM fixture tree, both through `record`'s `Recorder`; write_recordings.py says how) still
replay, diff and summarise, and diff and summary print what they printed when the files were
written (tests/recordings/expected)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from gputaskman import cli
from gputaskman.offline.playback import RecordSource
from gputaskman.offline.recorded import snapshot_from_json
from gputaskman.render import report, text_report
from gputaskman.tui.widgets.inspector import inspect_text

HERE = Path(__file__).parent / "recordings"
RECORDINGS = ("demo.jsonl", "drm.jsonl")


def _writer():
    spec = importlib.util.spec_from_file_location("write_recordings", HERE / "write_recordings.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# keys added later that the writer derives from what a line holds, whatever its age
ADDED_DERIVED = frozenset({"owner_totals"})


def without_added_nulls(written: Any, recorded: Any) -> Any:
    """`written` less the keys a later release added (additive within schema_version 1) that
    the recorded line lacks and that are null, or ``{}`` (an adapter's ``health`` where the
    backend reads none), or derived (`ADDED_DERIVED`): an older line has nothing to say about
    them."""
    if isinstance(written, dict) and isinstance(recorded, dict):
        return {
            k: without_added_nulls(v, recorded.get(k))
            for k, v in written.items()
            if k in recorded or (v is not None and v != {} and k not in ADDED_DERIVED)
        }
    if isinstance(written, list) and isinstance(recorded, list) and len(written) == len(recorded):
        return [without_added_nulls(w, r) for w, r in zip(written, recorded, strict=True)]
    return written


@pytest.mark.parametrize("name", RECORDINGS)
def test_every_recorded_line_replays_to_the_same_document(name: str) -> None:
    """Catches a reader that can no longer read a released version's lines, or reads one back
    differently: each frame, shown again through the writer, is the line as recorded (keys
    added since, such as `user` and `ppid`, come back null)."""
    src = RecordSource.open(HERE / name)
    assert src.frames and not src.report.malformed and src.report.incomplete_last_line is None
    for i in range(len(src.frames)):
        snap, system = src.load(i)
        doc = src.doc(i)
        written = report.to_json_dict(snap, system, doc["selected_gpu"])
        assert without_added_nulls(written, doc) == doc
        assert text_report.render_text(snap, system).count("\n") > 10
        for p in snap.processes:
            assert f"PID {p.pid}" in inspect_text(p, snap, system)
    assert not src.late_malformed


def test_the_demo_recording_has_every_part_a_reader_must_keep() -> None:
    """The fixture is worth keeping only if it holds what replay could drop: a breakdown, an
    app model, the null-in-most-files fields, and a duvm pool."""
    docs = [json.loads(line) for line in (HERE / "demo.jsonl").read_text().splitlines()]
    llama = docs[-1]["processes"][0]
    assert llama["breakdown"]["parts"]["other"]["reading"]["kind"] == "inferred"
    assert llama["model"]["header_error"] and llama["model"]["api"]["errors"]
    assert llama["paged_bytes"] and llama["footprint_bytes"] and llama["exe"]
    whisper = next(p for p in docs[-1]["processes"] if p["name"] == "whisper")
    assert whisper["app_model"]["selected"] == "whisper-small" and whisper["scan_detail"]
    assert docs[-1]["system"]["duvm"]["daemons"] and docs[-1]["system"]["duvm"]["lending"]


def test_replay_shows_each_sample_as_the_live_view_did(tmp_path: Path) -> None:
    """Catches replay showing less than the live view: a recorded breakdown kept as raw JSON
    (the inspector then loses its weights / KV / compute lines) or a recorded duvm pool left
    out of the system panel. Each sample of the changing demo, written as a record line and
    replayed, renders as the live sample did: the --once report, every process's inspector,
    the system panel."""
    wr = _writer()
    sampler = wr.DemoSampler(wr.gguf_header(tmp_path))
    for _ in range(4):
        snap, system = sampler.sample_with_system()
        line = json.loads(json.dumps(report.to_json_dict(snap, system)))
        rsnap, rsystem = snapshot_from_json(line)
        assert text_report.render_text(rsnap, rsystem) == text_report.render_text(snap, system)
        for live, replayed in zip(snap.processes, rsnap.processes, strict=True):
            want = inspect_text(live, snap, system).splitlines()
            got = inspect_text(replayed, rsnap, rsystem).splitlines()
            assert len(got) == len(want)
            for w, g in zip(want, got, strict=True):
                # a process the live host sample lacked: the record line says why
                if w in ("RAM: n/a", "CPU: n/a"):
                    assert g.startswith(w) and g.endswith("process not in host sample"), g
                else:
                    assert g == w
        assert text_report.system_lines(rsystem) == text_report.system_lines(system)
    assert "weights" in inspect_text(rsnap.processes[0], rsnap, rsystem)
    assert any(ln.startswith("duvm  pool ok") for ln in text_report.system_lines(rsystem))


RUNS = {
    "summary.txt": ["summary", "{f}"],
    "summary.json": ["summary", "--json", "{f}"],
    "diff.txt": ["diff", "{f}@1", "{f}@-1"],
    "diff.json": ["diff", "--json", "{f}@1", "{f}@-1"],
    "diff-last.txt": ["diff", "{f}@-2", "{f}@-1"],
    "diff-last.json": ["diff", "--json", "{f}@-2", "{f}@-1"],
}


@pytest.mark.parametrize("name", RECORDINGS)
@pytest.mark.parametrize("output", sorted(RUNS))
def test_summary_and_diff_print_what_they_printed(
    name: str, output: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a change in what summary or diff make of a released version's recording (a
    reading skipped, a field no longer compared, a number formatted differently)."""
    monkeypatch.chdir(HERE)
    args = [a.format(f=name) for a in RUNS[output]]
    assert cli.main(args) == 0
    expected = (HERE / "expected" / f"{Path(name).stem}.{output}").read_text()
    assert capsys.readouterr().out == expected
