"""Writes gputaskman's JSON Schema of the snapshot document (``base/snapshot.schema.json``,
draft 2020-12) from the msgspec Structs that declare the document (``document/docshape.py``), so
the schema cannot say other than the reader: a field added to a Struct is in the schema when
this is run again, and test_schema.py fails until it is.

The Structs are walked with `msgspec.inspect` rather than turned into a schema by
`msgspec.json.schema`: the schema is the writer's contract (keys every document has, values
never null, the reading's null rule) written in the forms its tests draw documents from
(a nullable value as ``"type": [..., "null"]``, ``"enum": [..., null]`` or
``"oneOf": [{"type": "null"}, ...]``; ``$defs`` named by object, ``reading``, ``process``),
while msgspec writes the reader's contract (``anyOf``, defaults, titles). Each Struct is one
``$defs`` entry (its name without ``Shape``, in snake case) with its fields as properties, a
field the schema lists as required when the Struct requires it or it is annotated `ALWAYS`,
plus the keys in its `DERIVED` and the keywords in its `RULES`; a field annotated `SET` is
not nullable, one annotated `EARLY` is left out, and a field's ``extra_json_schema`` stands
for its non-null value's schema. `CODES` become ``$defs`` of their enums' values.

    uv run python tools/snapshot_schema.py          # write the file
    uv run python tools/snapshot_schema.py --check  # exit 1 if the file is not what it writes
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec.inspect as mi
from gputaskman.base import schema as packaged
from gputaskman.document import docshape

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "packages" / "gputaskman" / "src" / "gputaskman" / "base" / packaged.SCHEMA_FILE
DRAFT = "https://json-schema.org/draft/2020-12/schema"
WIDTH = 100  # a JSON value that fits on its line in this many characters stays on one line
NULL = {"type": "null"}


def def_name(cls: type) -> str:
    """The ``$defs`` name of a Struct: ``SwapDeviceShape`` -> ``swap_device``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Shape")).lower()


def _extra(t: mi.Type) -> dict[str, Any]:
    return (t.extra or {}) if isinstance(t, mi.Metadata) else {}


def _nullable(s: dict[str, Any]) -> dict[str, Any]:
    if "enum" in s:
        return {**s, "enum": [*s["enum"], None]}
    if isinstance(s.get("type"), str) and not {"$ref", "oneOf", "const"} & set(s):
        return {**s, "type": [s["type"], "null"]}
    return {"oneOf": [NULL, s]}


class _Schema:
    """One walk from `DocShape`, filling `defs` as Structs are met."""

    def __init__(self) -> None:
        self.defs: dict[str, Any] = {
            name: {"enum": [str(v) for v in enum]} for name, enum in docshape.CODES.items()
        }
        self.codes = {enum: name for name, enum in docshape.CODES.items()}
        self.named: dict[str, type] = {}  # the Struct behind each name, against two in one

    def document(self) -> dict[str, Any]:
        top = self.obj(mi.type_info(docshape.DocShape))
        return {
            "$schema": DRAFT,
            "$id": f"urn:gputaskman:snapshot:{packaged.VERSION}",
            "title": "gputaskman snapshot",
            **top,
            "$defs": self.defs,
        }

    def obj(self, t: mi.StructType) -> dict[str, Any]:
        out: dict[str, Any] = {}
        doc = t.cls.__dict__.get("__doc__")
        if doc:
            out["description"] = " ".join(doc.split())
        out["type"] = "object"
        fields = [(f.encode_name, f.type, f.required) for f in t.fields]
        fields += [(k, mi.type_info(tp), False) for k, tp in t.cls.DERIVED.items()]
        required, props = [], {}
        for key, ft, needed in fields:
            if _extra(ft).get("early"):
                continue
            props[key] = self.value(ft)
            if needed or _extra(ft).get("always"):
                required.append(key)
        if required:
            out["required"] = required
        out["properties"] = props
        out.update(t.cls.RULES)
        return out

    def value(self, t: mi.Type) -> dict[str, Any]:
        """The schema of a value of type `t`, null included where `t` allows it."""
        extra, own = _extra(t), None
        if isinstance(t, mi.Metadata):
            own, t = t.extra_json_schema, t.type
        members = t.types if isinstance(t, mi.UnionType) else (t,)
        null = any(isinstance(m, mi.NoneType) for m in members) and extra.get("null") is not False
        members = tuple(m for m in members if not isinstance(m, mi.NoneType))
        if {type(m) for m in members} == {mi.IntType, mi.FloatType}:
            s = {"type": "number"}
        elif len(members) == 1:
            s = self.one(members[0])
        else:
            s = {"oneOf": [self.one(m) for m in members]}
        if own is not None:  # walked all the same, for the Structs its schema refers to
            s = dict(own)
        return _nullable(s) if null else s

    def one(self, t: mi.Type) -> dict[str, Any]:
        simple = {mi.StrType: "string", mi.IntType: "integer", mi.FloatType: "number"}
        if type(t) in simple:
            return {"type": simple[type(t)]}
        if isinstance(t, mi.BoolType):
            return {"type": "boolean"}
        if isinstance(t, mi.Metadata):
            return self.value(t)
        if isinstance(t, mi.ListType):
            return {"type": "array", "items": self.value(t.item_type)}
        if isinstance(t, mi.DictType):
            return {"type": "object", "additionalProperties": self.value(t.value_type)}
        if isinstance(t, mi.EnumType):
            return {"$ref": f"#/$defs/{self.codes[t.cls]}"}
        if isinstance(t, mi.LiteralType):
            return {"const": t.values[0]} if len(t.values) == 1 else {"enum": list(t.values)}
        if isinstance(t, mi.StructType):
            name = def_name(t.cls)
            if self.named.setdefault(name, t.cls) is not t.cls or name in docshape.CODES:
                raise ValueError(f"two definitions named {name!r}: rename {t.cls.__name__}")
            if name not in self.defs:
                self.defs[name] = {}  # taken, in the order met, before its fields are walked
                self.defs[name] = self.obj(t)
            return {"$ref": f"#/$defs/{name}"}
        raise TypeError(f"no JSON Schema for {t!r}")


def build() -> dict[str, Any]:
    """The snapshot document's JSON Schema, from `docshape.DocShape`."""
    return _Schema().document()


def dumps(node: Any, indent: int = 0, column: int = 0) -> str:
    """`node` as JSON, each object or list on one line where it fits in `WIDTH` from
    `column`, else one member a line, indented by two more than `indent`."""
    flat = json.dumps(node, ensure_ascii=False)
    if not isinstance(node, (dict, list)) or not node or column + len(flat) <= WIDTH:
        return flat
    pad = " " * (indent + 2)
    if isinstance(node, dict):
        items = []
        for k, v in node.items():
            head = f"{pad}{json.dumps(k)}: "
            items.append(head + dumps(v, indent + 2, len(head)))
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps(v, indent + 2, len(pad)) for v in node]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def text() -> str:
    """The file's text: `build`, as `dumps` writes it, with a final newline."""
    return dumps(build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file differs")
    args = parser.parse_args(argv)
    want = text()
    if args.check:
        if OUT.read_text(encoding="utf-8") != want:
            print(f"{OUT} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(want, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
