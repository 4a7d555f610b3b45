"""gputaskman's tests: their helper modules (tui_support, mocked_snapshots, gguf_files ...) sit
beside them and import by name; with `--import-mode=importlib` pytest does not put this folder
on sys.path itself, so it is put there once, here. Fixtures every file may use: `utc`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def utc(monkeypatch):
    """Local time is UTC for the test (times in SVG snapshots do not depend on the machine)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()
