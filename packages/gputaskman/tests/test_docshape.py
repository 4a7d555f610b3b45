"""The typed decoder of the snapshot document (`docshape` Structs, built into a `Document` by
`reader.read_document`) against the reference reader over the parsed object
(`docfields.read_parsed`): the same `Document` (compared by repr, so 1 and 1.0 differ) for
every recording and fixture and for drawn documents, and the same refusal, word for word,
for documents with a wrong value anywhere."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from doc_paths import json_paths
from gputaskman.document.docfields import read_parsed
from gputaskman.document.docshape import DOC_DECODER
from gputaskman.document.docvalues import Refused
from gputaskman.document.jsonfields import parse_json
from gputaskman.document.reader import (
    Document,
    NotASnapshot,
    SnapshotError,
    _document,
    read_document,
)
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.render import report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_document import DOCUMENTS

HERE = Path(__file__).parent


def _lines() -> list[bytes]:
    out = [json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())).encode()]
    for path in sorted((HERE / "recordings").glob("*.jsonl")):
        out += [line for line in path.read_bytes().splitlines() if line.strip()]
    return out


LINES = _lines()


def _fast(body: bytes) -> Document | None:
    """The typed path alone (no fallback); None where it leaves the document to the
    reference reader."""
    try:
        return _document(DOC_DECODER.decode(body))
    except (msgspec.MsgspecError, Refused, SnapshotError):
        return None


def _outcome(read: Any, arg: Any) -> str:
    try:
        return repr(read(arg))
    except SnapshotError as exc:
        return f"{type(exc).__name__}: {exc}"


def _reference(body: bytes) -> str:
    return _outcome(read_parsed, parse_json(body))


@pytest.mark.parametrize("i", range(len(LINES)))
def test_every_recording_reads_the_same_on_the_typed_path(i: int) -> None:
    """Catches a Struct field or a build step that differs from the reference reader on a
    real document (planted: a process's ``ram_bytes`` read from ``cpu_percent``), and a
    recording that silently leaves the typed path (it would be read, only slower)."""
    body = LINES[i]
    fast = _fast(body)
    assert fast is not None, "a recording must not need the fallback"
    want = _reference(body)
    assert repr(fast) == want
    assert repr(read_document(body)) == want
    assert repr(read_document(parse_json(body))) == want  # a dict: msgspec.convert


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(DOCUMENTS)
def test_a_document_with_every_field_set_reads_the_same_on_the_typed_path(doc: dict) -> None:
    """Catches a field the recordings leave null read wrongly or dropped by the build
    (planted: a model's ``header_error`` not passed on), on documents drawn from the JSON
    Schema with every optional field set."""
    body = json.dumps(doc).encode()
    fast = _fast(body)
    assert fast is not None
    assert repr(fast) == _reference(body)


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.just(10**400),  # valid JSON, no float holds it: refused
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["denied", "fell asleep", "measured", "runtime", "\udcff"]),
    st.just([]),
    st.just({}),
    st.just(["a", 3]),
    st.just({"value": 1, "kind": "measured", "source": "s", "reason": "denied"}),
    st.just({"value": None, "kind": "measured", "source": "s", "reason": "new reason"}),
)
DELETE = object()


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return doc if value is DELETE else value
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is not DELETE:
        node[path[-1]] = value
    elif isinstance(node, dict):
        del node[path[-1]]
    return doc


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(LINES))), st.data())
def test_a_wrong_value_anywhere_is_read_or_refused_as_the_reference_does(which, data) -> None:
    """Catches the typed path accepting what the reference refuses (planted: a reading with
    neither value nor reason let through) or reading it differently, and a refusal worded
    otherwise than the reference words it (`read_document` on bytes and on a dict)."""
    doc = parse_json(LINES[which])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(json_paths(doc)))
        doc = _replace(doc, path, data.draw(st.one_of(HOSTILE, st.just(DELETE))))
    body = json.dumps(doc).encode()
    want = _reference(body)
    fast = _fast(body)
    if fast is not None:
        assert repr(fast) == want
    assert _outcome(read_document, body) == want
    assert _outcome(read_document, doc) == want  # a dict, or the value it was replaced by


def _demo() -> dict[str, Any]:
    return parse_json(LINES[0])


def test_what_msgspec_does_not_take_is_read_by_the_reference_reader() -> None:
    """Catches a document that reads today and stops reading on the typed path: a lone
    surrogate (msgspec refuses it, ``json.loads`` keeps it) and a byte-order mark fall back
    and read; integers beyond 64 bits read exactly on the typed path; 1e400 in a reading
    and NaN are refused, as the reference refuses them."""
    doc = _demo()
    doc["processes"][0]["name"] = "\udcff"
    body = json.dumps(doc).encode()
    assert _fast(body) is None
    assert read_document(body).processes[0].proc.name == "\udcff"
    assert read_document(b"\xef\xbb\xbf" + body).processes[0].proc.name == "\udcff"
    doc = _demo()
    doc["attributed_bytes"] = 2**70 + 1
    doc["processes"][0]["vram_bytes"]["value"] = 2**64 + 3
    body = json.dumps(doc).encode()
    fast = _fast(body)
    assert fast is not None and fast.attributed_bytes == 2**70 + 1
    assert fast.processes[0].proc.dedicated.value == 2**64 + 3
    over = re.sub(rb'("memory_used_bytes": \{"value": )\d+', rb"\g<1>1e400", LINES[0], count=1)
    assert over != LINES[0]
    with pytest.raises(SnapshotError, match=r"memory_used_bytes\.value: inf is not a number"):
        read_document(over)
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        read_document(over.replace(b"1e400", b"NaN"))


LIMITS = ["0", "-0.0", "1", "1.0", "5e-324", "1.7976931348623157e308", "-1.7976931348623157e308"]
LIMITS += ["1e400", "-1e400", str(2**63 - 1), str(2**63), str(-(2**63)), str(-(2**63) - 1)]
LIMITS += [str(2**1024 - 2**970), str(-(2**1024 - 2**970)), str(2**1024 - 2**970 - 1)]


@pytest.mark.parametrize("number", LIMITS)
def test_a_reading_at_a_numbers_limits_reads_as_the_reference_reads_it(number: str) -> None:
    """Catches the typed path's inline number check (`docvalues.reading`: an int within
    ±2**63, a float between ±the largest float) taking what `is_number` refuses or reading
    it otherwise (planted: the float's lower bound dropped, so -1e400 reads as -inf), from
    bytes and from a parsed object (msgspec refuses 1e400 in bytes; ``json.loads`` makes
    it an infinity, which `msgspec.convert` passes on)."""
    body = re.sub(
        rb'("memory_used_bytes": \{"value": )\d+', rb"\g<1>" + number.encode(), LINES[0], count=1
    )
    assert body != LINES[0]
    want = _reference(body)
    fast = _fast(body)
    if fast is not None:
        assert repr(fast) == want
    assert _outcome(read_document, body) == want
    assert _outcome(read_document, parse_json(body)) == want


def test_a_top_level_that_is_no_snapshot_is_not_a_snapshot() -> None:
    """Catches the fleet calling another tool's JSON or another schema version "unreadable"
    instead of naming it: `NotASnapshot`, with `check_snapshot`'s words, from bytes too."""
    doc = _demo()
    doc["schema_version"] = 2
    with pytest.raises(NotASnapshot, match="schema_version 2 is not supported"):
        read_document(json.dumps(doc).encode())
    with pytest.raises(NotASnapshot, match="not a JSON object but list"):
        read_document(b"[1, 2]")
    doc = _demo()
    doc["processes"][0]["gpu"] = []
    with pytest.raises(SnapshotError, match=r"processes\[0\]\.gpu: expected a string or null"):
        read_document(json.dumps(doc).encode())
