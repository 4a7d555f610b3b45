"""The TUI help screen explains every column and every mark the process table can render.

Nothing is copied from the help text: the columns come from `text_report.PAGED_COLUMNS`, and the
marks from rendering rows through `text_report.process_cells` (the function the table uses) with
every variant the code has: each reading kind, an inferred value with one explanation, each
reason a cell spells out, a row of another OS, an unscanned row, a heuristic category, and
each model evidence tag. Any symbol those cells contain must appear in the help.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from gputaskman.base.readings import Kind, ModelRef, ProcDetail, Reading, Reason
from gputaskman.intel import runtimes
from gputaskman.intel.evidence import Source
from gputaskman.render import report, report_models, text_report
from gputaskman.tui.app import GtmApp
from gputaskman.tui.screens import help as help_mod
from gputaskman.tui.widgets.process_table import ProcessTable

sys.path.insert(0, str(Path(__file__).parent))
ms = __import__("mocked_snapshots")

# characters of plain content: numbers, units, names, separators
PLAIN = set(" .,/()-_%:'") | {chr(c) for c in range(128) if chr(c).isalnum()}


def _text() -> str:
    return help_mod.help_text(list(GtmApp.BINDINGS))


def _variants() -> list:
    """One row per way the table can draw a cell (mocked GPU rows: no GPU here)."""
    base = ms.proc(1, 100 * ms.MIB)
    rows = [base]
    for i, kind in enumerate(Kind):
        inferred = Reading(50 * ms.MIB, kind, "mock:rule")
        rows.append(
            dataclasses.replace(
                base, pid=10 + i, dedicated=ms.r(None), inferred=inferred, unique=True
            )
        )
    for i, reason in enumerate(Reason):
        rows.append(dataclasses.replace(base, pid=100 + i, dedicated=ms.r(None, reason)))
    rows.append(dataclasses.replace(base, pid=200, host="windows"))
    rows.append(dataclasses.replace(base, pid=201, detail=ProcDetail()))  # not scanned yet
    heuristic = runtimes.Classification(runtimes.VISION, True, "names only").label
    rows.append(
        dataclasses.replace(base, pid=202, detail=ProcDetail(category=heuristic, scanned=True))
    )
    for i, source in enumerate(Source):
        for confirmed in (False, True):
            for pending in (False, True):
                m = ModelRef("m", source.value, confirmed=confirmed, pending=pending)
                rows.append(
                    dataclasses.replace(base, pid=300 + 4 * i + 2 * confirmed + pending, model=m)
                )
    app = type("App", (), {"selected": "chosen-model"})()
    rows.append(dataclasses.replace(base, pid=400, app_model=app))
    rows.append(dataclasses.replace(base, pid=401, paged=Reading.measured(ms.MIB, "mock:pdh")))
    return rows


def _cells() -> list[tuple[str, ...]]:
    rows = _variants()
    snap = ms.snapshot(procs=tuple(rows))
    assert text_report.process_columns(snap) == text_report.PAGED_COLUMNS
    lookup = report.proc_host_lookup(None)
    return [text_report.process_cells(p, lookup, snap, text_report.PAGED_COLUMNS) for p in rows]


def test_help_explains_every_column_the_table_can_show() -> None:
    text = _text()
    assert set(text_report.PROCESS_COLUMNS) < set(text_report.PAGED_COLUMNS)
    for label in text_report.PAGED_COLUMNS:
        assert f"\n  {label} " in text, label


def test_help_names_every_mark_the_table_renders() -> None:
    text = _text()
    symbols: set[str] = set()
    for cells in _cells():
        for cell in cells:
            symbols |= set(cell) - PLAIN
            if "(" in cell:  # an unknown that spells out its reason
                assert cell in text, cell
    # the rows really exercised every mark the renderers use
    expected = {m for m in report.KIND_MARK.values() if m} | {
        text_report.UNIQUE_MARK,
        text_report.NOT_SCANNED_MARK,
        runtimes.HEURISTIC_MARK,
        report_models.CONFIRMED_MARK,
        report_models.UNCONFIRMED_MARK,
        report_models.PENDING_MARK,
        "[",
        "]",
    }
    assert expected <= symbols
    for s in symbols:
        assert s in text, f"the table can show {s!r} but the help does not explain it"
    for reason in text_report.LOUD_REASONS:
        assert f"{report.NA} ({reason})" in text
    assert report_models.SELECTED_TAG in text
    pid_cells = {cells[0] for cells in _cells()}
    assert "windows:200" in pid_cells and "windows:PID" in text


def test_help_names_the_sort_marks() -> None:
    table = ProcessTable()
    text = _text()
    for descending in (True, False):
        table.descending = descending
        mark = table.header_label("VRAM").split()[-1]
        assert mark in text


@pytest.mark.parametrize(
    ("given", "unexplained"),
    [
        ({"columns": (*text_report.PAGED_COLUMNS, "NEWCOL")}, "NEWCOL"),
        ({"loud_reasons": (*text_report.LOUD_REASONS, Reason.SHARED)}, Reason.SHARED),
    ],
)
def test_an_unexplained_column_or_reason_fails_loudly(given, unexplained) -> None:
    """Catches a column or spelled-out reason added to the table without a help line being
    shown unexplained (or silently left out) instead of failing this suite."""
    _text()  # the real columns and reasons are all explained
    with pytest.raises(KeyError) as err:
        help_mod.help_text(list(GtmApp.BINDINGS), **given)
    assert err.value.args == (unexplained,)
