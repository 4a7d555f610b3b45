"""Fleet files and the offline tools: a fleet record (written by `FleetRecorder` from host
states) read per host by replay, summary and diff; a host that was down in a round has no
sample there, never a zero; a record file of one kind is never appended to by the other.

Hosts are the demo snapshot under three names (synthetic GPU numbers), one of them down in
some rounds; no network."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
from gputaskman.base import schema
from gputaskman.document import fleetdoc
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import read_document
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.fleet.output import FleetRecorder, fleet_document, fleet_line
from gputaskman.fleet.poller import HostState
from gputaskman.fleet.targets import parse_target
from gputaskman.offline import diff_report, summary
from gputaskman.offline.playback import RecordSource
from gputaskman.offline.record import FLEET_LINE_PREFIX, RecordError, encode_line, open_record
from gputaskman.offline.recordfile import (
    SnapshotError,
    fleet_hosts,
    iter_record,
    load_snapshot_arg,
)
from gputaskman.render import report

HOSTS = ("gpu-a", "gpu-b", "gpu-c")


def _doc(taken: float, used_gib: float) -> dict:
    snap = demo_snapshot()
    a0 = snap.adapters[0].pci_bus_id
    m = snap.metrics[a0]
    used = dataclasses.replace(m.memory_used_bytes, value=int(used_gib * 2**30))
    metrics = {**snap.metrics, a0: dataclasses.replace(m, memory_used_bytes=used)}
    snap = dataclasses.replace(snap, taken=taken, metrics=metrics)
    return json.loads(json.dumps(report.to_json_dict(snap, DemoSystem())))


class FakePoller:
    """States a test sets round by round (the recorder only reads them)."""

    timeout = 1.0

    def __init__(self) -> None:
        self.targets = [parse_target(h) for h in HOSTS]
        self._states = tuple(HostState(t) for t in self.targets)

    def set(self, states: tuple[HostState, ...]) -> None:
        self._states = states

    def states(self) -> tuple[HostState, ...]:
        return self._states

    def wait_polled(self, timeout: float) -> bool:
        return True


def _write_record(path: Path, rounds: int = 4) -> None:
    """gpu-a and gpu-b answer every round; gpu-c is down in rounds 1 and 2; gpu-b's answer
    of round 2 is late (the same as round 1's)."""
    poller = FakePoller()
    fd = open_record(path, FLEET_LINE_PREFIX)
    rec = FleetRecorder(fd, poller, interval=1.0)  # type: ignore[arg-type]
    seqs = dict.fromkeys(HOSTS, 0)
    try:
        for r in range(rounds):
            states = []
            for t in poller.targets:
                h = t.name
                if h == "gpu-c" and r in (1, 2):
                    prev = poller.states()[2]
                    states.append(
                        dataclasses.replace(
                            prev, status=HostStatus.UNREACHABLE, reason="connection refused"
                        )
                    )
                    continue
                if not (h == "gpu-b" and r == 2):
                    seqs[h] += 1
                raw = _doc(1000.0 + seqs[h], 1.0 + seqs[h] + HOSTS.index(h))
                states.append(
                    HostState(
                        t,
                        HostStatus.UP,
                        None,
                        read_document(raw),
                        json.dumps(raw).encode(),
                        1000.0 + seqs[h],
                        0.01,
                        seqs[h],
                        r + 1,
                    )
                )
            poller.set(tuple(states))
            rec.write_round()
    finally:
        os.close(fd)


def test_a_fleet_record_holds_each_host_answer_once_and_down_rounds_say_why(tmp_path):
    """Catches a record line that repeats an answer already written (summary would count it
    twice) or zeroes a host that was down."""
    path = tmp_path / "fleet.jsonl"
    _write_record(path)
    raw = path.read_bytes().splitlines()
    assert len(raw) == 4 and all(x.startswith(FLEET_LINE_PREFIX) for x in raw)
    lines = [json.loads(x) for x in raw]
    for line in lines:
        fleetdoc.check_fleet(line)
        for h in line["hosts"]:
            if h["snapshot"] is not None:
                assert schema.errors(h["snapshot"]) == []
    c = [fleetdoc.host_entry(line, "gpu-c") for line in lines]
    assert [e["status"] for e in c] == ["up", "unreachable", "unreachable", "up"]
    assert c[1]["snapshot"] is None and c[1]["reason"] == "connection refused"
    b = [fleetdoc.host_entry(line, "gpu-b")["snapshot"] for line in lines]
    assert b[2] is None  # no new answer in round 3: not written again
    assert fleet_hosts(path) == list(HOSTS)


def test_a_host_down_at_a_round_has_no_snapshot_in_it_even_a_new_one(tmp_path):
    """Catches a record line holding the snapshot of a host that is down in that round (an
    answer that arrived after the last round, before the host went down): whoever adds up a
    line's snapshots counted a host that is down, which the line's own summary leaves out.
    The answer is written once the host is up with it again."""
    poller = FakePoller()
    a, b, c = poller.targets

    def up(t, seq: int) -> HostState:
        raw = _doc(1000.0 + seq, 2.0)
        body = json.dumps(raw).encode()
        return HostState(t, HostStatus.UP, None, read_document(raw), body, 1000.0 + seq, 0.01, seq)

    path = tmp_path / "fleet.jsonl"
    fd = open_record(path, FLEET_LINE_PREFIX)
    rec = FleetRecorder(fd, poller, interval=1.0)  # type: ignore[arg-type]
    try:
        poller.set((up(a, 1), up(b, 1), up(c, 1)))
        rec.write_round()
        # gpu-c answered a new sample, then went down before the next round
        down = dataclasses.replace(up(c, 2), status=HostStatus.UNREACHABLE, reason="gone")
        poller.set((up(a, 2), up(b, 2), down))
        rec.write_round()
        poller.set((up(a, 2), up(b, 2), up(c, 2)))  # up again with that sample (a 304)
        rec.write_round()
    finally:
        os.close(fd)
    lines = [json.loads(x) for x in path.read_bytes().splitlines()]
    second = lines[1]
    entry = fleetdoc.host_entry(second, "gpu-c")
    assert entry["status"] == "unreachable" and entry["snapshot"] is None
    snapshots = [h for h in second["hosts"] if h["snapshot"] is not None]
    assert [h["name"] for h in snapshots] == ["gpu-a", "gpu-b"]
    assert second["summary"]["hosts_up"] == len(snapshots) == 2
    third = fleetdoc.host_entry(lines[2], "gpu-c")
    assert third["status"] == "up" and third["snapshot"]["taken"] == 1002.0  # written once up


def test_replay_summary_and_diff_read_one_host_of_a_fleet_record(tmp_path, capsys):
    path = tmp_path / "fleet.jsonl"
    _write_record(path)
    src = RecordSource.open(path, host="gpu-c")
    assert len(src.frames) == 2 and not src.report.malformed  # down rounds are not errors
    snap, _ = src.load(1)
    assert snap.taken == 1002.0
    assert RecordSource.open(path, host="nobody").frames == []

    s = summary.summarize(path, host="gpu-b")
    assert s.snapshots == 3 and not s.unparseable
    every = summary.summarize_hosts(path)
    assert list(every) == list(HOSTS)
    assert [e.snapshots for e in every.values()] == [4, 3, 2]
    # without --host, a fleet line is not a snapshot: the plain reader says to name a host
    plain = summary.summarize(path)
    assert plain.snapshots == 0 and "--host" in plain.unparseable_why[1]

    before, _ = load_snapshot_arg(f"{path}@1", "gpu-a")
    after, name = load_snapshot_arg(f"{path}@-1", "gpu-a")
    assert (before["taken"], after["taken"], name) == (1001.0, 1004.0, f"{path}@-1")
    with pytest.raises(SnapshotError, match="no snapshot of host nobody"):
        load_snapshot_arg(f"{path}@1", "nobody")

    args = argparse.Namespace(before=f"{path}@1", after=f"{path}@-1", diff_json=False, host=None)
    assert diff_report.run(args) == 0
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if ln.startswith("== host")] == [
        f"== host {h} ==" for h in HOSTS
    ]
    assert "+3.0 GiB" in out  # gpu-a's memory used, 2 GiB -> 5 GiB


def test_a_fleet_json_document_is_read_per_host_by_diff(tmp_path):
    poller = FakePoller()
    raw = _doc(1000.0, 2.0)
    body = json.dumps(raw).encode()
    up = HostState(poller.targets[0], HostStatus.UP, None, read_document(raw), body, 1.0, 0.01, 1)
    down = HostState(poller.targets[1], HostStatus.REFUSED, "the host wants a token")
    doc = fleet_document((up, down), interval=1.0, timeout=1.0)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc, indent=2))
    got, _ = load_snapshot_arg(str(path), "gpu-a")
    assert got == raw
    with pytest.raises(SnapshotError, match=r"host gpu-b: refused \(the host wants a token\)"):
        load_snapshot_arg(str(path), "gpu-b")
    with pytest.raises(SnapshotError, match=r"name a host with --host \(gpu-a, gpu-b\)"):
        load_snapshot_arg(str(path))
    entries = list(iter_record(open(path, "rb"), "gpu-a"))  # noqa: SIM115
    assert len(entries) == 1 and entries[0].doc == raw


def test_record_and_fleet_record_never_append_to_each_others_files(tmp_path):
    """Catches a fleet line appended to a single-host record (replay would skip it as
    malformed) or the other way round."""
    fleet = tmp_path / "fleet.jsonl"
    _write_record(fleet, rounds=1)
    with pytest.raises(RecordError, match="not a gputaskman record file"):
        open_record(fleet)
    single = tmp_path / "one.jsonl"
    single.write_bytes(encode_line(_doc(1.0, 1.0)))
    with pytest.raises(RecordError, match="not a gputaskman fleet record file"):
        open_record(single, FLEET_LINE_PREFIX)
    os.close(open_record(fleet, FLEET_LINE_PREFIX))  # its own kind: fine


def test_a_torn_fleet_line_is_skipped_quietly(tmp_path):
    path = tmp_path / "fleet.jsonl"
    _write_record(path, rounds=2)
    data = path.read_bytes()
    path.write_bytes(data + data.splitlines(keepends=True)[0][:100])
    entries = list(iter_record(io.BytesIO(path.read_bytes()), "gpu-a"))
    assert [e.ok for e in entries] == [True, True, False] and entries[-1].incomplete


def test_a_record_line_holds_each_hosts_validated_bytes_as_one_ascii_line():
    """Catches a recorder that parses and encodes every body again (200 a second in a big
    fleet) and one whose line a body's newline or non-ASCII text would break: the bytes
    are spliced in as the host sent them, CR/LF (only whitespace in JSON) become spaces,
    and a non-ASCII body is encoded again as ASCII."""
    poller = FakePoller()
    raw = _doc(1000.0, 2.0)
    spaced = json.dumps(raw).encode()  # ", " and ": ": not how encode_line writes
    indented = json.dumps(raw, indent=1).replace("\n", "\r\n", 1).encode()
    noted = dict(raw, notes=["Grüße"])
    utf8 = json.dumps(noted, ensure_ascii=False).encode()
    bodies = (spaced, indented, utf8)
    states = tuple(
        HostState(t, HostStatus.UP, None, read_document(json.loads(b)), b, 1.0, 0.01, 1)
        for t, b in zip(poller.targets, bodies, strict=True)
    )
    line = fleet_line(states, interval=1.0, timeout=1.0, written={})
    assert line.isascii() and line.endswith(b"\n") and line.count(b"\n") == 1 and b"\r" not in line
    assert b'"snapshot":' + spaced + b"}" in line
    doc = fleetdoc.check_fleet(json.loads(line))
    assert [h["snapshot"] for h in doc["hosts"]] == [raw, raw, noted]
    assert doc == fleet_document(states, interval=1.0, timeout=1.0, taken=doc["taken"])
    again = fleet_line(states, interval=1.0, timeout=1.0, written=dict.fromkeys(HOSTS, 1))
    assert [h["snapshot"] for h in json.loads(again)["hosts"]] == [None, None, None]


def test_a_slow_fleet_round_skips_the_ticks_it_missed(tmp_path):
    """Catches a fleet recorder that bursts to catch up after a slow round (lines written
    back to back, each with the same states), as the single-host recorder never does."""
    now = [0.0]
    started: list[float] = []

    class Slow(FleetRecorder):
        def write_round(self) -> None:
            started.append(now[0])
            super().write_round()
            if len(started) == 2:
                now[0] += 2.5  # the second round takes 2.5 intervals

    def sleep(s: float) -> None:
        now[0] += s

    fd = open_record(tmp_path / "f.jsonl", FLEET_LINE_PREFIX)
    try:
        rec = Slow(fd, FakePoller(), interval=1.0, count=4, clock=lambda: now[0], sleep=sleep)  # type: ignore[arg-type]
        result = rec.run()
    finally:
        os.close(fd)
    assert started == [0.0, 1.0, 4.0, 5.0]  # the ticks at 2 and 3 skipped, not burst
    assert result.samples == 4 and result.stopped_by == "count"
    assert len((tmp_path / "f.jsonl").read_bytes().splitlines()) == 4
