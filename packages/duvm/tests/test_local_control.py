"""Local control: the daemon's sockets are owner-only, system tools are run by absolute path
without a shell, and a daemon holding a cluster secret never shows it in logs or status."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import shutil
import signal
import stat
import sys
from pathlib import Path

import pytest
from duvm.base import control_socket

SRC = Path(__file__).resolve().parent.parent / "src" / "duvm"
_SUBPROCESS = {"run", "Popen", "call", "check_call", "check_output"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = (
                f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            )
            yield owner, name, node


def test_no_shell_and_no_bare_tool_names_in_subprocess_calls() -> None:
    problems = []
    for path in sorted(SRC.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for owner, name, node in _calls(tree):
            where = f"{path.name}:{node.lineno}"
            if owner == "os" and name in ("system", "popen"):
                problems.append(f"{where}: os.{name} runs a shell")
            if owner == "subprocess" and name in _SUBPROCESS:
                for kw in node.keywords:
                    if kw.arg == "shell" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        problems.append(f"{where}: shell=")
                first = node.args[0] if node.args else None
                if isinstance(first, (ast.List, ast.Tuple)) and first.elts:
                    head = first.elts[0]
                    if isinstance(head, ast.Constant) and not str(head.value).startswith("/"):
                        problems.append(f"{where}: {head.value!r} is found through PATH")
                if isinstance(first, ast.Constant):
                    problems.append(f"{where}: a command string")
    assert problems == []


def test_planted_shell_call_is_caught(tmp_path: Path) -> None:
    tree = ast.parse("import subprocess\nsubprocess.run(['ip', 'a'], shell=True)\n")
    found = [(o, n) for o, n, _ in _calls(tree) if o == "subprocess"]
    assert found == [("subprocess", "run")]


async def _line(stream: asyncio.StreamReader, pattern: str, timeout: float = 30) -> str:
    seen = ""
    async with asyncio.timeout(timeout):
        while True:
            raw = await stream.readline()
            if not raw:
                raise AssertionError(f"process ended before {pattern!r}; output: {seen}")
            seen += raw.decode()
            if re.search(pattern, raw.decode()):
                return seen


async def test_daemon_with_a_secret_keeps_it_out_of_logs_status_and_sockets(tmp_path) -> None:
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io not installed")
    secret = tmp_path / "secret"
    rc = await (
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "duvm.cli", "secret", "generate", str(secret)
        )
    ).wait()
    assert rc == 0 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    hexes = [
        ln.strip()
        for ln in secret.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    ms = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "duvm.cli",
        "memserver",
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "8M",
        "--no-mlock",
        "--secret-file",
        str(secret),
        "-v",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    nbd, ctl = str(tmp_path / "nbd.sock"), str(tmp_path / "ctl.sock")
    dm = None
    logs = ""
    try:
        first = await _line(ms.stdout, "listening on")
        port = re.search(r"listening on 127\.0\.0\.1:(\d+)", first).group(1)
        dm = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "duvm.cli",
            "daemon",
            "--peers",
            f"127.0.0.1:{port}",
            "--size",
            "4M",
            "--socket",
            nbd,
            "--control-socket",
            ctl,
            "--secret-file",
            str(secret),
            "--encrypt",
            "--no-mlock",
            "--replicas",
            "1",
            "-v",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        logs += await _line(dm.stdout, "serving export")
        assert "pages encrypted" in logs
        for path in (nbd, ctl):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            assert os.stat(path).st_uid == os.geteuid()
        q = await asyncio.create_subprocess_exec(
            "qemu-io",
            "-f",
            "raw",
            "-c",
            "write -P 0x42 0 65536",
            "-c",
            "read -P 0x42 0 65536",
            f"nbd+unix:///?socket={nbd}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(q.communicate(), 60)
        assert q.returncode == 0, out.decode()
        status = await asyncio.to_thread(control_socket.query, ctl)
        status_text = repr(status)
        dm.send_signal(signal.SIGHUP)  # rotation reload logs a key id, not the secret
        logs += await _line(dm.stdout, "SIGHUP: re-read")
    finally:
        for p in (dm, ms):
            if p is not None and p.returncode is None:
                p.send_signal(signal.SIGTERM)
        if dm is not None:
            logs += (await asyncio.wait_for(dm.communicate(), 30))[0].decode()
        logs += (await asyncio.wait_for(ms.communicate(), 30))[0].decode()
    assert "Traceback" not in logs
    for h in hexes:
        assert h not in logs and h.upper() not in logs and h not in status_text
