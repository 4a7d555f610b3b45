"""The snapshot document's one reader (`document.reader`): what cannot be read is refused with
the place named, while what an older or newer writer left out or added is not; and documents
drawn from the packaged JSON Schema with every optional field set come back whole through
replay."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from gputaskman.base import schema
from gputaskman.base.readings import DeviceMetrics, Kind, Reason
from gputaskman.document.reader import SnapshotError, read_document
from gputaskman.offline.recorded import snapshot_from_json
from gputaskman.render import report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        (("processes", 0, "runtimes"), ["CUDA", 3], "runtimes: expected a list of strings"),
        (("processes", 0, "runtimes"), "CUDA", "runtimes: expected a list of strings"),
        (("processes", 0, "vram_bytes", "source"), 7, "vram_bytes.source: expected a string"),
        (("processes", 0, "vram_bytes", "detail"), [], "vram_bytes.detail: expected a string"),
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


def test_is_number_decides_as_math_isfinite_on_every_kind_of_value() -> None:
    """Catches the hot path of `is_number` (exact int and float types, decided without a
    call) answering otherwise than the rule it stands for: a real number, not a bool, that
    a float holds, finite; the boundaries are those of a float and of the fast int range."""
    import enum
    import math

    from gputaskman.document.jsonfields import is_number

    class Small(enum.IntEnum):
        A = 1

    class F(float):
        pass

    def rule(v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        try:
            return math.isfinite(v)
        except OverflowError:
            return False

    edge = 2**1024 - 2**970  # the least integer a float cannot hold
    values = [0, -0.0, 1, 1.5, 5e-324, 1.7976931348623157e308, math.inf, -math.inf, math.nan]
    values += [True, False, None, "1", [1], Small.A, F(2.0), F(math.inf)]
    values += [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, edge - 1, edge, -edge, 10**400]
    assert [is_number(v) for v in values] == [rule(v) for v in values]
    assert not is_number(edge) and is_number(edge - 2**970)


def test_a_reading_built_on_the_fast_path_is_the_reading_the_class_builds() -> None:
    """Catches `checked_reading` (the reader's fast path, which skips the checks it has
    already made) building a reading that differs from ``Reading(...)`` in any field, in
    equality or in hash, and the reader taking the fast path for what is not a reading."""
    from gputaskman.base.readings import Reading, checked_reading

    for args in [
        (5, Kind.MEASURED, "drm:fdinfo", None, None),
        (2.5, Kind.ESTIMATED, "gguf", None, "n_ctx 4096"),
        (None, Kind.RUNTIME, "llama.cpp", Reason.DENIED, "EACCES"),
    ]:
        fast, slow = checked_reading(*args), Reading(*args)
        assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
        assert (fast.value, fast.kind, fast.source, fast.reason, fast.detail) == args
    doc = _doc()
    r = doc["adapters"][0]["metrics"]["memory_used_bytes"]
    assert read_document(doc).adapters[0].metrics.memory_used_bytes == Reading(
        r["value"], Kind(r["kind"]), r["source"], None, r["detail"]
    )
    for bad in [{**r, "value": float("nan")}, {**r, "value": False}, {**r, "reason": "denied"}]:
        doc["adapters"][0]["metrics"]["memory_used_bytes"] = bad
        with pytest.raises(SnapshotError, match="memory_used_bytes"):
            read_document(doc)


# ---------------------------------------------------------------------------- the strategy
# Documents are drawn from the packaged schema itself. hypothesis-jsonschema, which would do
# that in general, does not run on the Hypothesis this workspace locks (its latest release,
# 0.23.1, calls `many.more()`, which Hypothesis no longer has), so `from_schema` below covers
# the keywords the snapshot schema uses and fails loudly on any other.

MAX_ITEMS = 2  # lists stay short: the point is every field, not many rows


def _every_field_set(node: Any) -> Any:
    """The schema with every optional field required and non-null: null dropped from each
    type list, ``oneOf`` and ``enum``; the keys of each described object required and no
    others; lists kept short. What is left is a subset of the schema, so a drawn document is
    one the schema accepts and that sets everything a reader could drop."""
    if isinstance(node, list):
        return [_every_field_set(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _every_field_set(v) for k, v in node.items()}
    if isinstance(out.get("type"), list):
        kinds = [t for t in out["type"] if t != "null"]
        out["type"] = kinds[0] if len(kinds) == 1 else kinds
    if "enum" in out:
        out["enum"] = [v for v in out["enum"] if v is not None]
    if "oneOf" in out:
        alts = [a for a in out.pop("oneOf") if a != {"type": "null"}]
        if len(alts) == 1:
            out.update(alts[0])
        else:
            out["oneOf"] = alts
    if "properties" in out:
        out["required"] = sorted(out["properties"])
        out.setdefault("additionalProperties", False)
    if out.get("type") == "array" or "items" in out:
        out["maxItems"] = MAX_ITEMS
    return out


def _reading(**value: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["value", "kind", "source", "reason", "detail"],
        "properties": {
            "kind": {"$ref": "#/$defs/kind"},
            "source": {"type": "string"},
            "detail": {"type": "string"},
            **value,
        },
    }


def _readings(names: tuple[str, ...]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(names),
        "properties": {n: {"$ref": "#/$defs/reading"} for n in names},
    }


def document_schema() -> dict[str, Any]:
    """`_every_field_set` of the packaged schema, with the overrides generation needs: a
    reading as its two shapes (a number, or null with a reason); metrics with the model's
    fields; a process's ``host`` left nullable (rows of this machine are where the host's
    RAM/CPU readings round-trip); and the values the writer writes in one way only (``"?"``
    for an owner marker, ``"settings"`` for an app's evidence, a non-empty
    ``processes_reason``)."""
    s = _every_field_set(schema.load())
    d = s["$defs"]
    d["reading"] = {
        "oneOf": [
            _reading(value={"type": "number"}, reason={"type": "null"}),
            _reading(value={"type": "null"}, reason={"$ref": "#/$defs/reason"}),
        ]
    }
    d["adapter"]["properties"]["metrics"] = _readings(DeviceMetrics.__slots__)
    d["process"]["properties"]["host"] = {"type": ["string", "null"]}
    d["breakdown"]["properties"]["owner_marker"] = {"const": "?"}
    d["app"]["properties"]["evidence"] = {"const": "settings"}
    d["system"]["properties"]["processes_reason"] = {"type": "string", "minLength": 1}
    # "reasons" is where early files kept why a system number was null
    for section in ("memory", "cpu"):
        d["system"]["properties"][section]["propertyNames"] = {"not": {"const": "reasons"}}
    return s


SIMPLE = {
    "string": st.text(max_size=6),
    "integer": st.integers(-(2**63), 2**64),
    "number": st.integers(-(2**63), 2**64) | st.floats(allow_nan=False, allow_infinity=False),
    "boolean": st.booleans(),
    "null": st.none(),
}
# The keywords `from_schema` draws for; annotations and the top level's own are ignored.
KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "maxItems"}
KEYWORDS |= {"enum", "const", "$ref", "oneOf", "minLength", "propertyNames"}
IGNORED = {"description", "title", "$schema", "$id", "$defs"}


def from_schema(node: Any, defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values `node` accepts, for the keywords `document_schema` leaves in it."""
    unknown = set(node) - KEYWORDS - IGNORED
    assert not unknown, f"from_schema does not handle {unknown}"
    if "$ref" in node:
        return from_schema(defs[node["$ref"].removeprefix("#/$defs/")], defs)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "oneOf" in node:
        return st.one_of([from_schema(a, defs) for a in node["oneOf"]])
    kind = node["type"]
    if isinstance(kind, list):
        return st.one_of([from_schema({**node, "type": k}, defs) for k in kind])
    if kind == "string" and "minLength" in node:
        return st.text(min_size=node["minLength"], max_size=6)
    if kind == "array":
        return st.lists(from_schema(node["items"], defs), max_size=node["maxItems"])
    if kind != "object":
        return SIMPLE[kind]
    if "properties" in node:  # `_every_field_set` made every key required, no others
        return st.fixed_dictionaries(
            {k: from_schema(v, defs) for k, v in node["properties"].items()}
        )
    banned = node.get("propertyNames", {}).get("not", {}).get("const")
    return st.dictionaries(
        st.text(max_size=6).filter(lambda k: k != banned),
        from_schema(node["additionalProperties"], defs),
        max_size=MAX_ITEMS,
    )


def _writer_reading(value: Any, kind: str, source: str, missing: str) -> dict[str, Any]:
    """A reading the writer derives from a count (a breakdown's totals, a memserver's
    borrower counts): its value is the count, the rest is the writer's."""
    if value is None:
        reason, detail = "unavailable", missing
    else:
        value, reason, detail = int(value), None, None
    return {"value": value, "kind": kind, "source": source, "reason": reason, "detail": detail}


def _as_the_writer_has_it(doc: dict[str, Any]) -> dict[str, Any]:
    """What of a drawn document only the writer decides: one row per (pid, started_at) and
    one adapter per address (the model keys them so); a host row's RAM/CPU (another OS's
    process has none of this machine's); the readings wrapped around counts."""
    doc = copy.deepcopy(doc)
    for i, a in enumerate(doc["adapters"]):
        a["pci_bus_id"] = f"{a['pci_bus_id']}/{i}"
    for i, p in enumerate(doc["processes"]):
        p["pid"] = p["pid"] * MAX_ITEMS + i
        if p["host"] is not None:
            for key in ("ram_bytes", "cpu_percent"):
                p[key] = {
                    "value": None,
                    "kind": "measured",
                    "source": report.HOST_SOURCE,
                    "reason": "unavailable",
                    "detail": f"a {p['host']} process: not in this machine's host sample",
                }
        b = p["breakdown"]
        total = b["reported_total"]["value"]
        b["reported_total"] = _writer_reading(
            total, "runtime", "sum of runtime-reported parts", "no part runtime-reported"
        )
        total = b["estimated_total"]["value"]
        b["estimated_total"] = _writer_reading(
            total, "estimated", "sum of estimated parts", "no part estimated"
        )
    for m in doc["system"]["duvm"]["lending"]:
        src = f"duvm memserver:{m['socket']}"
        count = m["borrowers_listed_of"]["value"]
        m["borrowers_listed_of"] = _writer_reading(count, "runtime", src, "not reported")
        for b in m["borrowers"]:
            count = b["connections"]["value"]
            b["connections"] = _writer_reading(count, "runtime", src, "not reported")
    return doc


# What the writer derives and the reader therefore does not read back: taken from the
# writer's own output for the same document, so the rest can be compared whole.
DERIVED = (
    "tool",
    "taken_iso",
    "available",
    "attributed_bytes",
    "attributed_complete",
    "owner_totals",  # measured VRAM by owner, from the rows
)
DERIVED_ADAPTER = ("attributed_bytes", "attributed_complete", "process_list", "health_state")


def _with_derived_of(doc: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    for key in DERIVED:
        doc[key] = written[key]
    for a, w in zip(doc["adapters"], written["adapters"], strict=True):
        for key in DERIVED_ADAPTER:
            a[key] = w[key]
        if a["mig"] is not None:  # a MIG instance's sums are derived too
            for i, wi in zip(a["mig"]["instances"], w["mig"]["instances"], strict=True):
                i["attributed_bytes"] = wi["attributed_bytes"]
                i["attributed_complete"] = wi["attributed_complete"]
    for p, w in zip(doc["processes"], written["processes"], strict=True):
        p["shown_vram"] = w["shown_vram"]
    return doc


_SCHEMA = document_schema()
DOCUMENTS = from_schema(_SCHEMA, _SCHEMA["$defs"]).map(_as_the_writer_has_it)


def _canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(DOCUMENTS)
def test_replay_loses_no_field_of_a_document_with_every_field_set(doc: dict[str, Any]) -> None:
    """Catches a reader that drops or alters a field wherever it sits, such as a process's
    `scan_detail` or a model's `header_error`, which are null in every fixture so a reader
    without them passes every other test: documents are drawn from the packaged JSON Schema
    with every optional field set (nested objects, breakdowns, app models, the host sample
    and its duvm pool included), read, turned into replay's objects, written by the report
    again, and must come back the same document (numbers of the same type) and the same
    `Document`."""
    assert schema.errors(doc) == []  # a document the schema accepts
    written = report.to_json_dict(*snapshot_from_json(doc), selected_gpu=doc["selected_gpu"])
    written = json.loads(json.dumps(written))
    doc = _with_derived_of(doc, written)
    assert _canonical(written) == _canonical(doc)
    assert read_document(written) == read_document(doc)


def test_the_strategy_sets_every_optional_field() -> None:
    """The draws above are worth something only if no optional field is left null: the
    transformed schema allows null nowhere except a reading's value or reason and a
    process's host."""
    nulls: list[str] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            t = node.get("type")
            if t == "null" or (isinstance(t, list) and "null" in t) or None in node.get("enum", ()):
                nulls.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(document_schema(), "")
    assert sorted(nulls) == [
        "/$defs/process/properties/host",
        "/$defs/reading/oneOf/0/properties/reason",
        "/$defs/reading/oneOf/1/properties/value",
    ]
