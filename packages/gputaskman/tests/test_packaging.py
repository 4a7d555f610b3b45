"""Release checks for the gputaskman distribution: what a user installs, installed for real.

`uv build` makes the sdist and, from that sdist, the wheel (so a file missing from the sdist
breaks the wheel build). The wheel goes into a fresh `uv venv` in a temporary directory
(dependencies resolved from the package index, so these tests skip when it is unreachable),
and the console scripts are run from that venv with the working directory outside the
checkout, so nothing can come from the workspace's sources. Also: `uv lock --check`, which
fails when a pyproject.toml changed without `uv lock`.
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "packages" / "gputaskman"
NAME = "gputaskman"

_spec = importlib.util.spec_from_file_location("wheel_check", ROOT / "tools" / "wheel_check.py")
assert _spec is not None and _spec.loader is not None
wheel_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheel_check)
VERSION = wheel_check.version_of(NAME)
uv = wheel_check.uv
run_tool = wheel_check.run_tool

pytestmark = pytest.mark.skipif(wheel_check.UV is None, reason="uv is not on PATH")


dist, venv = wheel_check.pytest_fixtures(NAME)


@pytest.mark.slow
def test_sdist_has_readme_license_and_sources(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tf:
        names = set(tf.getnames())
        top = f"{NAME}-{VERSION}"
        pkg_info = tf.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = pkg_info.read().decode()
    for f in (
        "README.md",
        "pyproject.toml",
        f"src/{NAME}/cli/__init__.py",
        f"src/{NAME}/__init__.py",
    ):
        assert f"{top}/{f}" in names
    assert "License-Expression: MIT" in meta
    assert f"Version: {VERSION}" in meta
    # the README is the long description, so the index page shows it
    assert "Description-Content-Type: text/markdown" in meta
    assert (PKG / "README.md").read_text().splitlines()[0] in meta


@pytest.mark.slow
def test_wheel_metadata_and_entry_points(dist: dict[str, Path]) -> None:
    with zipfile.ZipFile(dist["wheel"]) as zf:
        info = f"{NAME}-{VERSION}.dist-info"
        meta = zf.read(f"{info}/METADATA").decode()
        eps = zf.read(f"{info}/entry_points.txt").decode()
        names = zf.namelist()
    assert "License-Expression: MIT" in meta
    assert "gputaskman = gputaskman.cli:main" in eps and "gtm = gputaskman.cli:main" in eps
    # only the package goes into the wheel: no tests, no workspace files
    assert all(n.startswith((f"{NAME}/", info)) for n in names), names
    assert f"{NAME}/base/snapshot.schema.json" in names  # the JSON Schema ships with the package


@pytest.mark.slow
def test_installed_wheel_runs_version_help_json(venv: Path) -> None:
    where = run_tool(venv, "python", "-c", "import gputaskman, sys; print(gputaskman.__file__)")
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the wheel, not src/

    for script in ("gputaskman", "gtm"):
        res = run_tool(venv, script, "--version")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == f"gputaskman {VERSION}"

    res = run_tool(venv, "gputaskman", "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: gputaskman")
    assert "--json" in res.stdout and "record" in res.stdout

    res = run_tool(venv, "gputaskman", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema"] == "gputaskman.snapshot" and doc["schema_version"] == 1
    assert doc["tool"] == {"name": "gputaskman", "version": VERSION}
    assert isinstance(doc["system"], dict)  # the system panel works without a GPU
    if not Path("/dev/nvidiactl").exists():
        # no NVIDIA driver here: the installed tool says so instead of inventing adapters
        assert doc["available"] is False and doc["adapters"] == []


def test_version_matches_package() -> None:
    from gputaskman import __version__

    assert __version__ == VERSION, "bump [project].version and __init__.__version__ together"


@pytest.mark.slow
def test_uv_lock_is_current() -> None:
    res = uv("lock", "--check", timeout=120)
    if res.returncode != 0 and "Failed to fetch" in res.stderr:
        pytest.skip(f"uv lock --check needs the package index: {res.stderr.strip()[:200]}")
    assert res.returncode == 0, "uv.lock is stale: run `uv lock` and commit it\n" + res.stderr
