"""dashboards/gputaskman.json: Grafana's dashboard JSON model (schema) and metric names that
a real scrape of the exporter produces (GPU numbers mocked: this machine has no GPU)."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from gputaskman.render.exporter import Cached
from gputaskman.sampling import duvmpool
from gputaskman.sampling.host import HostSampler

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
from test_exporter import _mock_snapshot, scrape  # noqa: E402

pytest.importorskip("jsonschema")


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_dashboard", ROOT / "dashboards" / "check_dashboard.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exported_names() -> set[str]:
    """Sample names of a scrape with every feature present: GPUs, processes with models and
    a weights/KV view (mocked NVML numbers), a real host sample, a duvm pool (parsed from a
    daemon status document)."""
    pool = duvmpool.PoolInfo(
        daemons=(
            duvmpool.parse_status(
                {
                    "pid": 1,
                    "size_bytes": 1 << 20,
                    "store": {
                        "replicas": 1,
                        "peers": [{"peer": "10.0.0.2:7070", "connected": True, "pages": 3}],
                    },
                },
                "/run/duvm/x.ctl",
            ),
        )
    )
    system = dataclasses.replace(HostSampler(duvm=False).sample(), duvm=pool)
    system = dataclasses.replace(
        system, cpu=dataclasses.replace(system.cpu, percent=system.cpu.load_1)
    )  # a known CPU% so that family appears too
    got = scrape(Cached(_mock_snapshot(), system, time.time(), 0.01))
    return set(got)


def test_gputaskman_dashboard_is_valid_and_uses_only_exported_metrics():
    check = _checker()
    dash = json.loads((ROOT / "dashboards" / "gputaskman.json").read_text())
    names = _exported_names()
    assert check.problems(dash, names) == []
    used = check.metric_names(dash)
    assert "gputaskman_process_vram_bytes" in used
    assert "gputaskman_process_vram_estimated_bytes" in used
    assert "gputaskman_duvm_peer_pages_runtime_bytes" in used
    # measured and estimated VRAM are in different panels, never one expression
    for p in dash["panels"]:
        exprs = " ".join(t["expr"] for t in p["targets"])
        assert not ("gputaskman_process_vram_bytes" in exprs and "_estimated_" in exprs)


def test_the_check_catches_what_grafana_would_reject():
    check = _checker()
    dash = json.loads((ROOT / "dashboards" / "gputaskman.json").read_text())
    names = _exported_names()
    broken = copy.deepcopy(dash)
    del broken["uid"]
    assert any("'uid' is a required property" in p for p in check.problems(broken, names))
    broken = copy.deepcopy(dash)
    broken["panels"][0]["targets"][0]["expr"] = "gputaskman_gpu_vram_made_up_bytes"
    assert check.problems(broken, names) == [
        "expr names gputaskman_gpu_vram_made_up_bytes, which the exporter does not export"
    ]
    broken = copy.deepcopy(dash)
    broken["panels"][1]["gridPos"] = dict(broken["panels"][0]["gridPos"])
    assert any("overlaps" in p for p in check.problems(broken, names))
    broken = copy.deepcopy(dash)
    broken["panels"][0]["datasource"]["uid"] = "${nowhere}"
    assert check.problems(broken, names) == [
        "variable $nowhere is used but not defined in templating"
    ]


def test_fleet_dashboard_is_valid_filters_every_series_by_host_and_keeps_kinds_apart():
    """dashboards/gputaskman-fleet.json: Grafana's schema, only metrics a real scrape has, a
    host variable every selector filters on, per-model memory panels, and measured memory
    never in one panel with an estimate."""
    import re

    check = _checker()
    dash = json.loads((ROOT / "dashboards" / "gputaskman-fleet.json").read_text())
    assert check.problems(dash, _exported_names()) == []
    host = next(v for v in dash["templating"]["list"] if v["name"] == "host")
    assert host["multi"] and host["includeAll"] and "instance" in host["definition"]
    selector = re.compile(r"\b((?:gputaskman_|up\b)[a-z0-9_]*)(\{[^}]*\})?")
    for p in dash["panels"]:
        exprs = " ".join(t["expr"] for t in p["targets"])
        for name, labels in selector.findall(exprs):
            assert labels and 'instance=~"$host"' in labels, (p["title"], name)
        assert not ("gputaskman_process_vram_bytes" in exprs and "_estimated_" in exprs)
    model_panels = [p for p in dash["panels"] if "model" in p["title"].lower()]
    used = check.metric_names({"panels": model_panels})
    assert {"gputaskman_process_model_info", "gputaskman_process_vram_bytes"} <= used
    assert "gputaskman_process_llm_part_estimated_bytes" in used
