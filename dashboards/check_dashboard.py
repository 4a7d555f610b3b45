"""Check a Grafana dashboard JSON against grafana-dashboard.schema.json and a metric list.

Used by the tests of both packages (each passes the metric names a real scrape of its own
exporter produced) and by hand::

    uv run python dashboards/check_dashboard.py dashboards/duvm.json

Besides the schema (required fields and types of Grafana's dashboard JSON model), it checks
what a schema cannot: panel ids and each panel's refIds are unique, panels do not overlap on
the 24-column grid, every ``$variable`` used is defined in ``templating``, and every metric an
``expr`` names is one the exporter really exports (histogram ``_bucket``/``_count``/``_sum``
series counted as their family).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = Path(__file__).with_name("grafana-dashboard.schema.json")
_METRIC = re.compile(r"\b((?:gputaskman|duvm)_[a-z0-9_]+)")
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
_HIST = ("_bucket", "_count", "_sum")


def metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Every gputaskman_/duvm_ metric named in an expr."""
    out = set()
    for p in dashboard.get("panels", []):
        for t in p.get("targets", []):
            out.update(_METRIC.findall(t.get("expr", "")))
    return out


def problems(dashboard: dict[str, Any], exported: Iterable[str] | None = None) -> list[str]:
    """Everything wrong with `dashboard` (empty when it is fine)."""
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    out = [
        f"schema: {'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(dashboard)
    ]
    if out:
        return out
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    if len(ids) != len(set(ids)):
        out.append(f"panel ids repeat: {ids}")
    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        refs = [t["refId"] for t in p["targets"]]
        if len(refs) != len(set(refs)):
            out.append(f"panel {p['id']}: refIds repeat: {refs}")
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            out.append(f"panel {p['id']}: wider than the 24-column grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    out.append(f"panel {p['id']} overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = p["id"]
            else:
                continue
            break
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(_VAR.findall(json.dumps(dashboard["panels"])))
    for v in sorted(used - defined - {"__rate_interval", "__interval", "__range"}):
        out.append(f"variable ${v} is used but not defined in templating")
    if exported is not None:
        have = set(exported)
        for name in sorted(metric_names(dashboard)):
            base = next((name[: -len(s)] for s in _HIST if name.endswith(s)), name)
            if name not in have and not any(base + s in have for s in _HIST):
                out.append(f"expr names {name}, which the exporter does not export")
    return out


def main(argv: list[str]) -> int:
    bad = 0
    for path in argv:
        found = problems(json.loads(Path(path).read_text()))
        for p in found:
            print(f"{path}: {p}")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
