"""``gputaskman --json --compact``: one snapshot on one line, so ``>> FILE`` builds a record file
that summary, diff and replay read. Run for real on the DRM fixture tree
(`drm_fixtures.write_demo_tree`: kernel formats, not measured on hardware)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gputaskman.base import schema
from gputaskman.fixtures.drm_fixtures import write_demo_tree
from gputaskman.offline import record
from gputaskman.offline.playback import RecordSource
from gputaskman.render import report
from jsonschema import Draft202012Validator

GTM = str(Path(sys.executable).parent / "gputaskman")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write_demo_tree(root)
    return root


def gtm(*args: str, stdout: int | object = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GTM, *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_compact_json_is_one_schema_valid_line(tree: Path):
    r = gtm("--json", "--compact", "--sysroot", str(tree))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = r.stdout
    assert out.endswith("\n") and out.count("\n") == 1  # one line, newline-terminated
    doc = json.loads(out)
    # no indentation, no spaces after separators: exactly what `record` writes
    assert out == json.dumps(doc, separators=(",", ":")) + "\n"
    assert out.encode("ascii") == record.encode_line(doc)
    assert out.startswith(record.LINE_PREFIX.decode())
    Draft202012Validator(schema.load()).validate(doc)
    assert report.null_rule_violations(doc) == []
    # the same document as the indented --json, only the layout differs
    pretty = json.loads(gtm("--json", "--sysroot", str(tree)).stdout)
    assert {k for k in doc if k not in ("taken", "taken_iso")} <= set(pretty)
    assert [p["pid"] for p in doc["processes"]] == [p["pid"] for p in pretty["processes"]]


def test_appended_compact_snapshots_are_a_record_file(tree: Path, tmp_path: Path):
    """`gputaskman --json --compact >> run.jsonl` three times: summary, diff (two samples of
    the file) and replay's reader take it as a record of three samples."""
    run = tmp_path / "run.jsonl"
    for _ in range(3):
        with run.open("ab") as f:
            r = gtm("--json", "--compact", "--sysroot", str(tree), stdout=f)
        assert r.returncode == 0, r.stderr
    lines = run.read_bytes().splitlines()
    assert len(lines) == 3
    for line in lines:
        Draft202012Validator(schema.load()).validate(json.loads(line))

    s = gtm("summary", str(run))
    assert s.returncode == 0, s.stderr
    assert "3 snapshots in 1 run(s)" in s.stdout and "unparseable" not in s.stdout + s.stderr
    assert "GPU 0  n/a  00000000:03:00.0" in s.stdout and "llama-server" in s.stdout

    d = gtm("diff", f"{run}@1", f"{run}@-1")
    assert d.returncode == 0, d.stderr
    assert f"before {run}@1" in d.stdout and f"after  {run}@-1" in d.stdout
    assert "memory used              5.0 GiB -> 5.0 GiB" in d.stdout

    source = RecordSource.open(run)
    assert len(source.frames) == 3 and list(source.report.lines()) == []
    snap, _ = source.load(2)  # the third sample, read back into a Snapshot
    assert {p.pid for p in snap.processes} >= {4100, 4400}

    # and `record` goes on appending to it (its first line is a record line)
    rec = gtm("record", str(run), "--count", "1")
    assert rec.returncode == 0, rec.stderr
    assert len(run.read_bytes().splitlines()) == 4


def test_compact_without_json_is_a_one_line_usage_error():
    r = gtm("--compact")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == (
        "gputaskman: error: --compact needs --json (it prints the JSON snapshot on one line)"
    )
    assert gtm("--once", "--compact").returncode == 2
