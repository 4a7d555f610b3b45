"""`duvm node`: the provider side of a node, run as a real process from a real config file.

Asserted: it serves pages on the configured address with the configured capacity and lease; its
control socket is owner-only and answers the memserver's STATUS (capacity, used, reserved,
per-namespace counts, connections) matching what the network STATUS says; a client's stored
pages show up there and in `duvm status`; a second node on the same socket is refused; SIGHUP
re-reads the secret file (a rotated-out secret is refused afterwards, the pages stay); SIGTERM
and SIGINT exit 0 and remove the socket; bad settings exit non-zero with one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.base import control_socket
from duvm.node.lifecycle import control
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import PageServerError
from duvm.store.memserver_status import query_status
from duvm.wire import auth


def duvm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


class Node:
    """A `duvm node` child process; `.addr` once it listens. stop() ends it by its PID."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "duvm.cli", "node", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    break
                self.lines.append(line)
                if "listening on" in line:
                    host_port = line.split("listening on ")[1].split()[0]
                    self.host, port = host_port.rsplit(":", 1)
                    self.port = int(port)
                    self.addr = host_port
                    return
        self.stop()
        raise AssertionError(f"node did not start: {self.lines} {self.proc.stderr.read()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return self.proc.returncode


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    try:
        yield started
    finally:
        for n in started:
            n.stop(signal.SIGKILL)


def config(tmp_path: Path, node: str, top: str = "") -> Path:
    p = tmp_path / "duvm.toml"
    p.write_text(f"{top}\n[node]\n{node}\n")
    return p


def test_node_serves_and_answers_its_control_socket(tmp_path: Path, nodes: list[Node]) -> None:
    ctl = tmp_path / "run" / "memserver.ctl"  # the directory does not exist yet: node makes it
    cfg = config(
        tmp_path,
        f'listen = "127.0.0.1:0"\ncapacity = "8M"\nlease = 7\ncontrol_socket = "{ctl}"',
        top='peers = ["127.0.0.1:7070"]\nsize = "4M"',
    )
    node = Node("--config", str(cfg))
    nodes.append(node)
    assert node.lines[0].startswith(
        f"duvm node: memserver on 127.0.0.1:0, 8 MiB, control socket {ctl}"
    )
    assert stat.S_ISSOCK(ctl.stat().st_mode) and stat.S_IMODE(ctl.stat().st_mode) == 0o600

    async def use() -> tuple[dict, dict]:
        c = MemClient(node.host, node.port, "test-client")
        await c.connect()
        try:
            await c.reserve(100)
            await c.store(range(10), os.urandom(10 * 4096))
            ours = control_socket.query(str(ctl))
            net = await query_status(node.host, node.port)
        finally:
            await c.close()
        return ours, net

    ours, net = asyncio.run(use())
    assert ours["role"] == "memserver"
    assert ours["capacity_pages"] == net["capacity_pages"] == (8 << 20) // 4096
    assert ours["lease_seconds"] == 7.0
    assert ours["used_pages"] == 10 and ours["reserved_pages"] == 100
    assert ours["connections"] >= 1 and ours["namespaces_total"] == 1
    (ns,) = ours["namespaces"]
    assert (ns["client_id"], ns["stored_pages"], ns["reserved_pages"]) == ("test-client", 10, 100)
    assert ours["counters"]["pages_stored"] == 10

    # duvm status shows what this node lends (the client's lease keeps its pages)
    st = json.loads(
        duvm(
            "status", "--json", "--state-dir", str(tmp_path / "state"), "--node-socket", str(ctl)
        ).stdout
    )
    assert st["node"]["running"] is True and st["node"]["used_pages"] == 10
    assert st["node"]["namespaces"][0]["stored_pages"] == 10
    text = duvm("status", "--state-dir", str(tmp_path / "state"), "--node-socket", str(ctl))
    assert "node: lends 0 MiB in use" in text.stdout  # 10 pages round down to 0 MiB
    assert "client test-client: 10 pages stored, 100 reserved" in text.stdout

    # a second node on the same control socket is refused; the first keeps serving
    second = duvm("node", "--config", str(cfg))
    assert second.returncode == 2 and "already answers on" in second.stderr
    assert second.stderr.count("\n") == 1
    assert control_socket.query(str(ctl))["used_pages"] == 10

    assert node.stop(signal.SIGTERM) == 0
    assert not ctl.exists()  # removed on the way out
    with pytest.raises(OSError):
        asyncio.run(query_status(node.host, node.port, timeout=2))
    # no node answering: status says there is none
    assert (
        json.loads(
            duvm(
                "status",
                "--json",
                "--state-dir",
                str(tmp_path / "state"),
                "--node-socket",
                str(ctl),
            ).stdout
        )["node"]
        is None
    )


def test_flags_override_the_config_and_sigint_stops(tmp_path: Path, nodes: list[Node]) -> None:
    ctl = tmp_path / "n.ctl"
    cfg = config(tmp_path, 'listen = "127.0.0.1:1"\ncapacity = "64M"')
    node = Node(
        "--config",
        str(cfg),
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "4M",
        "--control-socket",
        str(ctl),
    )
    nodes.append(node)
    st = control_socket.query(str(ctl))
    assert st["capacity_pages"] == 1024 and node.port != 1
    # no secret file: a reload signal is ignored, not fatal
    node.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)
    assert node.proc.poll() is None and control_socket.query(str(ctl))["capacity_pages"] == 1024
    assert node.stop(signal.SIGINT) == 0 and not ctl.exists()


def test_sighup_rereads_the_secret(tmp_path: Path, nodes: list[Node]) -> None:
    old, new = tmp_path / "old.secret", tmp_path / "new.secret"
    for p in (old, new):
        assert duvm("secret", "generate", str(p)).returncode == 0
    live = tmp_path / "cluster.secret"
    live.write_bytes(old.read_bytes())
    live.chmod(0o600)
    ctl = tmp_path / "n.ctl"
    cfg = config(
        tmp_path,
        f'listen = "127.0.0.1:0"\ncapacity = "4M"\ncontrol_socket = "{ctl}"',
        top=f'secret_file = "{live}"',
    )
    node = Node("--config", str(cfg))
    nodes.append(node)

    def status_with(secret: Path) -> dict | str:
        sec = auth.PeerSecurity(auth.Keyring.from_file(secret))
        try:
            return asyncio.run(query_status(node.host, node.port, timeout=5, security=sec))
        except Exception as exc:  # the refusal is the outcome under test
            return str(exc)

    async def unauthenticated() -> str:
        c = MemClient(node.host, node.port, "nobody", security=None, retries=0)
        try:
            await c.connect()
            return "connected"
        except PageServerError as exc:  # the memserver's refusal, not a timeout or a crash
            return f"{exc.code.name}: {exc.message}"
        finally:
            await c.close()

    assert isinstance(status_with(old), dict) and isinstance(status_with(new), str)
    assert asyncio.run(unauthenticated()).startswith("AUTH: authentication required")
    assert control_socket.query(str(ctl))["security"]["auth"] == "secret"

    live.write_bytes(new.read_bytes())  # rotation done the hard way: only the new secret
    node.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30  # each look a full TLS-less HELLO: slow under load
    while not isinstance(status_with(new), dict) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert isinstance(status_with(new), dict), "SIGHUP did not load the new secret"
    assert isinstance(status_with(old), str), "the rotated-out secret is still accepted"
    assert node.proc.poll() is None  # reloaded, not restarted
    assert node.stop() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give --config FILE"),
        (("--listen", "127.0.0.1:0"), "give --config FILE"),
        (("--listen", "127.0.0.1:99999", "--capacity", "4M"), "--listen: bad port"),
        (("--listen", "127.0.0.1:0", "--capacity", "lots"), "--capacity: not a size"),
        (("--listen", "127.0.0.1:0", "--capacity", "100"), "at least one page"),
        (("--listen", "127.0.0.1:0", "--capacity", "4M", "--lease", "-1"), "--lease must be"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args: tuple[str, ...], message: str) -> None:
    res = duvm("node", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_bad_config_settings_exit_non_zero(tmp_path: Path) -> None:
    ctl = f'control_socket = "{tmp_path}/x.ctl"'
    cases = [
        (
            f'listen = "127.0.0.1:0"\ncapacity = "4M"\n{ctl}\nmemserver_args = ["--bogus"]',
            "not memserver flags: ['--bogus']",
            2,
        ),
        (
            f'listen = "127.0.0.1:0"\ncapacity = "4M"\n{ctl}\nmemserver_args = ["--lease", "x"]',
            "memserver_args",
            2,
        ),
        # off loopback without a secret the memserver refuses, as `duvm memserver` does
        (f'listen = "0.0.0.0:0"\ncapacity = "4M"\n{ctl}', "without authentication", 2),
    ]
    for node, message, code in cases:
        res = duvm("node", "--config", str(config(tmp_path, node)))
        assert res.returncode == code and message in res.stderr, (node, res.stderr)
        assert "Traceback" not in res.stderr
    res = duvm("node", "--config", str(tmp_path / "absent.toml"))
    assert res.returncode == 2 and "cannot read config" in res.stderr


def test_example_config_runs_as_a_node_after_editing_listen(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The shipped example, with only the listen address, secret and socket paths changed for
    this machine, starts a node that authenticates with the secret."""
    example = (Path(__file__).parents[1] / "duvm.example.toml").read_text()
    secret = tmp_path / "cluster.secret"
    assert duvm("secret", "generate", str(secret)).returncode == 0
    ctl = tmp_path / "memserver.ctl"
    text = (
        example.replace('listen = "10.0.0.2:7070"', 'listen = "127.0.0.1:0"')
        .replace('capacity = "4G"', 'capacity = "4M"')
        .replace('"/etc/duvm/cluster.secret"', f'"{secret}"')
        .replace('"/run/duvm/memserver.ctl"', f'"{ctl}"')
    )
    assert text.count(str(tmp_path)) == 2
    cfg = tmp_path / "duvm.toml"
    cfg.write_text(text)
    node = Node("--config", str(cfg))
    nodes.append(node)
    st = control_socket.query(str(ctl))
    assert st["security"]["auth"] == "secret" and st["lease_seconds"] == 60.0
    # the enable side of the same file still loads (no peer is this node on 127.0.0.1:0)
    assert control.load_config(cfg).peers == ["10.0.0.2:7070", "10.0.0.3:7070", "10.0.0.4:7070"]
    assert node.stop() == 0
