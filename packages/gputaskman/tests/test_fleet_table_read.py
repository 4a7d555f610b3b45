"""The fleet table's part of a document (`reader.read_table_document`): what a poller
that shows only the table reads of every host, and the whole document of the host that is
open. The table's rows and totals must be those of the whole document, for every recording
and fixture and for documents drawn from the schema with every field set; and a poller
reading only the table's part reads the open host whole, at once, from a real serve."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import read_document, read_table_document
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.fleet.poller import HostState, Poller
from gputaskman.fleet.targets import parse_target
from gputaskman.fleet.view import fleet_rows, fleet_totals, render_text
from gputaskman.render import report
from hypothesis import HealthCheck, given, settings
from test_document import DOCUMENTS

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fleet_helpers import Serve, wait_for  # noqa: E402


def _without_models() -> bytes:
    """The demo with no process's model known: the MODELS cell falls back to an app's
    selected model, else the mapped model files' names."""
    doc = json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))
    for i, p in enumerate(doc["processes"]):
        p["model"] = None
        p["model_files"] = [f"/models/file-{i}.gguf"]
        if i % 2:
            p["app_model"] = {"app": "lmstudio", "selected": f"selected-{i}"}
    return json.dumps(doc).encode()


def _bodies() -> list[bytes]:
    out = [json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())).encode()]
    out.append(_without_models())
    for path in sorted((HERE / "recordings").glob("*.jsonl")):
        out += [ln for ln in path.read_bytes().splitlines() if ln.strip()]
    return out


def _table(body: bytes) -> tuple:
    """What the fleet shows of one host: its rows (every cell), text and totals."""
    states = [
        HostState(parse_target("gpu1"), HostStatus.UP, None, doc)
        for doc in (read_document(body), read_table_document(body))
    ]
    return tuple(
        (
            [
                (r.key, r.gpu, r.memory_used, r.memory_total, r.util, r.processes, r.models)
                for r in fleet_rows([s])
            ],
            fleet_totals([s]),
            render_text([s]),
        )
        for s in states
    )


@pytest.mark.parametrize("i", range(len(_bodies())))
def test_every_recording_s_table_is_the_whole_document_s(i):
    """Catches a field the table shows that the table's read leaves out (a model, a
    breakdown's estimated total in the fleet's "apart" sum); a process without a model
    included (its mapped files and an app's selected model are not the table's)."""
    whole, table = _table(_bodies()[i])
    assert table == whole


@given(DOCUMENTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_document_with_every_field_set_gives_the_same_table(doc):
    whole, table = _table(json.dumps(doc).encode())
    assert table == whole


def test_the_table_s_part_leaves_out_what_no_table_shows():
    body = _bodies()[0]
    whole, part = read_document(body), read_table_document(body)
    assert whole.system is not None and part.system is None
    assert any(p.proc.detail.cmdline for p in whole.processes)
    assert not any(p.proc.detail.cmdline for p in part.processes)


@pytest.mark.slow
def test_an_open_host_is_read_whole_at_once_and_the_others_stay_the_table_s():
    """Catches a poller that keeps showing the table's part of the host that is open (its
    view would have no command lines, no system panel), or one that reads every host whole
    (the cost the table's read saves)."""
    serves = [Serve(["--demo"]).start(), Serve(["--demo"]).start()]
    poller = None
    try:
        for s in serves:
            s.ready()
        targets = [parse_target(f"127.0.0.1:{s.port}") for s in serves]
        poller = Poller(targets, interval=0.3, table_only=True)
        poller.start()
        assert poller.wait_polled(10)
        wait_for(lambda: all(s.up for s in poller.states()), 10, "both hosts up")
        assert all(not s.whole and s.document.system is None for s in poller.states())
        name = targets[0].name
        poller.focus(name)
        wait_for(lambda: poller.states()[0].whole, 5, "the open host read whole")
        seq = poller.states()[0].seq
        wait_for(lambda: poller.states()[0].seq >= seq + 2, 10, "two new samples of it")
        opened, other = poller.states()
        assert opened.whole and opened.document.system is not None and opened.up
        assert any(p.proc.detail.cmdline for p in opened.document.processes)
        assert not other.whole and other.document.system is None
    finally:
        if poller is not None:
            poller.stop()
        for s in serves:
            s.stop()
