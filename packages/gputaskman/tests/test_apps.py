"""apps.py: the Handy adapter on a real settings/log layout in a temp home.

File formats follow Handy's source (settings_store.json written by tauri-plugin-store, log
lines by tauri-plugin-log); the files here are written by the test, not by Handy.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from gputaskman.intel import apps
from gputaskman.intel.apps import APPS, AppSpec, expand_paths, read_app_model, spec_for_process

HANDY = APPS[0]
SECRET = "sk-do-not-show"
TRANSCRIPT = "please buy milk and Successfully loaded transcription model: evil (took 1ms)"


def _handy_home(tmp_path: Path, settings: object | None, log_lines: list[str] | None) -> Path:
    base = tmp_path / ".local" / "share" / "com.pais.handy"
    base.mkdir(parents=True)
    if settings is not None:
        body = settings if isinstance(settings, str) else json.dumps(settings)
        (base / "settings_store.json").write_text(body)
    if log_lines is not None:
        (base / "logs").mkdir()
        (base / "logs" / "handy.log").write_text("\n".join(log_lines) + "\n")
    return tmp_path


def _line(msg: str, level: str = "DEBUG", t: str = "10:00:00") -> str:
    return f"[2026-11-29][{t}][handy_app_lib::managers::transcription][{level}] {msg}"


SETTINGS = {
    "settings": {
        "selected_model": "parakeet-tdt-0.6b-v3",
        "post_process_api_keys": {"openai": SECRET},
    }
}


def test_handy_selected_model_and_last_event(tmp_path: Path) -> None:
    home = _handy_home(
        tmp_path,
        SETTINGS,
        [
            _line("Starting to load model: small"),
            _line("Successfully loaded transcription model: small (took 812ms)", t="10:00:01"),
            _line(f"Transcription result: {TRANSCRIPT}", level="INFO", t="10:00:02"),
            _line("Model switched to parakeet-tdt-0.6b-v3 via tray.", level="INFO", t="10:00:03"),
            _line(f"Transcription result: {TRANSCRIPT}", level="INFO", t="10:00:04"),
        ],
    )
    m = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert m.selected == "parakeet-tdt-0.6b-v3"
    assert (m.last_event, m.last_event_model, m.last_event_time) == (
        "loaded",
        "parakeet-tdt-0.6b-v3",
        "2026-11-29 10:00:03",
    )
    assert m.reasons == ()
    doc = json.dumps(m.to_json())
    assert SECRET not in doc and "milk" not in doc and "evil" not in doc
    assert json.loads(doc)["evidence"] == "settings"


def test_unload_is_the_last_event(tmp_path: Path) -> None:
    home = _handy_home(
        tmp_path,
        SETTINGS,
        [
            _line("Successfully loaded transcription model: small (took 1ms)"),
            _line("Model unloaded due to inactivity (took 3ms)", level="INFO"),
        ],
    )
    m = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert (m.last_event, m.last_event_model) == ("unloaded", None)


def test_transcript_text_never_matches(tmp_path: Path) -> None:
    home = _handy_home(tmp_path, SETTINGS, [_line(f"Transcription result: {TRANSCRIPT}")])
    m = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert m.last_event is None and "no model event in the log tail" in m.reasons


@pytest.mark.parametrize(
    "settings,reason",
    [
        ("{broken", "settings file is not JSON"),
        ({"settings": {"selected_model": ""}}, "no model selected in settings"),
        ({"settings": None}, "no model selected in settings"),
        ([1, 2], "no model selected in settings"),
        (" " * (apps.MAX_SETTINGS + 1), "settings file larger than the cap"),
    ],
)
def test_odd_settings_give_a_reason(tmp_path: Path, settings: object, reason: str) -> None:
    home = _handy_home(tmp_path, settings, None)
    m = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert m.selected is None and reason in m.reasons
    assert any(r.startswith("no log at") for r in m.reasons)


def test_nothing_installed(tmp_path: Path) -> None:
    m = read_app_model(HANDY, env={"HOME": str(tmp_path)}, platform="linux")
    assert (m.selected, m.settings_path, m.log_path, m.last_event) == (None, None, None, None)
    assert len(m.reasons) == 2


def test_log_tail_is_bounded_and_cached(tmp_path: Path) -> None:
    old = _line("Successfully loaded transcription model: old-one (took 1ms)")
    filler = [_line("Recording started", level="INFO")] * (apps.LOG_TAIL // 60 + 100)
    home = _handy_home(tmp_path, SETTINGS, [old, *filler])
    m = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert m.last_event is None  # beyond the tail window: not read
    log = home / ".local/share/com.pais.handy/logs/handy.log"
    with open(log, "a") as f:
        f.write(_line("Starting to load model: new-one") + "\n")
    m2 = read_app_model(HANDY, env={"HOME": str(home)}, platform="linux")
    assert (m2.last_event, m2.last_event_model) == ("loading", "new-one")


def test_platform_paths() -> None:
    env = {"HOME": "/h", "APPDATA": "C:/U/AppData/Roaming", "LOCALAPPDATA": "C:/U/AppData/Local"}
    assert expand_paths(HANDY.settings_paths, env, platform="linux") == [
        "/h/.local/share/com.pais.handy/settings_store.json"
    ]
    assert expand_paths(
        HANDY.log_paths, {"HOME": "/h", "XDG_DATA_HOME": "/x"}, platform="linux"
    ) == ["/x/com.pais.handy/logs/handy.log"]
    assert expand_paths(HANDY.settings_paths, env, platform="darwin") == [
        "/h/Library/Application Support/com.pais.handy/settings_store.json"
    ]
    assert expand_paths(HANDY.log_paths, env, platform="darwin") == [
        "/h/Library/Logs/com.pais.handy/handy.log"
    ]
    assert expand_paths(HANDY.log_paths, env, platform="win32") == [
        "C:/U/AppData/Local/com.pais.handy/logs/handy.log"
    ]


def test_process_names_pick_the_spec() -> None:
    assert spec_for_process("handy") is HANDY
    assert spec_for_process("llama-server") is None


def test_a_second_app_is_a_table_entry(tmp_path: Path) -> None:
    spec = AppSpec(
        name="Other",
        process_names=("other",),
        settings_paths=("{data}/org.other/config.json",),
        settings_key=("model",),
        log_paths=("{logs}/org.other/other.log",),
        log_events=((re.compile(r"^loaded (?P<model>[\w.-]+)$"), "loaded"),),
    )
    base = tmp_path / "share" / "org.other"
    (base / "logs").mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model": "tiny.en"}))
    (base / "logs" / "other.log").write_text("loaded tiny.en\n")
    m = read_app_model(
        spec,
        env={"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "share")},
        platform="linux",
    )
    assert (m.app, m.selected, m.last_event, m.last_event_model) == (
        "Other",
        "tiny.en",
        "loaded",
        "tiny.en",
    )
    assert spec_for_process("other", [*APPS, spec]) is spec
