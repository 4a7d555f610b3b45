"""Real `gputaskman serve` processes on loopback for the fleet tests, a TCP proxy that makes
one of them slow, and waiting on a poller's states."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

TOKEN_A = "fleet-token-a-0123456789abcdef"
TOKEN_B = "fleet-token-b-0123456789abcdef"


def token_file(d: Path, token: str, name: str) -> Path:
    p = d / name
    p.write_text(token + "\n")
    p.chmod(0o600)
    return p


class Serve:
    """One `gputaskman serve` subprocess; `start` again after `kill` reuses its port."""

    def __init__(self, args: list[str], port: int = 0, before: tuple[str, ...] = ()) -> None:
        self.args = args
        self.before = before  # options of the gputaskman command itself (--sysroot DIR)
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> Serve:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gputaskman.cli",
                *self.before,
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--sample-interval",
                "0.2",
                *self.args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GTM_DUVM_SOCKETS": ""},
        )
        return self

    def ready(self) -> Serve:
        """Wait for the serving line; learn the port."""
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            raise AssertionError(f"serve did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.split()[2].rsplit(":", 1)[1].split("/")[0])
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(20)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()


class SlowProxy:
    """Loopback TCP proxy to `upstream` that holds every answer for `delay` seconds before
    passing it on: a host whose serve is fine and whose network is slow."""

    def __init__(self, upstream: int, delay: float) -> None:
        self.upstream = upstream
        self.delay = delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=30)
        except OSError:
            client.close()
            return

        def pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
            try:
                while data := src.recv(65536):
                    time.sleep(delay)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(client, up, 0.0), daemon=True).start()
        pump(up, client, self.delay)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
