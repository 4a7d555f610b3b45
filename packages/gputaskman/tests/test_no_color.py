"""``--no-color`` and ``NO_COLOR`` (https://no-color.org: any non-empty value): the TUI renders
in monochrome, and the text outputs carry no colour. The TUI reads the DRM fixture tree
(`drm_fixtures.write_demo_tree`: kernel formats, not measured on hardware)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gputaskman import cli
from gputaskman.fixtures.drm_fixtures import write_demo_tree

GTM = str(Path(sys.executable).parent / "gputaskman")
ESC = "\x1b"
RICH_DEFAULT_FG = "c5c8c6"
NO_COLOR_AT_IMPORT = os.environ.get("NO_COLOR")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write_demo_tree(root)
    return root


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No NO_COLOR to start with, and as it was afterwards (the code under test sets it in
    this process; left set, every later TUI test would render in monochrome), and a
    settings directory of the test's own."""
    saved = os.environ.pop("NO_COLOR", None)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    try:
        yield
    finally:
        os.environ.pop("NO_COLOR", None)
        if saved is not None:
            os.environ["NO_COLOR"] = saved


def colours_of(svg: str) -> set[str]:
    """The colours the app painted that are not greys (r == g == b): the cells' backgrounds
    and the text styles in use. Rich's window frame is left out, and so is its default
    foreground (text given no colour at all)."""
    css = dict(re.findall(r"\.(terminal-\d+-r\d+) \{ fill: #([0-9a-f]{6})", svg))
    text = {css[c] for c in re.findall(r'<text class="(terminal-\d+-r\d+)"', svg)}
    cells = set(re.findall(r'<rect fill="#([0-9a-f]{6})"[^>]*crispEdges', svg))
    assert text and cells, "the screenshot's layout is not the one this test reads"
    painted = (text | cells) - {RICH_DEFAULT_FG}
    return {c for c in painted if not c[0:2] == c[2:4] == c[4:6]}


async def screenshot(argv: list[str]) -> tuple[bool, str]:
    """Parse argv as main() does, build the TUI, and export an SVG after the first sample."""
    args = cli.build_parser().parse_args(argv)
    cli.apply_color_choice(args.no_color, os.environ)
    app = cli.tui_app(args)
    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 30  # generous: the machine may be busy
        while not app.samples and time.monotonic() < deadline:
            await pilot.pause(0.02)
        assert app.samples, "no sample arrived"
        await pilot.pause()  # let the table repaint with it
        return app.no_color, app.export_screenshot()


@pytest.mark.usefixtures("env")
async def test_tui_with_no_color_renders_in_monochrome(tree: Path):
    mono, svg = await screenshot(["--no-color", "--sysroot", str(tree)])
    assert mono is True and os.environ["NO_COLOR"] == "1"
    assert "llama-server" in svg  # the table was painted
    assert colours_of(svg) == set()
    # the same screen without the flag has colour (so the check above can fail)
    os.environ.pop("NO_COLOR")
    mono, svg = await screenshot(["--sysroot", str(tree)])
    assert mono is False and colours_of(svg)


@pytest.mark.usefixtures("env")
@pytest.mark.parametrize(("value", "mono"), [("1", True), ("anything", True), ("", False)])
async def test_the_no_color_variable_counts_only_when_not_empty(tree: Path, value, mono):
    os.environ["NO_COLOR"] = value
    got, svg = await screenshot(["--sysroot", str(tree)])
    assert got is mono and bool(colours_of(svg)) is not mono
    assert os.environ.get("NO_COLOR") == (value or None)  # an empty one is dropped


def test_no_color_is_left_as_it_was_for_the_tests_after_these():
    assert os.environ.get("NO_COLOR") == NO_COLOR_AT_IMPORT


def test_no_color_is_taken_before_and_after_a_subcommand():
    parse = cli.build_parser().parse_args
    assert parse(["--no-color", "replay", "f.jsonl"]).no_color is True
    assert parse(["replay", "f.jsonl", "--no-color"]).no_color is True
    assert parse(["summary", "f.jsonl"]).no_color is False
    assert parse(["--no-color", "--once"]).no_color is True


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_text_outputs_print_no_escape_sequences(tree: Path, how: str):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    flag = []
    if how == "flag":
        flag = ["--no-color"]
    else:
        env["NO_COLOR"] = "1"
    for mode in (["--once"], ["--watch", "--count", "2", "--interval", "0.05"], ["--json"]):
        r = subprocess.run(
            [GTM, *flag, *mode, "--sysroot", str(tree)],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        assert "llama-server" in r.stdout
        assert ESC not in r.stdout and ESC not in r.stderr
