"""App adapters: name the model an application selected, from its own settings and log.

Theory of operation
-------------------
Some apps load a model, use it and unload it, so neither ``/proc/PID/maps`` nor an API shows
it most of the time. An adapter reads two things the app writes, both read-only:

* its **settings** file (JSON, capped at ``MAX_SETTINGS``): the *selected* model. Only the
  one key path the spec names is extracted; nothing else in the file (API keys among it) is
  kept or returned;
* the **tail of its log** (at most ``LOG_TAIL`` bytes, cached by (path, size, mtime)):
  *timestamped history* of load/unload events, not proof of current residency. Each line is
  matched against the spec's anchored patterns; lines that do not match (transcripts and
  anything else) are dropped unread beyond the match attempt and never stored.

Adapters are rows of :data:`APPS`, so the next app is a table entry. Paths are templates
expanded per platform (``{data}``: XDG data home / Roaming AppData / Application Support;
``{local}``: local data; ``{logs}``: where a Tauri app's ``LogDir`` points).

Handy (cjpais/Handy, bundle id ``com.pais.handy``; facts from its source):
* settings: ``settings_store.json`` in the Tauri app-data dir (``SETTINGS_STORE_PATH`` in
  ``src-tauri/src/settings.rs``), the store's ``settings`` object, key ``selected_model``;
* log: ``handy.log`` in Tauri's ``LogDir`` (``TargetKind::LogDir { file_name: "handy" }`` in
  ``src-tauri/src/lib.rs``): Linux ``$XDG_DATA_HOME/com.pais.handy/logs``, macOS
  ``~/Library/Logs/com.pais.handy``, Windows ``%LOCALAPPDATA%\\com.pais.handy\\logs``
  (Tauri v2 path docs). Portable installs (a ``Data`` folder beside the exe) are not looked
  for. Events (``src-tauri/src/managers/transcription.rs``): ``Starting to load model: ID``,
  ``Successfully loaded transcription model: ID``, ``Model unloaded ...``, and
  ``Model switched to ID via tray.``
Not validated against a running Handy here: the formats are taken from its source.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputaskman.base.filecache import ParsedFiles, read_tail

__all__ = ["APPS", "AppModel", "AppSpec", "expand_paths", "read_app_model", "spec_for_process"]

MAX_SETTINGS = 1024 * 1024
LOG_TAIL = 256 * 1024
_MODEL_ID = r"(?P<model>[\w.\-:/]{1,200})"
_STAMP = re.compile(r"^\[(?P<date>\d{4}-\d{2}-\d{2})\]\[(?P<time>[\d:.]+)\]")


@dataclass(frozen=True, slots=True)
class AppSpec:
    """One app: how to recognise its process, and where its settings and log are."""

    name: str
    process_names: tuple[str, ...]
    settings_paths: tuple[str, ...]
    settings_key: tuple[str, ...]
    log_paths: tuple[str, ...]
    # (compiled pattern with a "model" group where the event names one, event name)
    log_events: tuple[tuple[re.Pattern[str], str], ...]


@dataclass(frozen=True, slots=True)
class AppModel:
    """What an app's own files say. ``selected`` is a setting; events are history."""

    app: str
    selected: str | None
    settings_path: str | None
    last_event: str | None  # "loading" | "loaded" | "unloaded"
    last_event_model: str | None
    last_event_time: str | None  # the log line's own timestamp text, if it has one
    log_path: str | None
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "app": self.app,
            "selected": self.selected,
            "evidence": "settings",
            "last_event": self.last_event,
            "last_event_model": self.last_event_model,
            "last_event_time": self.last_event_time,
            "reasons": list(self.reasons),
        }


APPS: tuple[AppSpec, ...] = (
    AppSpec(
        name="Handy",
        process_names=("handy", "Handy", "handy.exe", "Handy.exe"),
        settings_paths=("{data}/com.pais.handy/settings_store.json",),
        settings_key=("settings", "selected_model"),
        log_paths=("{logs}/com.pais.handy/handy.log",),
        log_events=(
            (re.compile(r"(?:^|\])\s*Starting to load model: " + _MODEL_ID + r"\s*$"), "loading"),
            (
                re.compile(
                    r"(?:^|\])\s*Successfully loaded transcription model: "
                    + _MODEL_ID
                    + r" \(took \d+ms\)\s*$"
                ),
                "loaded",
            ),
            (
                re.compile(r"(?:^|\])\s*Model switched to " + _MODEL_ID + r" via tray\.\s*$"),
                "loaded",
            ),
            (
                re.compile(r"(?:^|\])\s*Model unloaded( manually| due to inactivity| via tray)"),
                "unloaded",
            ),
        ),
    ),
)


def expand_paths(
    templates: Sequence[str],
    env: Mapping[str, str] | None = None,
    home: str | None = None,
    platform: str | None = None,
) -> list[str]:
    """Expand ``{data}``, ``{local}``, ``{logs}`` and ``{home}`` for the platform."""
    env = os.environ if env is None else env
    home = home or env.get("HOME") or os.path.expanduser("~")
    platform = platform or sys.platform
    if platform.startswith("win"):
        data = env.get("APPDATA") or os.path.join(home, "AppData", "Roaming")
        local = env.get("LOCALAPPDATA") or os.path.join(home, "AppData", "Local")
        logs_for = "{local}/{id}/logs"
    elif platform == "darwin":
        data = local = os.path.join(home, "Library", "Application Support")
        logs_for = "{home}/Library/Logs/{id}"
    else:
        data = local = env.get("XDG_DATA_HOME") or os.path.join(home, ".local", "share")
        logs_for = "{local}/{id}/logs"
    out = []
    for t in templates:
        if t.startswith("{logs}/"):
            ident, _, rest = t[len("{logs}/") :].partition("/")
            t = logs_for.replace("{id}", ident) + "/" + rest
        out.append(os.path.normpath(t.format(data=data, local=local, home=home)))
    return out


def spec_for_process(name: str, apps: Sequence[AppSpec] = APPS) -> AppSpec | None:
    """The adapter for a process name (``/proc/PID/comm`` or the exe's base name)."""
    return next((a for a in apps if name in a.process_names), None)


def _read_selected(path: str, key: Sequence[str]) -> tuple[str | None, str | None]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SETTINGS + 1)
    except FileNotFoundError:
        return None, f"no settings file at {path}"
    except OSError as e:
        return None, f"settings unreadable: {e.strerror or e}"
    if len(raw) > MAX_SETTINGS:
        return None, "settings file larger than the cap"
    try:
        node: object = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, "settings file is not JSON"
    for k in key:
        node = node.get(k) if isinstance(node, dict) else None
    if isinstance(node, str) and node:
        return node, None
    return None, "no model selected in settings"


_logs: ParsedFiles[tuple[str | None, str | None, str | None]] = ParsedFiles()


def _last_event(path: str, spec: AppSpec) -> tuple[str | None, str | None, str | None]:
    """(event, model, timestamp) of the last matching log line in the bounded tail."""
    return _logs.get(path, lambda f, size: _scan_events(read_tail(f, size, LOG_TAIL), spec))


def _scan_events(tail: str, spec: AppSpec) -> tuple[str | None, str | None, str | None]:
    for line in reversed(tail.splitlines()):
        for pattern, event in spec.log_events:
            m = pattern.search(line)
            if m:
                stamp = _STAMP.match(line)
                when = f"{stamp['date']} {stamp['time']}" if stamp else None
                return event, m.groupdict().get("model"), when
    return None, None, None


def read_app_model(
    spec: AppSpec,
    env: Mapping[str, str] | None = None,
    home: str | None = None,
    platform: str | None = None,
) -> AppModel:
    """Read one app's selected model and last model event. Never raises for missing files."""
    reasons: list[str] = []
    selected = settings_path = None
    for p in expand_paths(spec.settings_paths, env, home, platform):
        sel, why = _read_selected(p, spec.settings_key)
        if sel or os.path.exists(p):
            selected, settings_path = sel, p
            if why:
                reasons.append(why)
            break
        reasons.append(why or "no settings")
    event = model = when = log_path = None
    for p in expand_paths(spec.log_paths, env, home, platform):
        try:
            event, model, when = _last_event(p, spec)
        except FileNotFoundError:
            reasons.append(f"no log at {p}")
            continue
        except OSError as e:
            reasons.append(f"log unreadable: {e.strerror or e}")
            continue
        log_path = p
        if event is None:
            reasons.append("no model event in the log tail")
        break
    return AppModel(
        spec.name, selected, settings_path, event, model, when, log_path, tuple(reasons)
    )
