"""The fleet's help: its keys, its columns, every host status, and the marks and model tags the
cells carry (the single-host help's own lines, `help.mark_lines` and `help.model_lines`).

Like the single-host help, nothing is a copy: the columns come from `fleet.view.COLUMNS` and
the statuses from `fleetdoc.HostStatus`, each looked up in a table here, so a column or a
status added without an explanation makes `fleet_help_text` raise (and its test fail).
"""

from __future__ import annotations

import textwrap

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fleet.view import COLUMNS
from gputaskman.tui.screens.help import WIDTH, HelpScreen, key_lines, mark_lines, model_lines

COLUMN_HELP: dict[str, str] = {
    "HOST": "the host as named on the command line or in the hosts file",
    "GPU": "the GPU's index and name on that host; for a host that is not up, its status and "
    "why (never numbers)",
    "MEMORY": "memory used / total and the share used (measured unless marked ~)",
    "UTIL": "GPU utilisation (measured)",
    "PROCESSES": "the processes holding the most memory on that GPU (measured unless marked)",
    "MODELS": "the models held on that GPU, each with its evidence tag (below)",
}

STATUS_HELP: dict[HostStatus, str] = {
    HostStatus.UP: "its last poll read a snapshot document (from Prometheus: its last "
    "scrape worked and is recent; unreachable, slow, refused and error then carry "
    "Prometheus's own reason)",
    HostStatus.WAITING: "not polled yet",
    HostStatus.STARTING: "its serve has no sample yet (HTTP 503)",
    HostStatus.UNREACHABLE: "no connection (refused, no route, no such name, or timed out); "
    "the row keeps when it last answered",
    HostStatus.SLOW: "connected, but no whole answer within the poll timeout",
    HostStatus.REFUSED: "the token (or the TLS client certificate) was not accepted",
    HostStatus.INCOMPATIBLE: "not a snapshot this gputaskman reads: another schema_version, "
    "no /snapshot.json, too large, or malformed (the reason names the place)",
    HostStatus.ERROR: "any other failed answer (an HTTP error status); from Prometheus: a "
    "scrape that fails for another reason, or Prometheus itself not answering",
    HostStatus.STALE: "from Prometheus: its last scrape of the host is older than three "
    "scrape intervals",
}


def _row(mark: str, text: str, width: int) -> str:
    first = f"  {mark:<{width}} "
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=" " * len(first))


def fleet_help_text(bindings: list[Binding]) -> str:
    return "\n".join(
        [
            "gputaskman fleet keys",
            *key_lines(bindings),
            "",
            "Fleet table columns",
            *(_row(c, COLUMN_HELP[c], 10) for c in COLUMNS),
            "",
            "Host status (after a failure the next try waits twice as long, up to a limit)",
            *(_row(s.value, STATUS_HELP[s], 13) for s in HostStatus),
            "",
            "Summary line",
            _row("hosts N/M up", "hosts whose last poll read a document, of all listed", 13),
            _row(
                "GPU memory",
                "sum of measured used and total over the GPUs of hosts that are up; a GPU "
                "without measured memory is counted apart, never as 0",
                13,
            ),
            _row(
                "apart",
                "inferred (~) device memory and the estimated (≈) and runtime-reported (ʳ) "
                "model memory of the processes: never added to the measured sum",
                13,
            ),
            "",
            "Marks in the cells",
            *mark_lines(),
            "",
            "MODELS evidence tags",
            *model_lines(),
            "",
            "escape, q or ? closes this help",
        ]
    )


class FleetHelpScreen(HelpScreen):
    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(fleet_help_text(self._key_list), id="help-text", markup=False)
