"""enable/disable/status plumbing that needs no daemon: config parsing, refusals, status of a
node where nothing is enabled, and peers that do not answer (unknown, never 0)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from duvm import control
from hypothesis import given
from hypothesis import strategies as st


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "duvm.toml"
    p.write_text(text)
    return p


def test_config_file_parsed(tmp_path: Path) -> None:
    cfg = control.load_config(write(tmp_path, """
peers = ["10.0.0.2:7070", "[::1]:7071", "node3"]
size = "2G"
replicas = 2
priority = 50
state_dir = "/run/duvm-test"
"""))
    assert cfg.peers == ["10.0.0.2:7070", "[::1]:7071", "node3"]
    assert cfg.size == 2 << 30 and cfg.replicas == 2 and cfg.priority == 50
    assert cfg.socket == "/run/duvm-test/nbd.sock"


def test_example_config_in_docs_is_valid() -> None:
    example = Path(__file__).parents[1] / "duvm.example.toml"
    if not example.exists():
        pytest.skip("packages/duvm/duvm.example.toml not written yet")
    assert control.load_config(example).peers


@pytest.mark.parametrize(("text", "message"), [
    ('size = "1G"', "no peers"),
    ('peers = ["a:1"]', "size is missing"),
    ('peers = ["a:1"]\nsize = "lots"', "not a size"),
    ('peers = ["a:1"]\nsize = "1G"\nreplicas = 2', "replicas = 2 needs 1..1"),
    ('peers = ["a:99999"]\nsize = "1G"', "bad peer address"),
    ('peers = [1, 2]\nsize = "1G"', "list of"),
    ('peers = ["a:1"]\nsize = "1G"\ncolour = "blue"', "unknown key"),
    ('peers = ["a:1"]\nsize = "1000"', "at least 1 MiB"),
    ("peers = [", "not valid TOML"),
])
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(control.ControlError, match=message):
        control.load_config(write(tmp_path, text))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(control.ControlError, match="cannot read config"):
        control.load_config(tmp_path / "absent.toml")


@given(st.text(max_size=300))
def test_fuzz_config_never_crashes(text: str) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        control.load_config(Path(f.name))
    except control.ControlError:
        pass
    finally:
        os.unlink(f.name)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "duvm.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_status_when_nothing_is_enabled(tmp_path: Path) -> None:
    res = run_cli("status", "--json", "--state-dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["enabled"] is False and st["device"] is None and st["swap"] is None
    assert st["peers"] == []
    text = run_cli("status", "--state-dir", str(tmp_path))
    assert text.returncode == 0 and "not enabled" in text.stdout


def test_unreachable_peer_is_unknown_not_zero() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    (st,) = control.peer_statuses([f"127.0.0.1:{port}"], timeout=2)
    assert st["health"] == "unreachable" and st["pages"] is None and st["error"]


def test_enable_argument_errors(tmp_path: Path) -> None:
    res = run_cli("enable", "--peers", "127.0.0.1:1", "--state-dir", str(tmp_path))
    assert res.returncode != 0 and "--size" in res.stderr
    res = run_cli("enable", "--config", str(tmp_path / "x.toml"), "--size", "1G")
    assert res.returncode != 0 and "not both" in res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_enable_and_disable_refuse_without_root(tmp_path: Path) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msgs = []
        try:
            os.setgid(65534)
            os.setuid(65534)
            cfg = control.Config(peers=["127.0.0.1:1"], size=1 << 30, state_dir=tmp_path)
            for fn in (lambda: control.enable(cfg), lambda: control.disable(tmp_path)):
                try:
                    fn()
                    msgs.append("no error")
                except Exception as exc:
                    msgs.append(f"{type(exc).__name__}: {exc}")
        finally:
            os.write(w, json.dumps(msgs).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msgs = json.loads(f.read())
    os.waitpid(pid, 0)
    assert len(msgs) == 2
    assert all(m.startswith("AttachError: attaching swap needs root") for m in msgs), msgs
    assert not (tmp_path / "daemon.json").exists()


def test_disable_when_not_enabled(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    res = run_cli("disable", "--state-dir", str(tmp_path))
    assert res.returncode == 0 and "was not enabled" in res.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_demo_without_root_says_why() -> None:
    from duvm import demo

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps(demo.preflight()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        problems = json.loads(f.read())
    os.waitpid(pid, 0)
    assert problems and problems[0].startswith("needs root") and "sudo" in problems[0]
