"""The snapshot document's JSON Schema (gputaskman/snapshot.schema.json, draft 2020-12): it is a
valid schema shipped in the package, generated from the msgspec Structs the reader decodes into
(document/docshape.py, by tools/snapshot_schema.py), it accepts what gputaskman writes (the live
`--json` of this machine, every `record` line, the demo, the mocked NVML documents; the platform
tests check their own backends' documents), every key the writer writes is declared there and
every key declared there is written, and it is strict where the rules are."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from gputaskman.base import schema
from gputaskman.base.readings import Kind, Reason
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot, unavailable_snapshot
from gputaskman.intel import gguf, llm
from gputaskman.intel.evidence import Evidence, Source, assess
from gputaskman.render import report
from gputaskman.render.report_models import breakdown_json
from jsonschema import Draft202012Validator

_spec = importlib.util.spec_from_file_location(
    "mocked_snapshots", Path(__file__).with_name("mocked_snapshots.py")
)
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)


def gtm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", *args], capture_output=True, text=True, timeout=120
    )


_gspec = importlib.util.spec_from_file_location(
    "gguf_files", Path(__file__).with_name("gguf_files.py")
)
gguf_files = importlib.util.module_from_spec(_gspec)
_gspec.loader.exec_module(gguf_files)


@pytest.fixture
def demo_doc(tmp_path: Path) -> dict[str, Any]:
    """The demo document, its first process given a real breakdown (a GGUF file written with
    the gguf package, a llama.cpp buffer log, measured bytes): every part of the document."""
    doc = json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))
    model = tmp_path / "qwen.gguf"
    gguf_files.write_model(model, "qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=1024)
    claim = assess(
        [Evidence(Source.MAPPED, path=str(model)), Evidence(Source.CMDLINE, path=str(model))]
    )[0]
    log = "sched_reserve:        CPU compute buffer size =     0.70 MiB\n"
    view = llm.build_view(
        claim,
        header=gguf.read_header(model),
        buffers=llm.parse_buffer_log(log, "/tmp/srv.log"),
        runtime="llama.cpp",
        argv=["llama-server", "-m", str(model), "-c", "512"],
        measured_bytes=64 << 20,
    )
    doc["processes"][0]["breakdown"] = json.loads(json.dumps(breakdown_json(view)))
    return doc


def test_the_schema_is_valid_and_ships_in_the_package() -> None:
    s = schema.load()
    Draft202012Validator.check_schema(s)
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert Path(schema.__file__).with_name(schema.SCHEMA_FILE).is_file()


ROOT = Path(__file__).resolve().parents[3]
_tspec = importlib.util.spec_from_file_location(
    "snapshot_schema", ROOT / "tools" / "snapshot_schema.py"
)
generator = importlib.util.module_from_spec(_tspec)
_tspec.loader.exec_module(generator)


def test_the_schema_is_the_one_the_structs_generate() -> None:
    """Catches the schema and the reader's Structs drifting apart: a field added to, renamed
    in or retyped in a `docshape` Struct, or a writer's promise annotated there (`ALWAYS`,
    `SET`, a list of values), without the file written again by tools/snapshot_schema.py, and
    a hand edit of the file (planted: a Struct field added; ``cpu_percent`` renamed in the
    file)."""
    assert schema.schema_text().splitlines() == generator.text().splitlines(), (
        "run: uv run python tools/snapshot_schema.py"
    )


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if "$ref" in node else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def test_every_reference_is_defined_and_every_definition_used() -> None:
    """Catches a ``$ref`` to a definition the generator did not write (a validator fails only
    on a document that reaches it) and a definition nothing refers to."""
    s = schema.load()
    assert {f"#/$defs/{name}" for name in s["$defs"]} == _refs(s)


def test_its_enumerations_are_the_codes() -> None:
    """Catches a kind, reason or evidence source added in the code but not the schema (its
    documents would then fail validation) or the other way round."""
    defs = schema.load()["$defs"]
    assert defs["kind"]["enum"] == [str(k) for k in Kind]
    assert defs["reason"]["enum"] == [str(r) for r in Reason]
    assert defs["evidence_source"]["enum"] == [str(s) for s in Source]


def test_what_gputaskman_writes_is_valid(tmp_path: Path, demo_doc: dict[str, Any]) -> None:
    live = gtm("--json")
    assert live.returncode == 0, live.stderr
    docs = {"live --json": json.loads(live.stdout)}
    rec = tmp_path / "run.jsonl"
    res = gtm("record", "--interval", "0.2", "--count", "3", str(rec))
    assert res.returncode == 0, res.stderr
    lines = rec.read_text().splitlines()
    assert len(lines) == 3
    docs |= {f"record line {i}": json.loads(line) for i, line in enumerate(lines)}
    docs["demo with a breakdown"] = demo_doc
    docs["demo, no host sample"] = report.to_json_dict(demo_snapshot(), None)
    docs["no backend"] = report.to_json_dict(unavailable_snapshot(), DemoSystem())
    docs["mocked NVML"] = ms.doc(
        ms.snapshot(ms.T0, procs=[ms.proc(10, 3 * ms.GIB), ms.proc(11, None)])
    )
    for name, doc in docs.items():
        assert schema.errors(doc) == [], name


def _first_reading(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["adapters"][0]["metrics"]["memory_used_bytes"]


@pytest.mark.parametrize(
    "break_it,where",
    [
        (lambda d: _first_reading(d).update(kind="guessed"), "kind"),  # a made-up kind
        (lambda d: _first_reading(d).update(reason="unavailable"), "reason"),  # value + reason
        (lambda d: _first_reading(d).update(value=None), "reason"),  # null without a reason
        (lambda d: _first_reading(d).update(value=None, reason="felt like it"), "reason"),
        (lambda d: _first_reading(d).pop("detail"), "memory_used_bytes"),  # a key missing
        (lambda d: _first_reading(d).update(extra=1), "memory_used_bytes"),  # a key too many
        (lambda d: _first_reading(d).update(value="12"), "value"),  # a number as text
        (lambda d: _first_reading(d).update(value=True), "value"),  # a bool is no number
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d["processes"][0].update(vram_bytes=0), "vram_bytes"),  # a bare number
        (lambda d: d["processes"][0]["breakdown"]["parts"].pop("other"), "breakdown"),
        (lambda d: d["system"]["swap"].update(used_bytes=None), "used_bytes"),
    ],
)
def test_it_is_strict_where_the_rules_are(break_it, where: str, demo_doc: dict[str, Any]) -> None:
    doc = demo_doc
    assert schema.errors(doc) == []
    assert doc["processes"][0]["breakdown"] is not None  # the demo has a breakdown to break
    bad = copy.deepcopy(doc)
    break_it(bad)
    found = schema.errors(bad)
    assert found, "the schema accepted a broken document"
    assert any(where in e for e in found), found


def test_new_keys_are_allowed_outside_readings(demo_doc: dict[str, Any]) -> None:
    """Within schema_version 1 keys may be added (report.py's compatibility rule)."""
    doc = demo_doc
    doc["added_later"] = {"x": 1}
    doc["processes"][0]["added_later"] = True
    assert schema.errors(doc) == []


def _r(v: float, kind: str = "measured") -> dict[str, Any]:
    return {"value": v, "kind": kind, "source": "test", "reason": None, "detail": None}


def test_replay_loses_no_field_that_is_set(demo_doc: dict[str, Any]) -> None:
    """Catches a reader (document/reader.py) that drops a field which is null in every fixture,
    such as `scan_detail` or `header_error`: here every optional field of one process is set, the
    breakdown and an app model included, and reading the document back for replay must give
    the same document. (Host rows, `host` and `parent_pid`, round-trip in test_platform_wiring
    with documents a WSL backend wrote.)"""
    from gputaskman.offline.recorded import snapshot_from_json

    doc = demo_doc
    p = doc["processes"][0]
    p.update(
        vram_inferred_bytes=_r(123 << 20, "inferred"),
        inferred_unique=True,
        paged_bytes=_r(5 << 20),
        footprint_bytes=_r(7 << 20),
        scan_reason="denied",
        scan_detail="maps unreadable",
        exe="/usr/bin/llama-server",
        user="alice",
        ppid=1,
        mig={"gpu_instance_id": 1, "compute_instance_id": 0},
        swapped_bytes={**_r(3 << 20), "detail": "/dev/nbd0, the only active swap device"},
        swapped_to="pool",
        locked_bytes=_r(4 << 20),
        pinned_bytes=_r(0),
        owner={
            "cgroup": "/kubepods/burstable/pod1234abcd-0000-4000-8000-00000000000a/" + "a" * 64,
            "user": "alice",
            "pod_uid": "1234abcd-0000-4000-8000-00000000000a",
            "pod_namespace": "ml",
            "pod_name": "trainer-0",
            "pod_source": "/var/log/pods",
            "qos": "burstable",
            "container_id": "a" * 64,
            "container_runtime": "containerd",
            "slurm_job": "77",
            "slurm_step": "batch",
            "unit": "x.scope",
            "user_unit": True,
            "session": "3",
            "reason": "denied",
            "detail": "for the test",
        },
        model_evidence=[{"evidence": "mapped", "path": "/m/a.gguf"}],
        app_model={
            "app": "Handy",
            "selected": "whisper-small",
            "evidence": "settings",
            "last_event": "transcribed",
            "last_event_model": "whisper-small",
            "last_event_time": "2026-12-01T10:00:00Z",
            "reasons": ["settings file"],
        },
    )
    p["model"].update(
        header_error="truncated header",
        api={"runtime": "llama.cpp", "endpoint": "127.0.0.1:8080", "errors": ["timeout"]},
    )
    assert schema.errors(doc) == []
    unset = [k for k, v in p.items() if v is None and k not in ("host", "parent_pid")]
    assert unset == [], unset  # every optional field of the row is set
    back = json.loads(json.dumps(report.to_json_dict(*snapshot_from_json(doc))))
    # owner_totals is derived from the rows (never read back): the row's pod is there now
    assert any(t["owner"] == p["owner"]["pod_uid"] for t in back.pop("owner_totals"))
    doc.pop("owner_totals")
    assert back == doc


# ---------------------------------------------------------------------------- the writer's keys


def _node(s: dict[str, Any], owner: str) -> tuple[dict[str, Any], str]:
    """`s` with a ``$ref`` followed, and the name of the object it declares: the definition's
    name, else the path of keys from the nearest one."""
    if "$ref" in s:
        name = s["$ref"].removeprefix("#/$defs/")
        return schema.load()["$defs"][name], name
    return s, owner


def _declared(s: dict[str, Any], owner: str, out: set[str]) -> None:
    """Adds ``object.key`` for every key the schema declares below `s`."""
    s, owner = _node(s, owner)
    for alt in s.get("oneOf", ()):
        _declared(alt, owner, out)
    for key, sub in s.get("properties", {}).items():
        out.add(f"{owner}.{key}")
        _declared(sub, f"{owner}.{key}", out)
    if isinstance(s.get("additionalProperties"), dict):
        _declared(s["additionalProperties"], f"{owner}.*", out)
    if "items" in s:
        _declared(s["items"], f"{owner}[]", out)


def _container(s: dict[str, Any], node: Any) -> bool:
    kinds = s.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    return ("object" in kinds or "properties" in s) if isinstance(node, dict) else "array" in kinds


def _written(
    s: dict[str, Any], owner: str, node: Any, out: set[str], stray: list[str], where: str
) -> None:
    """Adds ``object.key`` for every key `node` holds where `s` declares it, and the path
    of every other key to `stray`."""
    if not isinstance(node, (dict, list)):
        return
    s, owner = _node(s, owner)
    if "oneOf" in s:
        for alt in s["oneOf"]:
            if _container(_node(alt, owner)[0], node):
                _written(alt, owner, node, out, stray, where)
        return
    if isinstance(node, list):
        for i, v in enumerate(node):
            _written(s["items"], f"{owner}[]", v, out, stray, f"{where}[{i}]")
        return
    props, more = s.get("properties", {}), s.get("additionalProperties")
    for key, v in node.items():
        if key in props:
            out.add(f"{owner}.{key}")
            _written(props[key], f"{owner}.{key}", v, out, stray, f"{where}.{key}")
        elif isinstance(more, dict):
            _written(more, f"{owner}.*", v, out, stray, f"{where}.{key}")
        else:
            stray.append(f"{where}.{key}")


def _writer_documents(tmp_path: Path, demo_doc: dict[str, Any]) -> dict[str, Any]:
    """Documents from every writer path the fixtures reach: the recordings (the demo with a
    breakdown, an app model, every optional process field and a duvm pool; the DRM fixture
    tree) as recorded and as the writer writes them again in replay, the demo with and
    without a host sample, no backend, mocked NVML, and the DRM fixture tree sampled now."""
    from gputaskman.fixtures.drm_fixtures import write_demo_tree
    from gputaskman.offline.recorded import snapshot_from_json
    from gputaskman.sampling.collector import sysroot_collector

    docs: dict[str, Any] = {}
    for path in sorted((Path(__file__).parent / "recordings").glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            doc = json.loads(line)
            docs[f"{path.name}:{i + 1}"] = doc
            again = report.to_json_dict(*snapshot_from_json(doc), selected_gpu=doc["selected_gpu"])
            docs[f"{path.name}:{i + 1} replayed"] = again
    docs["demo with a breakdown"] = demo_doc
    docs["demo, no host sample"] = report.to_json_dict(demo_snapshot(), None)
    docs["no backend"] = report.to_json_dict(unavailable_snapshot(), DemoSystem())
    docs["mocked NVML"] = ms.doc(
        ms.snapshot(ms.T0, procs=[ms.proc(10, 3 * ms.GIB), ms.proc(11, None)])
    )
    docs["mocked NVML, MIG and health"] = _mig_and_health_doc()
    write_demo_tree(tmp_path)
    collector = sysroot_collector(str(tmp_path), scan_budget=None)
    try:
        docs["DRM fixture tree"] = report.to_json_dict(*collector.sample_with_system())
    finally:
        collector.close()
    return {name: json.loads(json.dumps(doc)) for name, doc in docs.items()}


def _mig_and_health_doc() -> dict[str, Any]:
    """The second sample of a mocked NVML GPU in MIG mode (one instance, one process) with
    health counters, a thermal slowdown and an XID event: every health and MIG key written."""
    from types import SimpleNamespace

    import test_nvml_mocked as nv
    from gputaskman.backends.nvml import NvmlBackend
    from gputaskman.sampling.collector import Collector, NullScanner

    ghost = 2**22 + 7  # above pid_max: no process of this machine's
    mig = [nv.mig_device(1, 0, 40 << 30, 1 << 30, [nv.proc(ghost, 1 << 30)])]
    dev = nv.device(
        nv.BUS_A, mig_mode=[1, 1], mig=mig, fields={3: 0, 4: 1}, clock_reasons=0x40, fan=50
    )
    lib = nv.MockedNvml([dev])
    c = Collector(source=NvmlBackend(lib), scanner=NullScanner())
    c.sample()
    lib.pending_events = [SimpleNamespace(device=0, eventType=0x8, eventData=79)]
    return report.to_json_dict(c.sample(), None)


# Declared keys no fixture's writer path writes, and why each may stay.
NOT_WRITTEN_BY_THE_FIXTURES = {
    "system.processes_reason": "written only when the host sample could not read the process"
    " list itself (`host.SystemInfo.processes_reason`), which no fixture's host sample lacks",
}


def test_every_key_written_is_declared_and_every_declared_key_written(
    tmp_path: Path, demo_doc: dict[str, Any]
) -> None:
    """Catches the writer and the Structs drifting apart: a key the writer writes that no
    Struct declares (the reader would skip it, the schema would not describe it; planted:
    a process key added to `report.process_json` only) and a key a Struct declares that no
    writer path writes (planted: a field added to a Struct only), outside the listed ones."""
    written: set[str] = set()
    stray: list[str] = []
    for name, doc in _writer_documents(tmp_path, demo_doc).items():
        assert schema.errors(doc) == [], name
        _written(schema.load(), "document", doc, written, stray, name)
    assert stray == []
    declared: set[str] = set()
    _declared(schema.load(), "document", declared)
    assert sorted(declared - written) == sorted(NOT_WRITTEN_BY_THE_FIXTURES)
