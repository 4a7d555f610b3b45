"""Which request path runs (duvm.base.accel): the compiled modules setup.py builds, the
DUVM_PURE_PYTHON switch, a missing or stale build noticed and said (never silently), and
doctor and the daemon reporting it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.base import accel
from duvm.node.doctor import doctor_host
from duvm.node.doctor.doctor_check import OK, WARN

PKG = Path(__file__).resolve().parents[1]


def test_accel_knows_every_module_setup_py_builds() -> None:
    """Catches a compiled module added to setup.py but not to accel.MODULES: doctor and
    status would then say "compiled" while that layer silently ran the pure path."""
    tree = ast.parse((PKG / "setup.py").read_text())
    compiled = next(
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "COMPILED" for t in n.targets)
    )
    assert isinstance(compiled, ast.Dict)
    assert sorted(ast.literal_eval(k) for k in compiled.keys) == sorted(accel.MODULES)
    for name in accel.MODULES:  # each beside the pure module it accelerates, with its source
        assert (PKG / "src" / Path(*name.split("."))).with_suffix(".pyx").is_file()


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if k != accel.ENV}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=e | env
    )


def test_without_a_build_the_pure_path_runs_and_says_so() -> None:
    """Catches a missing build that goes unsaid: doctor must warn with the fix, the daemon's
    start must log a warning, and the ciphers must still work (the pure path)."""
    code = (
        "import sys, json, logging, os\n"
        "sys.modules['duvm.store._pagecipher'] = None\n"  # as if never built
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from duvm.base import accel\n"
        "from duvm.node.doctor import doctor_host\n"
        "from duvm.store.page_cipher import page_cipher\n"
        "c = doctor_host.check_request_path()\n"
        "accel.announce(logging.getLogger('t')); accel.announce(logging.getLogger('t'))\n"
        "cipher = type(page_cipher(os.urandom(32))).__name__\n"
        "print(json.dumps([c.status, c.detail, c.fix, cipher]))\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr
    status, detail, fix, cipher = json.loads(res.stdout)
    assert status == WARN and "not built" in detail and "libssl-dev" in fix
    assert cipher == "PurePageCipher"
    warned = [line for line in res.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warned) == 1 and "pure Python" in warned[0]  # once, not per call


def test_the_switch_chooses_the_reference_without_a_warning() -> None:
    res = _python(
        "import json\nfrom duvm.node.doctor import doctor_host\n"
        "c = doctor_host.check_request_path(); print(json.dumps([c.status, c.detail]))",
        DUVM_PURE_PYTHON="1",
    )
    assert res.returncode == 0, res.stderr
    status, detail = json.loads(res.stdout)
    assert status == OK and accel.ENV in detail and "chosen" in detail


def test_a_stale_build_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a build older than its source being run (code nobody reads): a module whose
    SOURCE_DIGEST is not the SHA-256 of the .pyx beside it is refused with the fix."""
    import hashlib

    pkg = tmp_path / "stalepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    source = b"# the source as it is now\n"
    (pkg / "_fast.pyx").write_bytes(source)
    (pkg / "_fast.py").write_text("SOURCE_DIGEST = 'built from an older source'\n")
    (pkg / "_current.pyx").write_bytes(source)
    digest = hashlib.sha256(source).hexdigest()
    (pkg / "_current.py").write_text(f"SOURCE_DIGEST = {digest!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(accel.ENV, raising=False)
    assert accel.load("stalepkg._fast") is None
    assert "stale build" in accel.state("stalepkg._fast")
    assert "uv sync --reinstall-package duvm" in accel.state("stalepkg._fast")
    assert accel.load("stalepkg._current") is not None  # the check passes a current build


def test_a_build_older_than_its_c_interface_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a build older than the .pxd beside its .pyx (the C interface other compiled
    modules cimport, as the encrypting filter's path cimports the page cipher's): the digest
    covers both, as setup.py builds it."""
    import hashlib

    pkg = tmp_path / "pxdpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    source, interface = b"# the source\n", b"# the C interface as it is now\n"
    for name in ("_old", "_new"):
        (pkg / f"{name}.pyx").write_bytes(source)
        (pkg / f"{name}.pxd").write_bytes(interface)
    old = hashlib.sha256(source).hexdigest()  # built before the .pxd was there, or changed
    (pkg / "_old.py").write_text(f"SOURCE_DIGEST = {old!r}\n")
    new = hashlib.sha256(source + interface).hexdigest()
    (pkg / "_new.py").write_text(f"SOURCE_DIGEST = {new!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(accel.ENV, raising=False)
    assert "stale build" in accel.state("pxdpkg._old")
    assert accel.load("pxdpkg._new") is not None


def test_doctor_and_the_report_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(accel.ENV, raising=False)
    rep, check = accel.report(), doctor_host.check_request_path()
    assert (rep.path == "compiled") is (check.status == OK)
    if rep.path == "compiled":
        assert set(rep.modules.values()) == {"compiled"}


def test_announce_logs_the_path() -> None:
    res = _python(
        "import logging\nlogging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "from duvm.base import accel\nprint(accel.announce(logging.getLogger('t')).path)"
    )
    assert res.returncode == 0, res.stderr
    assert f"request path: {'compiled' if res.stdout.strip() == 'compiled' else 'pure'}" in (
        res.stderr
    )
