"""No test of either package replaces a module global of the project's own code: a seam a
test needs is a parameter with the real thing as its default (tools/patch_check.py). Both
packages are checked here, beside the module map (test_module_map.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("patch_check", ROOT / "tools" / "patch_check.py")
pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pc)

ROOTS = {
    "duvm": ROOT / "packages" / "duvm" / "src" / "duvm",
    "gputaskman": ROOT / "packages" / "gputaskman" / "src" / "gputaskman",
}


def test_no_test_patches_a_module_global_of_either_package() -> None:
    tests = sorted((ROOT / "packages").glob("*/tests/**/*.py"))
    assert len(tests) > 100
    assert pc.module_patches(tests, ROOTS) == []


def test_the_checker_finds_every_form_of_a_module_patch() -> None:
    """Catches a checker that cannot fail: each way a test can replace a module global is
    found (a name bound by `from`, by `import ... as`, or by importlib; the dotted-string
    forms of monkeypatch and mock; plain assignment), and patches of the operating system,
    of objects and of modules outside the packages are not."""
    source = """
import importlib
import os
import duvm.node.attach.attach as att
from unittest import mock
from duvm.node.lifecycle import control
from duvm.store import remote_write
from gputaskman.render import text_report
from duvm.base.units import parse_size

def test_it(monkeypatch, store):
    fan = importlib.import_module("duvm.store.remote_write")
    monkeypatch.setattr(control, "load_daemon", None)
    monkeypatch.setattr(att, "detach", None)
    monkeypatch.setattr("duvm.node.attach.attach_kernel.available", None)
    mock.patch("gputaskman.cli.main")
    mock.patch.object(text_report, "PAGED_COLUMNS", ())
    remote_write.page_crcs = None
    fan.page_crcs = None
    monkeypatch.setattr(os, "write", None)
    monkeypatch.setattr(control.os, "write", None)
    monkeypatch.setattr("sys.platform", "win32")
    monkeypatch.setattr(store, "closing", True)
    parse_size.cache = None
    store.table = None
"""
    assert pc.patches_in(source, ROOTS) == [
        (13, "control.load_daemon"),
        (14, "att.detach"),
        (15, "duvm.node.attach.attach_kernel.available"),
        (16, "gputaskman.cli.main"),
        (17, "text_report.PAGED_COLUMNS"),
        (18, "remote_write.page_crcs"),
        (19, "fan.page_crcs"),
    ]
