"""A real multi-node duvm cluster on one machine: network namespaces, veth links, a bridge.

For the fault tests and the soak benchmark (root only). Each node is a network namespace
``duvmt-<random>-<n>`` with one veth (``eth0``, 10.77.0.<n>/24) whose other end sits in a hub
namespace, enslaved to a bridge. Memservers run inside their node's namespace (`ip netns exec`)
bound to the node's address, so traffic between nodes crosses real veth links and the kernel's
TCP stack, and faults are real: ``kill -9`` a memserver, take a node's link down (``ip link set
down`` on the hub side), make it slow (``tc ... tbf``), restart a memserver.

Unix sockets are named by path, not by network namespace, so a daemon running in node 1 serves
NBD to clients (qemu-io, libnbd, nbdfuse) in the root namespace.

`Cluster` is a context manager: whatever happens, `close()` kills the processes it started (by
PID), deletes the namespaces (which removes their veths and the bridge) and the temporary
directory. Names are random, so parallel runs never clash.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from duvm.node.attach.systools import find_tool

SUBNET = "10.77.0"
PORT = 7070


def tool(name: str) -> str:
    """Absolute path of `ip` or `tc` (root runs these: never through PATH)."""
    path = find_tool(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found (apt: iproute2)")
    return path


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [tool(cmd[0]), *cmd[1:]], capture_output=True, text=True, check=check, timeout=30
    )


def skip_reason() -> str | None:
    """Why a cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for name in ("ip", "tc"):
        if find_tool(name) is None:
            return f"{name} missing (apt: iproute2)"
    probe = f"duvmt-probe-{secrets.token_hex(3)}"
    r = run("ip", "netns", "add", probe, check=False)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


class Cluster:
    """`n` node namespaces linked through a hub bridge; memservers started on demand."""

    def __init__(self, n: int = 4, *, python: str = sys.executable) -> None:
        self.n = n
        self.tag = f"duvmt-{secrets.token_hex(3)}"
        self.hub = f"{self.tag}-hub"
        self.python = python
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.secret = self.dir / "secret"
        self.procs: dict[str, subprocess.Popen] = {}
        self.memservers: dict[int, subprocess.Popen] = {}
        self._namespaces: list[str] = []

    # --- topology ---

    def ns(self, node: int) -> str:
        return f"{self.tag}-{node}"

    def addr(self, node: int) -> str:
        return f"{SUBNET}.{node}"

    def peer(self, node: int) -> str:
        return f"{self.addr(node)}:{PORT}"

    def __enter__(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        run("ip", "netns", "add", self.hub)
        self._namespaces.append(self.hub)
        run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for node in range(1, self.n + 1):
            ns = self.ns(node)
            run("ip", "netns", "add", ns)
            self._namespaces.append(ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            # Created in the node, the far end moved to the hub: names never meet in the root.
            run(
                "ip",
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                f"h{node}",
                "netns",
                self.hub,
            )
            run("ip", "-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", self.hub, "link", "set", f"h{node}", "master", "br0")
            run("ip", "-n", self.hub, "link", "set", f"h{node}", "up")
        subprocess.run(
            [self.python, "-m", "duvm.cli", "secret", "generate", str(self.secret)],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def close(self) -> None:
        for p in list(self.procs.values()):
            self._kill(p)
        self.procs.clear()
        for ns in reversed(self._namespaces):
            run("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _kill(p: subprocess.Popen) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    # --- processes ---

    def start(self, name: str, node: int, argv: list[str]) -> subprocess.Popen:
        """Start `argv` in `node`'s namespace, output to DIR/name.log."""
        log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        p = subprocess.Popen(
            [tool("ip"), "netns", "exec", self.ns(node), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text()
        except OSError:
            return ""

    def wait_log(self, name: str, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited {p.returncode}: {self.log(name)[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: {text!r} not seen in {timeout} s: {self.log(name)[-2000:]}"
                )
            time.sleep(0.05)

    def memserver(self, node: int, capacity: str = "64M", lease: float = 60) -> subprocess.Popen:
        name = f"memserver{node}"
        old = self.procs.pop(name, None)
        if old is not None:
            self._kill(old)
        (self.dir / f"{name}.log").unlink(missing_ok=True)
        p = self.start(
            name,
            node,
            [
                self.python,
                "-m",
                "duvm.cli",
                "memserver",
                "--listen",
                self.peer(node),
                "--capacity",
                capacity,
                "--lease",
                str(lease),
                "--no-mlock",
                "--secret-file",
                str(self.secret),
            ],
        )
        self.wait_log(name, "listening on")
        self.memservers[node] = p
        return p

    def kill9(self, node: int) -> None:
        """SIGKILL the memserver of `node`: no goodbye on its connections, pages gone."""
        p = self.procs.pop(f"memserver{node}")
        p.kill()
        p.wait(10)

    def daemon(
        self,
        node: int,
        peers: list[int],
        size: str,
        *,
        replicas: int,
        name: str = "daemon",
        extra: list[str] = (),
    ) -> str:
        """Start a daemon in `node` on the memservers of `peers`; returns its Unix socket."""
        sock = str(self.dir / f"{name}.sock")
        self.start(
            name,
            node,
            [
                self.python,
                "-m",
                "duvm.cli",
                "daemon",
                "--peers",
                ",".join(self.peer(i) for i in peers),
                "--size",
                size,
                "--socket",
                sock,
                "--replicas",
                str(replicas),
                "--client-id",
                f"{self.tag}:{name}",
                "--secret-file",
                str(self.secret),
                "--no-mlock",
                *extra,
            ],
        )
        self.wait_log(name, "serving")
        return sock

    # --- faults ---

    def link(self, node: int, up: bool) -> None:
        """Cut (or restore) `node`'s link at the hub: packets are dropped, TCP sees nothing."""
        run("ip", "-n", self.hub, "link", "set", f"h{node}", "up" if up else "down")

    def slow(self, node: int, rate: str = "1mbit") -> None:
        """Token-bucket limit both directions of `node`'s link."""
        for ns, dev in ((self.hub, f"h{node}"), (self.ns(node), "eth0")):
            run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kbit",
                "latency",
                "400ms",
            )

    def unslow(self, node: int) -> None:
        for ns, dev in ((self.hub, f"h{node}"), (self.ns(node), "eth0")):
            run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def namespaces_left(self) -> list[str]:
        """Namespaces of this cluster still present (for teardown assertions)."""
        out = run("ip", "netns", "list").stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(self.tag)]
