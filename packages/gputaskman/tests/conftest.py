"""gputaskman's tests: their helper modules (tui_support, mocked_snapshots, gguf_files ...) sit
beside them and import by name; with `--import-mode=importlib` pytest does not put this folder
on sys.path itself, so it is put there once, here."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
