"""The snapshot document's one reader (`core.document`): what cannot be read is refused with
the place named, while what an older or newer writer left out or added is not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from gputaskman.base.readings import Kind, Reason
from gputaskman.core import report
from gputaskman.core.document import SnapshotError, read_document
from gputaskman.offline.recorded import snapshot_from_json

# ---------------------------------------------------------------------------- refusing


def _doc() -> dict[str, Any]:
    from gputaskman.fixtures.demo import DemoSystem, demo_snapshot

    return json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        (("processes", 0, "gpu"), 3, "processes[0].gpu: expected a string or null, got int"),
        (("processes", 1, "pid"), "5151", "processes[1].pid: expected an integer, got str"),
        (("adapters", 0, "metrics", "power_w", "kind"), "guessed", "power_w.kind: 'guessed'"),
        (("processes", 0, "model", "name"), None, "processes[0].model.name: expected a string"),
        (("system", "memory", "used_bytes"), "12 GiB", "system.memory.used_bytes: expected"),
        (("processes", 0, "vram_bytes", "value"), True, "vram_bytes.value: True is not a number"),
    ],
)
def test_what_cannot_be_read_is_refused_naming_the_place(where, value, message) -> None:
    """Catches a reader that guesses (a bool read as 1, a string PID, a made-up kind) or fails
    with a bare KeyError/TypeError: a wrong value is a `SnapshotError` saying where it is."""
    doc = _doc()
    node: Any = doc
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    with pytest.raises(SnapshotError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_document(doc)


def test_a_required_key_that_is_missing_is_named() -> None:
    doc = _doc()
    del doc["processes"][2]["vram_bytes"]
    with pytest.raises(SnapshotError, match=r"processes\[2\].vram_bytes: missing"):
        read_document(doc)


def test_absent_optional_keys_and_new_keys_are_not_errors() -> None:
    """Schema version 1 grows by adding keys: a file written before a key existed (here
    every optional key of a process row is gone) and one written after a key was added (an
    unknown key anywhere) both read, the absent values as unknown."""
    doc = _doc()
    required = {"pid", "vram_bytes"}
    for p in doc["processes"]:
        for key in [k for k in p if k not in required]:
            del p[key]
    doc["added_later"] = {"x": 1}
    doc["adapters"][0]["added_later"] = [1, 2]
    got = read_document(doc)
    p = got.processes[0].proc
    assert (p.name, p.adapter, p.create_time, p.model, p.breakdown) == (
        None,
        None,
        None,
        None,
        None,
    )
    assert got.processes[0].ram_bytes is None and p.detail.cmdline is None
    assert got.adapters[0].metrics is not None


def test_unknown_reasons_and_early_system_numbers_are_kept_in_words() -> None:
    """Catches a reader that drops a reason it does not know (the reading would become
    unexplained) or the bare numbers of files written before system numbers were readings."""
    doc = _doc()
    doc["adapters"][0]["metrics"]["encoder_percent"]["reason"] = "fell asleep"
    doc["system"]["memory"] = {
        "used_bytes": 5,
        "free_bytes": None,
        "reasons": {"free_bytes": "denied"},
    }
    got = read_document(doc)
    enc = got.adapters[0].metrics.encoder_percent
    assert enc.reason is Reason.UNAVAILABLE and "recorded reason: fell asleep" in enc.detail
    mem = got.system.memory
    assert mem["used_bytes"].value == 5 and mem["used_bytes"].kind is Kind.MEASURED
    assert mem["free_bytes"].reason is Reason.DENIED and "reasons" not in mem
    # the system panel shows what the file does not hold as unknown, never 0
    _, system = snapshot_from_json(doc)
    text = "\n".join(system.render_lines())
    assert "RAM   used 5 B / n/a (unavailable)" in text


def test_a_number_no_float_holds_is_refused_not_a_crash(tmp_path) -> None:
    """Catches `is_number` letting a 400-digit integer through (``math.isfinite`` raises
    OverflowError on it): such a `taken` made summary and replay crash on the whole file
    instead of skipping the line; as a reading's value it must be refused, not summed."""
    from gputaskman.offline import summary

    huge = 10**400
    doc = _doc()
    doc["adapters"][0]["metrics"]["memory_used_bytes"]["value"] = huge
    with pytest.raises(SnapshotError, match=r"memory_used_bytes\.value"):
        read_document(doc)
    rec = tmp_path / "r.jsonl"
    rec.write_text(json.dumps(_doc()) + "\n" + json.dumps({**_doc(), "taken": huge}) + "\n")
    s = summary.summarize(rec)
    assert s.snapshots == 1 and s.unparseable == [2]
    assert "taken" in s.unparseable_why[2] and "not a finite number" in s.unparseable_why[2]
