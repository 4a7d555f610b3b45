"""The TUI's settings that outlive a session: sort column and order, hidden columns, the
columns turned on (`shown_columns`: SWAPPED, LOCKED, PINNED, OWNER), refresh interval and
theme, in ``tui.json`` under the user's config directory (`platformdirs`:
``~/.config/gputaskman`` on Linux).

A missing file means the defaults. A file that cannot be read or parsed, or a value of the
wrong type, is reported (`load` returns the problem for the status line) and the defaults
stand for what it held; the TUI never fails to start over its settings. Writes go to a
temporary file renamed over the old one, so a crash never leaves half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from gputaskman.render.report_owners import OPTIONAL_COLUMNS
from gputaskman.render.text_report import PAGED_COLUMNS
from gputaskman.tui.widgets.process_table import ALWAYS, SORTS

FILE_NAME = "tui.json"


@dataclass(frozen=True)
class Settings:
    sort: str = "VRAM"
    descending: bool = True
    hidden_columns: tuple[str, ...] = ()  # never PID, NAME, VRAM or MODEL
    shown_columns: tuple[str, ...] = ()  # of OPTIONAL_COLUMNS (off by default), those turned on
    interval: float | None = None  # None: the CLI's default
    theme: str | None = None  # a Textual theme name; None: Textual's default


def default_path() -> Path:
    return Path(platformdirs.user_config_dir("gputaskman")) / FILE_NAME


def _check(raw: object) -> tuple[Settings, list[str]]:
    """The settings in a parsed file, and what was wrong with it (dropped, defaults kept)."""
    if not isinstance(raw, dict):
        return Settings(), ["not a JSON object"]
    got: dict[str, object] = {}
    bad: list[str] = []
    sort = raw.get("sort", "VRAM")
    if sort in SORTS:
        got["sort"] = sort
    else:
        bad.append(f"sort {sort!r} is not one of {', '.join(SORTS)}")
    desc = raw.get("descending", True)
    if isinstance(desc, bool):
        got["descending"] = desc
    else:
        bad.append("descending must be true or false")
    hidden = raw.get("hidden_columns", [])
    ok = (
        [c for c in hidden if c in PAGED_COLUMNS and c not in ALWAYS]
        if isinstance(hidden, list)
        else []
    )
    if not isinstance(hidden, list) or len(ok) != len(hidden):
        bad.append(
            f"hidden_columns may name only {', '.join(c for c in PAGED_COLUMNS if c not in ALWAYS)}"
        )
    got["hidden_columns"] = tuple(ok)
    shown = raw.get("shown_columns", [])
    on = [c for c in shown if c in OPTIONAL_COLUMNS] if isinstance(shown, list) else []
    if not isinstance(shown, list) or len(on) != len(shown):
        bad.append(f"shown_columns may name only {', '.join(OPTIONAL_COLUMNS)}")
    got["shown_columns"] = tuple(dict.fromkeys(on))
    interval = raw.get("interval")
    if interval is None or (
        isinstance(interval, (int, float))
        and not isinstance(interval, bool)
        and 0.05 <= interval <= 3600
    ):
        got["interval"] = None if interval is None else float(interval)
    else:
        bad.append("interval must be a number of seconds from 0.05 to 3600")
    theme = raw.get("theme")
    if theme is None or isinstance(theme, str):
        got["theme"] = theme
    else:
        bad.append("theme must be a name")
    return Settings(**got), bad  # type: ignore[arg-type]


def load(path: Path) -> tuple[Settings, str | None]:
    """The settings at `path` and a one-line problem to show (None when all is well)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings(), None
    except OSError as e:
        return Settings(), f"settings {path} unreadable ({e.strerror or e}): defaults used"
    except UnicodeDecodeError:
        return Settings(), f"settings {path} is not JSON (not UTF-8 text): defaults used"
    try:
        raw = json.loads(text)
    except ValueError as e:
        return Settings(), f"settings {path} is not JSON ({e}): defaults used"
    settings, bad = _check(raw)
    if bad:
        return settings, f"settings {path}: {'; '.join(bad)} (defaults used for those)"
    return settings, None


def save(settings: Settings, path: Path) -> str | None:
    """Write `settings` to `path` atomically; the problem in words if it could not be."""
    data = dataclasses.asdict(settings)
    data["hidden_columns"] = list(settings.hidden_columns)
    data["shown_columns"] = list(settings.shown_columns)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tui.", suffix=".json")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        return f"settings not saved to {path}: {e.strerror or e}"
    return None
