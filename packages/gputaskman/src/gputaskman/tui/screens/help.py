"""The help screen: every key of the app, every table column and every mark a cell can carry.

Theory of operation
-------------------
Nothing here is a copy of what the table draws: the keys come from the app's bindings, the
columns from `text_report.PAGED_COLUMNS` (the widest table), the provenance marks from
`fmt.KIND_MARK`, the evidence tags from `evidence.Source`, and the other marks from the
constants `report`, `report_models` and `runtimes` render with. Each is looked up in an
explanation table below, so a column, kind or evidence source added without an explanation
makes `help_text()` raise (and the help test fail) instead of showing an unexplained mark.
"""

from __future__ import annotations

import textwrap
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.keys import KEY_DISPLAY_ALIASES, REPLACED_KEYS, key_to_character
from textual.screen import ModalScreen
from textual.widgets import Static

from gputaskman.base.fmt import KIND_MARK
from gputaskman.base.readings import Kind, Reason
from gputaskman.intel import runtimes
from gputaskman.intel.evidence import Source
from gputaskman.render import report, report_models, text_report
from gputaskman.render.report_owners import OPTIONAL_COLUMNS
from gputaskman.tui.widgets.process_table import ENGINE_COLUMNS, IDENTITY_COLUMNS, SORT_MARKS

COLUMN_HELP: dict[str, str] = {
    "PID": "process id; HOST:PID (windows:1234) is a process of another OS (WSL: the "
    "Windows host), never joined with this machine's processes",
    "NAME": "process name",
    "GPU": "index of the GPU it holds a context on (n/a: none known)",
    "VRAM": "its GPU memory, measured by the driver unless marked (below); only measured "
    "values are summed",
    "PAGED": "non-local / compressed graphics memory (Windows Non Local Usage, macOS "
    "compressed), measured; shown only when a backend reports it, never in totals",
    "RAM": "resident RAM as the OS reports it (not GPU memory)",
    "CPU%": "CPU, percent of one core (200 = two busy cores); n/a on a first sample",
    "RUNTIMES": "GPU and ML runtimes mapped into the process (detection, not proof)",
    "CATEGORY": "what the process appears to do (LLM inference, training, graphics, ...)",
    "MODEL": "the model it holds, with an evidence tag (below)",
    "GPU%": "its share of the GPU's time (NVML process utilisation, measured); shown while a "
    "row has one",
    "ENC%": "its video encoder load, measured; shown while a row has one",
    "DEC%": "its video decoder load, measured; shown while a row has one",
    "USER": "the user it runs as (n/a until it is scanned)",
    "TIME": "how long it has run when the sample was taken (M:SS, H:MM:SS, D-HH:MM:SS)",
    "COMMAND": "its command line, secrets redacted as in the inspector",
    "SWAPPED": "its memory swapped out (VmSwap, measured; m turns it on); 'pool': duvm's "
    "device is the only active swap device, 'swap': any other swap",
    "LOCKED": "its mlock'ed memory (VmLck, measured; m): swap never takes it",
    "PINNED": "its memory the kernel pinned for a device, RDMA or io_uring (VmPin, measured; "
    "m): swap never takes it",
    "OWNER": "its pod (namespace/name where a local source names it), Slurm job.step, "
    "container, session or unit, as its cgroup names them (o turns it on; n/a: unreadable)",
}

KIND_HELP: dict[Kind, str] = {
    Kind.MEASURED: "measured by the driver or the OS; only these are summed",
    Kind.INFERRED: "inferred (derived; shown and sorted, never summed)",
    Kind.ESTIMATED: "estimated (computed from a model, e.g. GGUF sizes; never summed)",
    Kind.RUNTIME: "reported by a runtime (log or local API; never summed)",
}

LOUD_HELP: dict[Reason, str] = {
    Reason.HIDDEN: "the driver lists the process but withholds its memory",
    Reason.DENIED: "permission refused (another user's process: run as root)",
    Reason.GPU_LOST: "the GPU stopped answering",
}

EVIDENCE_HELP: dict[Source, str] = {
    Source.API: "the runtime's local API named it",
    Source.MAPPED: "the file is memory-mapped by the process",
    Source.CMDLINE: "the value of a model flag (-m, --model, ...)",
    Source.PATH_ARG: "some argument looks like a model file (informational only)",
    Source.INSTALLED: "the file sits in a model store (says nothing about residency)",
}


WIDTH = 88  # the help pane's text width


def _row(mark: str, text: str, width: int = 24) -> str:
    first = f"  {mark:<{width}} "
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=" " * len(first))


def column_lines(columns: tuple[str, ...] = text_report.PAGED_COLUMNS) -> list[str]:
    """One line per column the process table can show (KeyError: one is unexplained).
    `columns` is the widest memory table's (tests add one the help does not know)."""
    labels = [*columns, *ENGINE_COLUMNS, *IDENTITY_COLUMNS, *OPTIONAL_COLUMNS]
    return [_row(label, COLUMN_HELP[label], 9) for label in labels]


def mark_lines(loud_reasons: tuple[Reason, ...] = text_report.LOUD_REASONS) -> list[str]:
    """Every mark a table cell can carry, with its meaning (KeyError: one is unexplained).
    `loud_reasons` are the reasons a VRAM cell spells out (tests add one)."""
    size = "1.2 GiB"
    lines = [_row(f"{mark}{size}", KIND_HELP[kind]) for kind, mark in KIND_MARK.items()]
    lines += [
        _row(
            f"{KIND_MARK[Kind.INFERRED]}{size}{text_report.UNIQUE_MARK}",
            f"{text_report.UNIQUE_MARK} only one explanation fits the inference",
        ),
        _row(report.NA, "unknown (the inspector says why); never 0"),
        *(_row(f"{report.NA} ({reason})", LOUD_HELP[reason]) for reason in loud_reasons),
        _row("windows:PID", "a process of another OS (HOST:PID), see PID"),
        _row(
            f"RUNTIMES {text_report.NOT_SCANNED_MARK}",
            "not scanned yet (scans are budgeted per refresh)",
        ),
        _row(
            f"CATEGORY name{runtimes.HEURISTIC_MARK}",
            "only process or file names support the category (heuristic)",
        ),
    ]
    return lines


def model_lines() -> list[str]:
    """The MODEL column's evidence tags and marks."""
    ok, unsure = report_models.CONFIRMED_MARK, report_models.UNCONFIRMED_MARK
    lines = [_row(s.value, EVIDENCE_HELP[s]) for s in Source]
    lines += [
        _row(f"[api{ok}]", f"{ok} confirmed: two of api/mapped/cmdline agree"),
        _row(f"[mapped{unsure}]", f"{unsure} one corroborating source only"),
        _row(f"[{Source.PATH_ARG.value}]", "no mark: informational only, no breakdown"),
        _row(
            f"[cmdline{unsure}]{report_models.PENDING_MARK}",
            f"{report_models.PENDING_MARK} API, header and log look still running",
        ),
        _row(report_models.SELECTED_TAG, "an app's selected model: a setting, not residency"),
    ]
    return lines


def screen_lines() -> list[str]:
    """The header, panels, status line and inspector."""
    down, up = SORT_MARKS
    return [
        "Header, panels and status line",
        _row("memory bar", "the GPU's used / total memory (measured; ~ when inferred)"),
        _row(
            "attributed",
            'sum of measured per-process VRAM; "lower bound" when some process '
            "memory was hidden or a process list failed",
        ),
        _row("GTT", "amdgpu: system memory the GPU has mapped (not VRAM)"),
        _row(
            f"VRAM {down} / VRAM {up}", "the sort column and direction; unknowns always sort last"
        ),
        _row("SYSTEM", "RAM, swap and CPU as the OS reports them; never GPU memory"),
        _row("duvm pool lines", "reported by duvm's daemon/memserver (runtime), never summed"),
        _row("PAUSED", 'refresh paused (space resumes); otherwise "every Ns"'),
        "Inspector (i)",
        _row(
            "[kind, source]",
            "every number with its provenance and, when unknown, the "
            "reason; a row counted under a parent PID (WSL) is inside that parent's "
            "measured total and never added again",
        ),
    ]


def help_text(
    bindings: list[Binding],
    *,
    columns: tuple[str, ...] = text_report.PAGED_COLUMNS,
    loud_reasons: tuple[Reason, ...] = text_report.LOUD_REASONS,
) -> str:
    """The whole help text (the keys of `bindings`, then columns, marks and notes);
    `columns` and `loud_reasons` go to `column_lines` and `mark_lines`."""
    return "\n".join(
        [
            "gputaskman keys",
            *key_lines(bindings),
            "",
            "Process table columns",
            *column_lines(columns),
            "",
            "Marks in the table",
            *mark_lines(loud_reasons),
            "",
            "MODEL evidence, strongest first, and its tags",
            *model_lines(),
            "",
            *screen_lines(),
            "",
            "escape, q or ? closes this help",
        ]
    )


def key_label(key: str) -> str:
    """What a user presses for Textual's key name: `?` for "question_mark", `/` for "slash"
    (Textual's name for the character Unicode calls solidus), `esc` for "escape"; a plain
    letter stays itself."""
    key = key.strip()
    return (
        KEY_DISPLAY_ALIASES.get(key)
        or key_to_character(key)
        or key_to_character(REPLACED_KEYS.get(key, key))
        or key
    )


def key_lines(bindings: list[Binding]) -> list[str]:
    lines = []
    for b in bindings:
        keys = ", ".join(key_label(k) for k in b.key.split(","))
        lines.append(f"  {keys:<14} {b.description}")
    return lines


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape,q,question_mark", "app.pop_screen", "close help"),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 96; height: auto; max-height: 90%;
        border: thick $primary; background: $surface; padding: 1 2;
    }
    """

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self._key_list = bindings

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(help_text(self._key_list), id="help-text", markup=False)
