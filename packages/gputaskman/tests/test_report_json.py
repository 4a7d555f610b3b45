"""The JSON null rules, checked by walking whole `--json` objects."""

from __future__ import annotations

import json
from typing import Any

from gputaskman import report
from gputaskman.demo import BUS0, BUS1, DemoSystem, demo_snapshot, unavailable_snapshot
from gputaskman.model import Kind, Reason

KINDS = {str(k) for k in Kind}
REASONS = {str(r) for r in Reason}
READING_KEYS = {"value", "kind", "source", "reason", "detail"}
# Plain numbers allowed outside reading objects: identities, times, and measured sums.
PLAIN_NUMBER_KEYS = {
    "schema_version",
    "taken",
    "index",
    "pid",
    "started_at",
    "attributed_bytes",
    "selected_gpu",
}


def walk(node: Any, path: str, readings: list, plain: list) -> None:
    if isinstance(node, dict):
        if set(node) == READING_KEYS:
            readings.append((path, node))
            return
        for k, v in node.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                plain.append((f"{path}.{k}", k, v))
            walk(v, f"{path}.{k}", readings, plain)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                plain.append((f"{path}[{i}]", None, v))
            walk(v, f"{path}[{i}]", readings, plain)


def check_null_rules(doc: dict, system_prefix: str = "$.system") -> list:
    readings: list = []
    plain: list = []
    walk(doc, "$", readings, plain)
    for path, r in readings:
        assert r["kind"] in KINDS, path
        assert isinstance(r["source"], str) and r["source"], path
        if r["value"] is None:
            assert r["reason"] in REASONS, f"{path}: null without a reason"
        else:
            assert r["reason"] is None, f"{path}: value with a reason"
            assert isinstance(r["value"], (int, float)) and not isinstance(r["value"], bool)
    for path, key, _v in plain:
        if path.startswith(system_prefix):
            continue  # host.py owns its object; its tests check it
        assert key in PLAIN_NUMBER_KEYS, f"{path}: bare number outside a reading"
    return readings


def test_demo_snapshot_json_keeps_null_rules_everywhere():
    doc = report.to_json_dict(demo_snapshot(), DemoSystem(), selected_gpu=None)
    readings = check_null_rules(doc)
    assert len(readings) > 40
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
    assert doc["system"]["ram_total_bytes"]["value"] == 32 * 1024**3
    check_null_rules(doc)


def test_model_and_breakdown_seams_are_present():
    doc = report.to_json_dict(demo_snapshot(), None)
    for p in doc["processes"]:
        assert "model" in p and p["breakdown"] is None
    llama = next(p for p in doc["processes"] if p["pid"] == 4242)
    assert llama["model"]["evidence"] == "mapped"


def test_render_text_shows_na_with_reason_and_never_zero_for_unknown():
    text = report.render_text(demo_snapshot(), DemoSystem())
    assert "n/a (hidden by driver)" not in text  # hidden shows its inferred value instead
    assert "~2.0 GiB" in text
    assert "enc n/a (not supported)" in text
    assert "processes.graphics [00000000:41:00.0]: query failed" in text
    assert "SYSTEM" in text and "cpu 37.5%" in text


def test_render_text_without_backend_says_why():
    text = report.render_text(unavailable_snapshot(), None)
    assert "GPU: none usable via nvml (library not found)" in text
    assert "NVML Shared Library Not Found" in text
