"""What a daemon crash costs with a standby: the time from the SIGKILL to a held request
served again, and what the standby's memory grows by in the takeover (issue 48).

    sudo uv run python benchmarks/bench_takeover.py [--rounds 5] [--size 512M] [--no-encrypt]

Two memservers on loopback, the daemon as `duvm enable` starts it (two copies, encrypted, its
state on files), and the real supervisor loop (`duvm.node.lifecycle.supervise.watch`) keeping
a standby. The kernel's nbd driver is played by a client that, like the driver, holds its
request across the daemon's death and sends it again on the connection the supervisor hands
it (which on a node is `NBD_CMD_RECONFIGURE`). Each round kills the daemon serving at the
moment (the standby of the round before), reads a page that must come back, and waits for the
next standby. Prints one line per round and the median; root (the supervisor's checks).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from duvm.base import pressure
from duvm.node.attach import attach_state, kernelnbd, processes
from duvm.node.lifecycle import control, supervise
from duvm.wire import nbdconst as C

PY = [sys.executable, "-m", "duvm.cli"]
_REQ, _REPLY = struct.Struct(">IHHQQI"), struct.Struct(">IIQ")


class Driver:
    """One request at a time, held and sent again on a handed connection, as the driver does."""

    def __init__(self, path: str) -> None:
        self.sock, _ = kernelnbd.connect_unix(path)
        self.handed: queue.Queue[socket.socket] = queue.Queue()
        self.handle = 0

    def reattach(self, att: attach_state.Attachment, path: str | None = None) -> None:
        self.handed.put(kernelnbd.connect_unix(path or att.socket)[0])

    def request(self, cmd: int, offset: int, data: bytes = b"", length: int = 4096) -> bytes:
        while True:
            try:
                self.handle += 1
                self.sock.sendall(
                    _REQ.pack(C.REQUEST_MAGIC, 0, cmd, self.handle, offset, length) + data
                )
                head = self._recv(_REPLY.size)
                _magic, err, _handle = _REPLY.unpack(head)
                if err:
                    raise OSError(err, "NBD error")
                return self._recv(length) if cmd == C.CMD_READ else b""
            except (ConnectionError, BrokenPipeError):
                self.sock.close()
                self.sock = self.handed.get(timeout=120)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise ConnectionResetError
            buf += got
        return buf


def _wait(pred, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_takeover: no {what} within {timeout} s")
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", default="512M")
    p.add_argument("--no-encrypt", action="store_true")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("bench_takeover: run as root (the supervisor's checks)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="duvm-takeover-"))
    run = tmp / "run"
    run.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        ports = []
        for i in range(2):
            log = tmp / f"ms{i}.log"
            procs.append(
                subprocess.Popen(
                    [*PY, "memserver", "--listen", "127.0.0.1:0", "--capacity", "2G"],
                    stdout=log.open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
            _wait(lambda log=log: "listening on" in log.read_text(), "memserver")
            ports.append(log.read_text().split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        sock = str(run / "nbd.sock")
        peers = [f"127.0.0.1:{port}" for port in ports]
        args = ["--state-dir", str(run / "daemon-state")]
        args += ["--no-encrypt"] if a.no_encrypt else ["--encrypt"]
        cmd = [*PY, "daemon", "--socket", sock, "--peers", ",".join(peers), "--size", a.size]
        cmd += ["--client-id", "bench-takeover", "--replicas", "2", *args]
        daemon = processes.spawn_detached(cmd, run / "daemon.log")
        procs.append(daemon)
        _wait(lambda: os.path.exists(sock), "daemon socket")
        size = int(kernelnbd.connect_unix(sock)[1].size)
        info = control.DaemonInfo(
            daemon.pid,
            sock,
            peers,
            size,
            2,
            str(run / "daemon.log"),
            time.time(),
            "bench-takeover",
            args,
            processes.start_time(daemon.pid),
        )
        control.daemon_path(run).write_text(json.dumps(asdict(info)))
        att = attach_state.Attachment(
            socket=sock,
            method=attach_state.METHOD_KERNEL,
            device="/dev/nbd7",
            nbd_device="/dev/nbd7",
            nbd_netlink=True,
            dead_conn_timeout_s=60,
        )
        attach_state.save_state(control.state_path(run), att)
        driver = Driver(sock)
        page = os.urandom(4096)
        driver.request(C.CMD_WRITE, 0, page)
        log: list[str] = []
        results: list[tuple[float, int]] = []

        def rounds() -> None:
            try:
                for r in range(a.rounds):
                    _wait(lambda r=r: sum(" ready (" in m for m in log) > r, "standby ready", 300)
                    cur = control.load_daemon(run)
                    assert cur is not None
                    t = time.monotonic()
                    os.kill(cur.pid, signal.SIGKILL)
                    assert driver.request(C.CMD_READ, 0) == page
                    ms = (time.monotonic() - t) * 1000
                    _wait(lambda r=r: sum("took over" in m for m in log) > r, "takeover")
                    took = [m for m in log if "took over" in m][r]
                    new = control.load_daemon(run)
                    told = int(took.split(" when told")[0].rsplit(" ", 1)[1])
                    grew = (pressure.rss_kib(new.pid) or 0) - told if new else -1
                    results.append((ms, grew))
                    print(f"round {r + 1}: served {ms:.1f} ms after the SIGKILL; {took}")
                    print(f"    resident growth after the first requests: {grew} KiB")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=rounds, daemon=True).start()
        supervise.watch(run, say=log.append, reattach=driver.reattach)
        if results:
            print(
                f"median {statistics.median(r[0] for r in results):.1f} ms from the SIGKILL to "
                f"the held request served; resident growth max {max(r[1] for r in results)} KiB "
                f"({len(results)} rounds, load {os.getloadavg()[0]:.2f})"
            )
        return 0 if len(results) == a.rounds else 1
    finally:
        cur = control.load_daemon(run)
        if cur is not None:
            processes.send_signal(cur.pid, signal.SIGKILL, cur.start)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
