"""`gputaskman diff`: every pairing and comparison rule, on snapshots of mocked NVML data
(built with the real model and `report.to_json_dict`) and on real `--json` output of this
GPU-less machine."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gputaskman.base.readings import Reason
from gputaskman.document.reader import SnapshotError, read_document
from gputaskman.offline import diff, diff_report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "mocked_snapshots", Path(__file__).with_name("mocked_snapshots.py")
)
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)
GIB = ms.GIB
MIB = 1024 * 1024


def gtm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", *args], capture_output=True, text=True, timeout=60
    )


def snap(t=0.0, *, used=4 * GIB, procs=(), adapters=None, metrics_by_bus=None, **kw):
    ads = adapters if adapters is not None else [ms.adapter()]
    if metrics_by_bus is None:
        metrics_by_bus = {a.pci_bus_id: ms.metrics(used=used) for a in ads}
    return ms.doc(
        ms.snapshot(ms.T0 + t, adapters=ads, metrics_by_bus=metrics_by_bus, procs=procs, **kw)
    )


def compare(before: dict, after: dict) -> dict:
    """`diff.diff` of two documents, read as `gputaskman diff` reads them."""
    return diff.diff(read_document(before), read_document(after))


def field(entry: dict, name: str) -> dict:
    return next(f for f in entry["fields"] if f["field"] == name)


def procs_by_pid(d: dict, pid: int) -> list[dict]:
    return [p for p in d["processes"] if p["pid"] == pid]


def adapter_entry(d: dict, bus: str) -> dict:
    return next(e for e in d["adapters"] if (e["after"] or e["before"])["pci_bus_id"] == bus)


def test_measured_fields_are_compared_directly() -> None:
    b = snap(used=4 * GIB, procs=[ms.proc(10, 3 * GIB)])
    a = snap(60, used=6 * GIB, procs=[ms.proc(10, 5 * GIB)])
    d = compare(b, a)
    gpu = d["adapters"][0]
    assert gpu["paired_by"] == "uuid" and d["warnings"] == [] and d["elapsed_s"] == 60
    used = field(gpu, "memory_used_bytes")
    assert (used["section"], used["change"], used["delta"]) == ("measured", "changed", 2 * GIB)
    assert field(gpu, "memory_total_bytes")["change"] == "unchanged"
    assert field(gpu, "attributed_bytes")["delta"] == 2 * GIB
    (p,) = procs_by_pid(d, 10)
    assert p["status"] == "paired" and field(p, "vram_bytes")["delta"] == 2 * GIB
    text = diff_report.render_text(d, "b.json", "a.json")
    assert "memory used" in text and "+2.0 GiB" in text


def test_a_change_smaller_than_a_mebibyte_is_reported() -> None:
    """Catches a diff that rounds to the display unit before comparing (or drops changes under
    1 MiB as noise): a process that grew by one 4 KiB page and a GPU whose used memory moved by
    512 KiB must both read as changed, with the exact delta in bytes."""
    b = snap(used=4 * GIB, procs=[ms.proc(10, 3 * GIB)])
    a = snap(60, used=4 * GIB + 512 * 1024, procs=[ms.proc(10, 3 * GIB + 4096)])
    d = compare(b, a)
    used = field(d["adapters"][0], "memory_used_bytes")
    assert (used["change"], used["delta"]) == ("changed", 512 * 1024)
    (p,) = procs_by_pid(d, 10)
    vram = field(p, "vram_bytes")
    assert (vram["change"], vram["delta"]) == ("changed", 4096)
    text = diff_report.render_text(d, "b.json", "a.json")
    assert "+4.0 KiB" in text and "+512.0 KiB" in text, text


def test_an_absent_row_is_not_listed_not_zero() -> None:
    b = snap(procs=[ms.proc(10, 3 * GIB), ms.proc(11, 1 * GIB, name="whisper")])
    a = snap(1, procs=[ms.proc(11, 1 * GIB, name="whisper"), ms.proc(12, 2 * GIB, name="new")])
    d = compare(b, a)
    (gone,) = procs_by_pid(d, 10)
    (new,) = procs_by_pid(d, 12)
    assert gone["status"] == "not listed after" and new["status"] == "not listed before"
    assert field(gone, "vram_bytes")["delta"] is None and field(gone, "vram_bytes")["after"] is None
    assert field(new, "vram_bytes")["delta"] is None and field(new, "vram_bytes")["before"] is None
    text = diff_report.render_text(d, "b", "a")
    # one line each, under their own heading: the VRAM they had on the side they are on,
    # never a drop to 0 or a rise from 0
    gone_at, new_at = text.index("PROCESSES GONE"), text.index("PROCESSES NEW")
    assert "10 " in text[gone_at:new_at] and "VRAM 3.0 GiB" in text[gone_at:new_at]
    assert "12 new" in text[new_at:] and "VRAM 2.0 GiB" in text[new_at:]
    assert "0 B" not in text and text.count("(GPU 0)") == 2  # whisper is unchanged: not listed
    assert "-3.0 GiB" not in text and "+2.0 GiB" not in text


@pytest.mark.parametrize(
    ("before_ad", "after_ad"),
    [
        (ms.adapter(vendor="nvidia", uuid=""), ms.adapter(vendor="amd", uuid="")),  # same bus
        (ms.adapter(uuid="GPU-a"), ms.adapter(uuid="GPU-b")),  # another card in the slot
        (ms.adapter(bus=ms.BUS0, uuid=""), ms.adapter(bus=ms.BUS1, uuid="")),  # nothing shared
    ],
)
def test_conflicting_adapters_are_refused(tmp_path: Path, before_ad, after_ad) -> None:
    b, a = snap(adapters=[before_ad]), snap(1, adapters=[after_ad])
    with pytest.raises(diff.Refused, match="conflicting adapters"):
        compare(b, a)
    res = gtm("diff", str(ms.save(tmp_path / "b.json", b)), str(ms.save(tmp_path / "a.json", a)))
    assert res.returncode == diff.EXIT_REFUSED and "refused" in res.stderr and res.stdout == ""


def test_a_gpu_missing_on_one_side_is_not_a_conflict() -> None:
    b = snap(procs=[ms.proc(10, 3 * GIB)])
    a = ms.doc(ms.snapshot(ms.T0 + 1, unavailable=Reason.GPU_LOST))
    d = compare(b, a)
    assert d["adapters"][0]["status"] == "not listed after"
    assert field(d["adapters"][0], "memory_used_bytes")["delta"] is None


def test_a_moved_card_pairs_by_uuid() -> None:
    b = snap(adapters=[ms.adapter(bus=ms.BUS0, uuid="GPU-x")])
    a = snap(1, adapters=[ms.adapter(bus=ms.BUS1, uuid="GPU-x")])
    assert compare(b, a)["adapters"][0]["paired_by"] == "uuid (PCI address changed)"


def _strip_address(d: dict) -> dict:
    d = copy.deepcopy(d)
    for ad in d["adapters"]:
        ad["pci_bus_id"] = None
        ad["uuid"] = None
    for p in d["processes"]:
        p["gpu"] = None if p["gpu"] is None else "?"
    return d


def test_name_only_pairing_warns() -> None:
    b = snap(used=4 * GIB)
    a = _strip_address(snap(1, used=5 * GIB))  # e.g. a snapshot from a backend with no address
    d = compare(b, a)
    assert d["adapters"][0]["paired_by"] == "name-only"
    assert [w["code"] for w in d["warnings"]] == ["name-only"]
    assert field(d["adapters"][0], "memory_used_bytes")["delta"] == 1 * GIB
    assert "WARNING name-only" in diff_report.render_text(d, "b", "a")


def test_adapters_sharing_a_name_pair_by_address_never_by_name() -> None:
    twin0 = ms.adapter(0, ms.BUS0, "NVIDIA RTX 4090", uuid="")
    twin1 = ms.adapter(1, ms.BUS1, "NVIDIA RTX 4090", uuid="")
    b = snap(
        adapters=[twin0, twin1],
        metrics_by_bus={ms.BUS0: ms.metrics(used=1 * GIB), ms.BUS1: ms.metrics(used=9 * GIB)},
    )
    # after: listed in the other order, and GPU 0's memory went up
    a = snap(
        1,
        adapters=[twin1, twin0],
        metrics_by_bus={ms.BUS0: ms.metrics(used=3 * GIB), ms.BUS1: ms.metrics(used=9 * GIB)},
    )
    d = compare(b, a)
    assert {e["paired_by"] for e in d["adapters"]} == {"pci_bus_id"} and d["warnings"] == []
    assert field(adapter_entry(d, ms.BUS0), "memory_used_bytes")["delta"] == 2 * GIB
    assert field(adapter_entry(d, ms.BUS1), "memory_used_bytes")["delta"] == 0
    # one twin gone: it is not listed, never matched to the other twin by name
    a2 = snap(1, adapters=[twin1], metrics_by_bus={ms.BUS1: ms.metrics(used=9 * GIB)})
    d2 = compare(b, a2)
    assert adapter_entry(d2, ms.BUS0)["status"] == "not listed after"
    assert adapter_entry(d2, ms.BUS1)["paired_by"] == "pci_bus_id"


def test_same_name_at_different_addresses_is_never_paired_by_name() -> None:
    bus2 = "00000000:81:00.0"
    other = ms.adapter(2, bus2, "NVIDIA A100", uuid="")
    b_twin = ms.adapter(0, ms.BUS0, "NVIDIA RTX 4090", uuid="")
    a_twin = ms.adapter(0, ms.BUS1, "NVIDIA RTX 4090", uuid="")  # a different card, same model
    d = compare(snap(adapters=[other, b_twin]), snap(1, adapters=[other, a_twin]))
    assert adapter_entry(d, bus2)["paired_by"] == "pci_bus_id"
    assert adapter_entry(d, ms.BUS0)["status"] == "not listed after"
    assert adapter_entry(d, ms.BUS1)["status"] == "not listed before"
    assert d["warnings"] == []


def test_twins_without_addresses_are_not_compared() -> None:
    twins = [ms.adapter(0, ms.BUS0, "NVIDIA RTX 4090"), ms.adapter(1, ms.BUS1, "NVIDIA RTX 4090")]
    b = _strip_address(snap(adapters=twins))
    a = _strip_address(snap(1, adapters=twins))
    d = compare(b, a)
    assert all(e["paired_by"] is None for e in d["adapters"])
    assert any("cannot be told apart" in w["message"] for w in d["warnings"])


@pytest.mark.parametrize(
    ("after_start", "paired"),
    [
        (ms.T0 + 50, False),  # started 150 s later: the PID was reused
        (ms.T0 - 100 + diff.SAME_PROCESS_SECS + 1, False),
        (ms.T0 - 100 + diff.SAME_PROCESS_SECS / 2, True),  # float noise: same process
        (None, True),  # unknown start time never conflicts
        (-5, True),
    ],
)
def test_reused_pids_are_never_paired(after_start, paired: bool) -> None:
    b = snap(procs=[ms.proc(10, 3 * GIB, start=ms.T0 - 100)])
    a = snap(1, procs=[ms.proc(10, 3 * GIB, start=ms.T0 - 100)])
    a["processes"][0]["started_at"] = after_start
    d = compare(b, a)
    rows = procs_by_pid(d, 10)
    if paired:
        assert [r["status"] for r in rows] == ["paired"]
        assert field(rows[0], "vram_bytes")["change"] == "unchanged"
    else:
        assert sorted(r["status"] for r in rows) == ["not listed after", "not listed before"]
        assert all(r["pid_reused"] for r in rows)
        assert all(field(r, "vram_bytes")["delta"] is None for r in rows)
        assert "PID reused" in diff_report.render_text(d, "b", "a")


def test_memory_that_became_known_or_unknown() -> None:
    b = snap(used=None, procs=[ms.proc(10, None), ms.proc(11, 2 * GIB, name="x")])
    a = snap(1, used=5 * GIB, procs=[ms.proc(10, 3 * GIB), ms.proc(11, None, name="x")])
    d = compare(b, a)
    assert field(d["adapters"][0], "memory_used_bytes")["change"] == "became known"
    known = field(procs_by_pid(d, 10)[0], "vram_bytes")
    unknown = field(procs_by_pid(d, 11)[0], "vram_bytes")
    assert known["change"] == "became known" and known["delta"] is None
    assert (
        unknown["change"] == "became unknown" and unknown["after"]["reason"] == "hidden by driver"
    )
    # the measured sum lost a process: it is not compared as if the memory were freed
    att = field(d["adapters"][0], "attributed_bytes")
    assert att["before"]["value"] == 2 * GIB and att["after"]["value"] == 3 * GIB
    assert att["delta"] is None and att["change"] == diff.LOWER_BOUND
    text = diff_report.render_text(d, "b", "a")
    assert "n/a (hidden by driver) -> 3.0 GiB  became known" in text
    assert "2.0 GiB -> n/a (hidden by driver)  became unknown" in text


def _reading(v, kind):
    return {"value": v, "kind": kind, "source": "mock", "reason": None, "detail": None}


def _part(v, kind, alternatives=()):
    return {
        "reading": _reading(v, kind),
        "marker": None,
        "alternatives": [_reading(x, "estimated") for x in alternatives],
    }


def test_runtime_estimated_and_inferred_values_have_their_own_sections() -> None:
    b = snap(procs=[ms.proc(10, 3 * GIB, inferred=3 * GIB)])
    a = snap(1, procs=[ms.proc(10, 3 * GIB, inferred=4 * GIB)])
    for d, w, kv in ((b, 2, 1), (a, 2, 2)):
        # the weights / KV view in report.py's BREAKDOWN shape
        d["processes"][0]["breakdown"] = {
            "model": "m",
            "parts": {
                "weights": _part(w * GIB, "estimated", alternatives=[9 * GIB]),
                "kv_cache": _part(kv * GIB, "runtime"),
            },
            "reported_total": _reading(kv * GIB, "runtime"),
            "estimated_total": _reading(w * GIB, "estimated"),
            "parameter_count": 7_000_000_000,
        }
        d["processes"][0]["ram_bytes"] = _reading(w * 7 * GIB, "measured")  # host RAM
        # a measured byte count not in MEASURED is not compared until someone adds it
        d["processes"][0]["gart_bytes"] = _reading(w * GIB, "measured")
    d = compare(b, a)
    (p,) = procs_by_pid(d, 10)
    sections = {f["field"]: f["section"] for f in p["fields"]}
    assert sections == {
        "vram_bytes": "measured",
        "vram_inferred_bytes": "inferred",
        "breakdown.weights": "estimated",
        "breakdown.kv_cache": "runtime",
        "breakdown.reported_total": "runtime",
        "breakdown.estimated_total": "estimated",
    }  # host RAM, shown_vram, alternatives and counts are not compared
    assert field(p, "breakdown.kv_cache")["delta"] == 1 * GIB
    assert field(p, "breakdown.weights")["change"] == "unchanged"
    text = diff_report.render_text(d, "b", "a")
    measured = text.split("MEASURED")[1].split("INFERRED")[0]
    assert "kv_cache" not in measured and "weights" not in measured
    runtime = text.split("RUNTIME-REPORTED")[1].split("ESTIMATED")[0]
    assert "breakdown.kv_cache" in runtime and "+1.0 GiB" in runtime
    assert "~4.0 GiB" in text.split("INFERRED")[1]


def test_gtt_is_a_measured_adapter_field() -> None:
    b, a = snap(), snap(1)
    for d, used in ((b, 1), (a, 3)):
        d["adapters"][0]["extra_metrics"] = {"gtt_used_bytes": _reading(used * GIB, "measured")}
    f = field(compare(b, a)["adapters"][0], "gtt_used_bytes")
    assert f["section"] == "measured" and f["delta"] == 2 * GIB


def test_a_field_whose_kind_changed_is_not_subtracted() -> None:
    b = snap(procs=[ms.proc(10, 3 * GIB)])
    a = snap(1, procs=[ms.proc(10, 3 * GIB)])
    a["processes"][0]["vram_bytes"]["kind"] = "inferred"
    f = field(procs_by_pid(compare(b, a), 10)[0], "vram_bytes")
    assert f["delta"] is None and f["change"].startswith("kind changed")


def test_diff_json_and_text_from_the_command_line(tmp_path: Path) -> None:
    b = ms.save(tmp_path / "b.json", snap(procs=[ms.proc(10, 3 * GIB)]))
    a = ms.save(tmp_path / "a.json", _strip_address(snap(1, procs=[ms.proc(10, 4 * GIB)])))
    res = gtm("diff", str(b), str(a), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["schema"] == "gputaskman.offline.diff" and out["schema_version"] == 1
    assert out["warnings"][0]["code"] == "name-only" and "name-only" in res.stderr
    text = gtm("diff", str(b), str(a))
    assert text.returncode == 0 and text.stdout.startswith("gputaskman diff")


def test_diff_of_two_real_snapshots_of_this_machine(tmp_path: Path) -> None:
    paths = []
    for name in ("b.json", "a.json"):
        res = gtm("--json")
        assert res.returncode == 0
        paths.append(tmp_path / name)
        paths[-1].write_text(res.stdout)
    res = gtm("diff", *map(str, paths))
    assert res.returncode == 0, res.stderr
    assert "no GPU listed in either snapshot" in res.stdout


def _system(used: int | None, swap_used: int = 0) -> dict:
    def r(v, reason=None):
        return {
            "value": v,
            "kind": "measured",
            "source": "/proc/meminfo",
            "reason": reason,
            "detail": None,
        }

    return {
        "taken": ms.T0,
        "kind": "measured",
        "memory": {
            "total_bytes": r(32 * GIB),
            "used_bytes": r(used) if used is not None else r(None, "unavailable"),
        },
        "swap": {
            "total_bytes": r(8 * GIB),
            "used_bytes": r(swap_used),
            "devices": [],
            "devices_reason": None,
            "problems": [],
        },
        "cpu": {},
    }


def test_a_change_in_system_ram_is_reported_apart_from_gpu_memory() -> None:
    """Catches a diff that compares only GPU fields: 200 MiB more RAM in use (a model loaded
    into host memory, a leak) must show, labelled as the OS's counter, not as GPU memory."""
    b, a = snap(), snap(60)
    b["system"], a["system"] = _system(10 * GIB), _system(10 * GIB + 200 * MIB, 64 * MIB)
    d = compare(b, a)
    fields = {f["field"]: f for f in d["system"]}
    assert (fields["memory.used_bytes"]["change"], fields["memory.used_bytes"]["delta"]) == (
        "changed",
        200 * MIB,
    )
    assert fields["swap.used_bytes"]["delta"] == 64 * MIB
    assert fields["memory.total_bytes"]["change"] == "unchanged"
    text = diff_report.render_text(d, "b", "a")
    assert "SYSTEM (RAM and swap" in text and "RAM used" in text and "+200.0 MiB" in text
    assert "RAM total" not in text  # unchanged values are not listed
    # a value that became unknown says so; a snapshot without a host sample compares nothing
    a["system"] = _system(None)
    assert {f["field"]: f["change"] for f in compare(b, a)["system"]}["memory.used_bytes"] == (
        "became unknown"
    )
    del a["system"]
    assert all(f["change"] == "not listed after" for f in compare(b, a)["system"])


def test_a_process_that_went_away_takes_one_line() -> None:
    """Catches a vanished process spread over every section (measured, inferred, runtime,
    estimated: one "gone" row per reading, 14 lines for one llama-server)."""

    def r(v, kind):
        return {"value": v, "kind": kind, "source": "t", "reason": None, "detail": None}

    b = snap(procs=[ms.proc(10, 3 * GIB, name="llama-server")])
    row = b["processes"][0]
    row["vram_inferred_bytes"] = r(3 * GIB, "inferred")
    row["breakdown"] = {
        "parts": {
            name: {"reading": r(v, kind), "marker": None, "alternatives": []}
            for name, v, kind in (
                ("weights", 2 * GIB, "runtime"),
                ("kv_cache", GIB // 2, "estimated"),
                ("compute", GIB // 4, "runtime"),
                ("other", None, "inferred"),
            )
        },
        "reported_total": r(2 * GIB, "runtime"),
        "estimated_total": r(GIB // 2, "estimated"),
    }
    row["breakdown"]["parts"]["other"]["reading"].update(reason="unavailable")
    d = compare(b, snap(60))
    (gone,) = procs_by_pid(d, 10)
    assert len(gone["fields"]) >= 6  # the JSON keeps every reading
    text = diff_report.render_text(d, "b", "a")
    lines = [ln for ln in text.splitlines() if "llama-server" in ln]
    assert len(lines) == 1 and "VRAM 3.0 GiB" in lines[0], text
    assert "RUNTIME-REPORTED" not in text and "ESTIMATED" not in text


def test_two_samples_of_one_record_file_are_compared_by_position(tmp_path: Path) -> None:
    """Catches FILE@N that picks the wrong line (0-based, or counting malformed lines) or reads
    @-1 as anything but the last snapshot."""
    rec = ms.write_record(
        tmp_path / "run.jsonl",
        [
            snap(0, used=1 * GIB),
            b"{not json\n",  # a malformed line is not a snapshot and does not count
            snap(60, used=2 * GIB),
            snap(120, used=3 * GIB),
        ],
    )
    res = gtm("diff", "--json", f"{rec}@1", f"{rec}@-1")
    assert res.returncode == 0, res.stderr
    used = field(json.loads(res.stdout)["adapters"][0], "memory_used_bytes")
    assert (used["before"]["value"], used["after"]["value"]) == (1 * GIB, 3 * GIB)
    res = gtm("diff", "--json", f"{rec}@2", f"{rec}@3")
    assert field(json.loads(res.stdout)["adapters"][0], "memory_used_bytes")["delta"] == GIB
    text = gtm("diff", f"{rec}@1", f"{rec}@-2")
    assert text.returncode == 0 and f"{rec}@1" in text.stdout and f"{rec}@-2" in text.stdout
    for bad, says in ((f"{rec}@0", "count from 1"), (f"{rec}@4", "holds 3 snapshot(s)")):
        res = gtm("diff", bad, f"{rec}@1")
        assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr
    plain = gtm("diff", str(rec), f"{rec}@1")  # the whole file: say how to name one
    assert plain.returncode == 2 and f"{rec}@1" in plain.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"schema": "other"}', "not a gputaskman.snapshot"),
        (None, "a record file (2 lines, one snapshot each); name one as"),
        ("schema2", "schema_version 2 is not supported"),
    ],
)
def test_bad_input_is_refused_with_a_reason(tmp_path: Path, content, message) -> None:
    good = ms.save(tmp_path / "good.json", snap())
    bad = tmp_path / "bad.json"
    if content is None:
        ms.write_record(bad, [snap(), snap(1)])
    elif content == "schema2":
        ms.save(bad, {**snap(), "schema_version": 2})
    else:
        bad.write_text(content)
    res = gtm("diff", str(good), str(bad))
    assert res.returncode == diff.EXIT_BAD_INPUT and message in res.stderr


def test_malformed_values_deep_inside_are_refused_naming_the_place(tmp_path: Path) -> None:
    """Catches a value of the wrong type deep in a document (a row whose ``gpu`` is a list, a
    start time that is a word) crashing the pairing or being compared as something else:
    the reader refuses the document and says where, and the CLI exits 2."""
    a = ms.save(tmp_path / "a.json", snap(1, procs=[ms.proc(10, 4 * GIB)]))
    for where, value in (("gpu", ["not", "an", "address"]), ("started_at", "yesterday")):
        b = snap(procs=[ms.proc(10, 3 * GIB)])
        b["processes"][0][where] = value
        res = gtm("diff", "--json", str(ms.save(tmp_path / "b.json", b)), str(a))
        assert res.returncode == diff.EXIT_BAD_INPUT and res.stdout == "", res.stderr
        assert f"b.json: processes[0].{where}: expected" in res.stderr
        assert "Traceback" not in res.stderr


def _mutations() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.integers(), st.text(max_size=5), st.floats(), st.booleans())
    values = st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.dictionaries(
            st.sampled_from(["value", "kind", "reason", "pid", "gpu"]), scalars, max_size=3
        ),
    )
    return st.lists(st.tuples(st.integers(0, 10_000), values), max_size=6)


def _mutate(doc: dict, muts) -> dict:
    doc = copy.deepcopy(doc)
    nodes: list[tuple[object, object]] = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                nodes.append((node, k))
                walk(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                nodes.append((node, i))
                walk(v)

    walk(doc)
    for idx, value in muts:
        parent, key = nodes[idx % len(nodes)]
        parent[key] = value  # type: ignore[index]
    return doc


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(), _mutations())
def test_diff_fuzz_mangled_snapshots_never_crash_unexpectedly(mb, ma) -> None:
    """What `diff_report.run` does with any two documents: the reader (bad input, exit 2), then
    `diff` raises nothing but `Refused` (exit 3), and its result renders."""
    base = snap(procs=[ms.proc(10, 3 * GIB), ms.proc(11, None, name="y")])
    b, a = _mutate(base, mb), _mutate(snap(1, procs=[ms.proc(10, 4 * GIB)]), ma)
    try:
        b, a = read_document(b), read_document(a)
    except SnapshotError:
        return  # the CLI's bad-input message
    try:
        d = diff.diff(b, a)
    except diff.Refused as exc:
        assert "conflicting adapters" in str(exc)
        return
    diff_report.render_text(d, "b", "a")
    json.dumps(d, allow_nan=True)
