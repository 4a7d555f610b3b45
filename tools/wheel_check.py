"""Build a workspace package and install its wheel into a fresh venv, for the release tests.

Shared by packages/*/tests/test_packaging.py (loaded by path, since the two test folders are
not packages). `uv build` makes the sdist and, from it, the wheel; the wheel goes into a new
`uv venv` with dependencies from the package index; tools then run from that venv with the
working directory outside the checkout and an environment that cannot point Python at the
workspace, so nothing can come from the workspace's sources.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tomllib
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv")


def version_of(name: str) -> str:
    """The version in packages/NAME/pyproject.toml."""
    text = (ROOT / "packages" / name / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["version"]


def clean_env() -> dict[str, str]:
    """The environment without anything that points Python at the workspace."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["NO_COLOR"] = "1"
    return env


def index_reachable(timeout: float = 5.0) -> str | None:
    """None when the package index answers a TCP connect, else why not."""
    url = (
        os.environ.get("UV_DEFAULT_INDEX")
        or os.environ.get("UV_INDEX_URL")
        or "https://pypi.org/simple"
    )
    u = urllib.parse.urlsplit(url)
    host, port = u.hostname or "pypi.org", u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"package index {host}:{port} unreachable ({exc})"
    return None


def uv(
    *args: str, cwd: Path = ROOT, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run uv with the clean environment (plus `env`); never raises on a non-zero exit."""
    if UV is None:
        raise RuntimeError("uv is not on PATH")
    return subprocess.run(
        [UV, *args],
        cwd=cwd,
        env=clean_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def build(name: str, out: Path) -> dict[str, Path]:
    """`uv build --package NAME`: returns {"wheel": path, "sdist": path}; asserts one of each."""
    version = version_of(name)
    res = uv("build", "--package", name, "--out-dir", str(out))
    assert res.returncode == 0, res.stderr
    wheels = list(out.glob(f"{name}-{version}-*.whl"))
    sdists = list(out.glob(f"{name}-{version}.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0]}


def install_into_fresh_venv(wheel: Path, where: Path) -> Path:
    """A new venv under WHERE with WHEEL installed; returns the venv folder."""
    res = uv("venv", "--python", sys.executable, str(where / "v"), cwd=where)
    assert res.returncode == 0, res.stderr
    py = where / "v" / "bin" / "python"
    res = uv("pip", "install", "--python", str(py), str(wheel), cwd=where, timeout=600)
    assert res.returncode == 0, res.stderr
    return where / "v"


def run_tool(venv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a console script (or python) of VENV from outside the checkout."""
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=venv.parent,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pytest_fixtures(name: str) -> tuple[object, object]:
    """Module-scoped `dist` and `venv` fixtures for package NAME (pytest imported lazily)."""
    import pytest

    @pytest.fixture(scope="module")
    def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
        return build(name, tmp_path_factory.mktemp("dist"))

    @pytest.fixture(scope="module")
    def venv(dist: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
        why = index_reachable()
        if why:
            pytest.skip(why)
        return install_into_fresh_venv(dist["wheel"], tmp_path_factory.mktemp("venv"))

    return dist, venv
