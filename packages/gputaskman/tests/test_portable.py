"""tools/build_portable.py: the one-file gputaskman, built for real with PyInstaller.

Two real builds share one work directory: the normal one must pass its own smoke test (no
Python on PATH: --version, --once, --json, the TUI on a pty) and come with a checksum that
`sha256sum -c` accepts; the second plants a file named like NVML's driver library and must fail
without publishing anything. The FORBIDDEN patterns are also checked on their own, fast.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "build_portable.py"

linux_x86_64 = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="the portable build is Linux x86-64 only",
)


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_portable", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bp = load_script()


def test_forbidden_patterns_catch_driver_libraries_only() -> None:
    names = [
        "libnvidia-ml.so.1",
        "libnvidia-ml.so.550.54.15",
        "libnvidia-encode.so.1",
        "sub/dir/libcuda.so.1",
        "libcuda.so",
        "libamdhip64.so.6",
        "libze_loader.so.1",
        "libze_intel_gpu.so.1",
        "librocm_smi64.so.7",
        "libhsa-runtime64.so.1",
        # not driver libraries: the interpreter, the CUDA runtime, look-alike names
        "libpython3.11.so.1.0",
        "libcudart.so.12",
        "libssl.so.3",
        "libcudaplugin.so",
        "python3.11/lib-dynload/_ctypes.cpython-311-x86_64-linux-gnu.so",
        "nvidia-ml-py.txt",
        "LIBNVIDIA-ML.SO.1",
    ]
    assert bp.forbidden_entries(names) == sorted(
        [
            "libnvidia-ml.so.1",
            "libnvidia-ml.so.550.54.15",
            "libnvidia-encode.so.1",
            "sub/dir/libcuda.so.1",
            "libcuda.so",
            "libamdhip64.so.6",
            "libze_loader.so.1",
            "libze_intel_gpu.so.1",
            "librocm_smi64.so.7",
            "libhsa-runtime64.so.1",
        ]
    )


def test_no_python_env_really_has_no_python(tmp_path: Path) -> None:
    env = bp.no_python_env(tmp_path)
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "NO_COLOR"}  # nothing inherited
    assert list(Path(env["PATH"]).iterdir()) == []


def run_build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("PyInstaller") is None:
        pytest.skip("PyInstaller is not installed (uv sync installs the dev group)")
    return tmp_path_factory.mktemp("portable-work")


@pytest.fixture(scope="module")
def built(work: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("portable-out")
    res = run_build("--out", str(out), "--work", str(work))
    assert res.returncode == 0, res.stdout + res.stderr
    return out, res.stdout


@linux_x86_64
@pytest.mark.slow
def test_portable_build_passes_smoke_test_and_check(
    built: tuple[Path, str], tmp_path: Path
) -> None:
    out, log = built
    from gputaskman import __version__

    name = f"gputaskman-{__version__}-linux-x86_64"
    assert sorted(p.name for p in out.iterdir()) == [name, f"{name}.sha256"]
    exe = out / name
    # the script's own smoke test ran every mode without Python on PATH
    for mode in ("--version", "--once", "--json"):
        assert f"smoke: gputaskman {mode} -> exit 0" in log
    assert "smoke: gputaskman (TUI on a pty, q) -> ok" in log
    assert "forbidden-library check: none of" in log
    print(log)  # build time and size, for the report

    # the checksum file is what sha256sum -c expects
    res = subprocess.run(
        ["sha256sum", "-c", f"{name}.sha256"], cwd=out, capture_output=True, text=True, check=False
    )
    assert res.returncode == 0 and res.stdout.strip() == f"{name}: OK", res.stdout + res.stderr

    # independently of the script: nothing forbidden in the archive, and the interpreter is
    # inside (so the host's Python is never used)
    names = bp.bundled_names(exe)
    assert bp.forbidden_entries(names) == []
    assert any(n.startswith("libpython3") for n in names)

    # and it runs from a directory of its own with nothing but an empty PATH
    env = bp.no_python_env(tmp_path)
    res = subprocess.run(
        [str(exe), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tool"] == {"name": "gputaskman", "version": __version__}


@linux_x86_64
@pytest.mark.slow
def test_planted_driver_library_fails_the_build(
    work: Path, tmp_path: Path, built: tuple[Path, str]
) -> None:
    # `built` first: the planted build then reuses the normal build's work directory
    plant = tmp_path / "libnvidia-ml.so.1"
    plant.write_bytes(b"\x7fELF not really NVML")
    out = tmp_path / "out"
    res = run_build("--out", str(out), "--work", str(work), "--plant-forbidden", str(plant))
    assert res.returncode == 1, res.stdout + res.stderr
    assert (
        "FAILED: driver libraries inside the bundle (they must come from the installed "
        "driver): libnvidia-ml.so.1"
    ) in res.stderr
    assert not out.exists()  # nothing published: no executable, no checksum
    leftovers = [p.name for p in (work / "dist").iterdir()] if (work / "dist").exists() else []
    assert not any(n.startswith("gputaskman-") for n in leftovers)


def test_plant_must_be_a_file(tmp_path: Path) -> None:
    res = run_build("--out", str(tmp_path / "o"), "--plant-forbidden", str(tmp_path / "nope"))
    assert res.returncode == 2 and "is not a file" in res.stderr
    assert not (tmp_path / "o").exists()


def test_sha256_file_matches_hashlib_tool(tmp_path: Path) -> None:
    f = tmp_path / "blob"
    f.write_bytes(b"x" * (3 << 20) + b"tail")
    sha = shutil.which("sha256sum")
    if sha is None:
        pytest.skip("sha256sum (coreutils) not installed")
    expect = subprocess.run(
        [sha, str(f)], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    assert bp.sha256_file(f) == expect
