"""Release checks for the duvm distribution: what a user installs, installed for real.

`uv build` makes the sdist and, from that sdist, the wheel (so a file missing from the sdist
breaks the wheel build). The wheel goes into a fresh `uv venv` in a temporary directory
(dependencies resolved from the package index, so these tests skip when it is unreachable),
and the console scripts are run from that venv with the working directory outside the
checkout, so nothing can come from the workspace's sources. The workspace-wide
`uv lock --check` lives in gputaskman's test_packaging.py.
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from duvm.base import accel

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "packages" / "duvm"
NAME = "duvm"

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
def test_sdist_has_readme_license_units_and_sources(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tf:
        names = set(tf.getnames())
        top = f"{NAME}-{VERSION}"
        pkg_info = tf.extractfile(f"{top}/PKG-INFO")
        assert pkg_info is not None
        meta = pkg_info.read().decode()
    wanted = [
        "README.md",
        "pyproject.toml",
        "duvm.example.toml",
        f"src/{NAME}/cli/__init__.py",
        f"src/{NAME}/node/daemon/daemon.py",  # the layer folders too
        "systemd/duvm-node.service",
        "systemd/duvm-enable.service",
        "setup.py",  # builds the compiled path, from the .pyx sources
        *(f"src/{m.replace('.', '/')}.pyx" for m in accel.MODULES),
    ]
    missing = [f for f in wanted if f"{top}/{f}" not in names]
    assert not missing, f"not in the sdist: {missing}"
    assert "License-Expression: MIT" in meta
    assert f"Version: {VERSION}" in meta
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
    assert "duvm = duvm.cli:main" in eps
    assert f"{NAME}/node/doctor/doctor.py" in names
    assert all(n.startswith((f"{NAME}/", info)) for n in names), names
    assert not [n for n in names if n.endswith(".c")]  # generated C stays out
    if accel.report().path == "compiled":  # built here, so the wheel carries it too
        for m in accel.MODULES:
            stem = m.replace(".", "/")
            assert any(n.startswith(stem + ".") and n.endswith(".so") for n in names), m


@pytest.mark.slow
def test_installed_wheel_runs_version_help_doctor(venv: Path) -> None:
    where = run_tool(venv, "python", "-c", "import duvm; print(duvm.__file__)")
    assert where.returncode == 0, where.stderr
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout  # the wheel, not src/
    # uvloop is a declared Linux dependency: the fresh venv must have it
    assert run_tool(venv, "python", "-c", "import uvloop").returncode == 0

    res = run_tool(venv, "duvm", "--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"duvm {VERSION}"

    res = run_tool(venv, "duvm", "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: duvm")
    for sub in ("memserver", "enable", "disable", "status", "doctor"):
        assert sub in res.stdout

    # doctor from the wheel: a JSON verdict whatever this machine lacks (exit 0 or 1, never a
    # traceback)
    res = run_tool(venv, "duvm", "doctor", "--json")
    assert res.returncode in (0, 1), res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is (res.returncode == 0)
    assert {c["name"] for c in doc["checks"]} >= {"root", "block-device", "swap-tools"}
    # the installed wheel runs the compiled path wherever the workspace build does
    path = next(c for c in doc["checks"] if c["name"] == "request-path")
    if accel.report().path == "compiled":
        assert path["status"] == "ok" and path["detail"].startswith("compiled"), path


def test_version_matches_package() -> None:
    from duvm import __version__

    assert __version__ == VERSION, "bump [project].version and __init__.__version__ together"


@pytest.mark.slow
def test_without_a_c_compiler_duvm_installs_and_says_it_runs_the_pure_path(tmp_path: Path) -> None:
    """Catches a build that fails, or a duvm that fails to start, where there is no C compiler
    (the extensions are optional, D39), and a pure path taken silently: the wheel built with
    a compiler that always fails carries no extension, installs, works, and doctor warns."""
    why = wheel_check.index_reachable()
    if why:
        pytest.skip(why)
    out = tmp_path / "dist"
    res = uv(
        *("build", "--package", NAME, "--wheel", "--out-dir", str(out)),
        timeout=600,
        env={"CC": "/bin/false", "UV_NO_CACHE": "1"},  # a compiler that always fails
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = out.glob(f"{NAME}-{VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        assert not [n for n in zf.namelist() if n.endswith(".so")]
    venv = wheel_check.install_into_fresh_venv(wheel, tmp_path)
    res = run_tool(venv, "duvm", "doctor", "--json")
    check = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "request-path")
    assert check["status"] == "warn" and "not built" in check["detail"], check
    assert "libssl-dev" in check["fix"]
    works = (
        "import os\nfrom duvm.store.page_cipher import page_cipher, PurePageCipher\n"
        "c = page_cipher(os.urandom(32)); assert isinstance(c, PurePageCipher)\n"
        "p = os.urandom(4096); s = bytearray(4096); m = bytearray(28)\n"
        "c.seal(5, memoryview(p), memoryview(s), memoryview(m))\n"
        "assert c.open(5, memoryview(s), memoryview(bytes(m))) == 1 and bytes(s) == p\n"
        "print('ok')"
    )
    res = run_tool(venv, "python", "-c", works)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
