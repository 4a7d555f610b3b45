"""The JSON null rules, checked by walking whole `--json` objects."""

from __future__ import annotations

import json
from typing import Any

from gputaskman.fixtures.demo import BUS0, BUS1, DemoSystem, demo_snapshot, unavailable_snapshot
from gputaskman.render import report, text_report
from hypothesis import given
from hypothesis import strategies as st


def check_null_rules(doc: dict) -> None:
    assert report.null_rule_violations(doc) == []


def count_readings(node: Any) -> int:
    if isinstance(node, dict):
        if set(node) == {"value", "kind", "source", "reason", "detail"}:
            return 1
        return sum(count_readings(v) for v in node.values())
    if isinstance(node, list):
        return sum(count_readings(v) for v in node)
    return 0


def test_demo_snapshot_json_keeps_null_rules_everywhere():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem(), selected_gpu=None)
    check_null_rules(doc)
    assert count_readings(doc) > 40
    # survives a JSON round trip unchanged (record files store exactly this)
    assert json.loads(json.dumps(doc)) == doc


def test_hidden_memory_is_null_with_reason_not_zero():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem())
    py = next(p for p in doc["processes"] if p["pid"] == 5151)
    assert py["vram_bytes"]["value"] is None
    assert py["vram_bytes"]["reason"] == "hidden by driver"
    # the inferred value is shown, labelled inferred, but never summed
    assert py["shown_vram"]["kind"] == "inferred"
    bus0 = next(a for a in doc["adapters"] if a["pci_bus_id"] == BUS0)
    measured = [
        p["vram_bytes"]["value"]
        for p in doc["processes"]
        if p["gpu"] == BUS0 and p["vram_bytes"]["value"] is not None
    ]
    assert bus0["attributed_bytes"] == sum(measured)
    assert bus0["attributed_complete"] is False


def test_measured_zero_is_zero():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem())
    xorg = next(p for p in doc["processes"] if p["pid"] == 777)
    assert xorg["vram_bytes"] == {
        "value": 0,
        "kind": "measured",
        "reason": None,
        "detail": None,
        "source": "nvml:nvmlDeviceGetGraphicsRunningProcesses",
    }


def test_failed_process_list_is_reported_not_empty():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem())
    bus1 = next(a for a in doc["adapters"] if a["pci_bus_id"] == BUS1)
    assert bus1["process_list"]["compute"] == "ok"
    assert bus1["process_list"]["graphics"]["reason"] == "query failed"
    assert bus1["attributed_complete"] is False


def test_process_absent_from_host_sample_has_null_ram_with_reason():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem())
    whisper = next(p for p in doc["processes"] if p["pid"] == 9001)
    assert whisper["ram_bytes"]["value"] is None and whisper["ram_bytes"]["reason"]
    nohost = report.to_json_dict(demo_snapshot(), None)
    assert nohost["system"] is None
    assert all(p["ram_bytes"]["value"] is None for p in nohost["processes"])
    check_null_rules(nohost)


def test_unavailable_backend_json_says_why():
    doc = report.to_json_dict(unavailable_snapshot(), DemoSystem())
    assert doc["available"] is False
    assert doc["unavailable"]["reason"] == "library not found"
    assert doc["adapters"] == [] and doc["processes"] == []
    assert doc["attributed_bytes"] is None
    assert doc["system"]["memory"]["total_bytes"]["value"] == 32 * 1024**3
    check_null_rules(doc)


def test_model_and_breakdown_seams_are_present():
    doc = report.to_json_dict(demo_snapshot(), None)
    for p in doc["processes"]:
        assert "model" in p and p["breakdown"] is None
    llama = next(p for p in doc["processes"] if p["pid"] == 4242)
    assert llama["model"]["evidence"] == "mapped"


def test_render_text_shows_na_with_reason_and_never_zero_for_unknown():
    text = text_report.render_text(demo_snapshot(), DemoSystem())
    assert "n/a (hidden by driver)" not in text  # hidden shows its inferred value instead
    assert "~2.0 GiB" in text
    assert "enc n/a (not supported)" in text
    assert "processes.graphics [00000000:41:00.0]: query failed" in text
    assert "SYSTEM" in text and "cpu 37.5%" in text


def test_render_text_without_backend_says_why():
    text = text_report.render_text(unavailable_snapshot(), None)
    assert "GPU: none usable via nvml (library not found)" in text
    assert "NVML Shared Library Not Found" in text


def test_null_rule_checker_catches_each_violation():
    doc = report.to_json_dict(demo_snapshot(), None)
    row = doc["processes"][0]
    row["vram_bytes"] = {
        "value": 0,
        "kind": "measured",
        "source": "x",
        "reason": "hidden by driver",
        "detail": None,
    }
    row["ram_bytes"] = {
        "value": None,
        "kind": "measured",
        "source": "x",
        "reason": None,
        "detail": None,
    }
    row["cpu_percent"] = {
        "value": 1,
        "kind": "guessed",
        "source": "",
        "reason": None,
        "detail": None,
    }
    row["vram_total"] = 0  # a bare number standing for something
    problems = report.null_rule_violations(doc)
    assert any("vram_bytes: value 0 with reason" in p for p in problems)
    assert any("ram_bytes: null without a known reason" in p for p in problems)
    assert any("cpu_percent: unknown kind" in p for p in problems)
    assert any("cpu_percent: no source" in p for p in problems)
    assert any("vram_total: bare number 0" in p for p in problems)
    assert len(problems) == 5


def test_json_of_a_live_sample_on_this_machine_keeps_null_rules():
    from gputaskman.sampling.collector import Collector

    c = Collector(scan_budget=None)
    try:
        snap, system = c.sample_with_system()
    finally:
        c.close()
    doc = report.to_json_dict(snap, system)
    check_null_rules(doc)  # the system object included
    total = doc["system"]["memory"]["total_bytes"]
    assert total["kind"] == "measured" and total["source"] == "/proc/meminfo"
    assert total["value"] > 0
    if not snap.available:
        assert doc["unavailable"]["reason"] in {"library not found", "driver not loaded", "denied"}
        assert doc["attributed_bytes"] is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["value", "kind", "source", "reason", "detail", "pid", "x", "system"]),
            children,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@given(
    st.fixed_dictionaries(
        {
            "value": json_values,
            "kind": json_values,
            "source": json_values,
            "reason": json_values,
            "detail": json_values,
        }
    )
)
def test_null_rule_checker_never_crashes_on_malformed_readings(reading):
    out = report.null_rule_violations({"processes": [{"vram_bytes": reading}]})
    assert isinstance(out, list)


@given(json_values)
def test_null_rule_checker_never_crashes_on_any_json(doc):
    out = report.null_rule_violations({"doc": doc} if not isinstance(doc, dict) else doc)
    assert isinstance(out, list) and all(isinstance(x, str) for x in out)
