"""The snapshot document's JSON Schema (draft 2020-12), shipped in the package beside this
module as ``snapshot.schema.json``. The file is generated from the msgspec Structs the reader
decodes into (`document/docshape.py`) by ``tools/snapshot_schema.py``; edit those, not the file.

It describes what `report.to_json_dict` writes (``--json``, each line of a record file, the
documents `serve` and the offline tools read): every number a reading whose ``kind`` is one of
the four kinds and whose ``value`` is null exactly when a ``reason`` says why. Validate with any
draft 2020-12 validator, e.g. ``python -m jsonschema`` or `jsonschema.validate(doc, load())`.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_FILE = "snapshot.schema.json"
NAME = "gputaskman.snapshot"  # the document's "schema" value
VERSION = 1  # its "schema_version": new keys are additive within it


def schema_text() -> str:
    return resources.files("gputaskman.base").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")


def load() -> dict[str, Any]:
    return json.loads(schema_text())


def errors(doc: Any) -> list[str]:
    """Every way `doc` violates the schema, as ``path: message`` (empty: valid). Needs the
    `jsonschema` package, which gputaskman itself does not depend on."""
    out = []
    validator = _validator()
    for e in sorted(validator.iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path]):
        where = "/".join(str(p) for p in e.absolute_path) or "(document)"
        out.append(f"{where}: {e.message[:300]}")
    return out


@cache
def _validator() -> Any:
    """Built once: compiling the schema costs more than validating one document."""
    from jsonschema import Draft202012Validator

    return Draft202012Validator(load())
