#!/usr/bin/env python3
"""What one request/reply round trip costs over TCP loopback and over a Unix socket.

A blocking ping-pong between two processes: the client sends 64 bytes, the server answers with
a 4 KiB page (a memserver LOAD of one page, without the memserver), or `--size` bytes (256 KiB:
a readahead window or a bulk read: what the kernel alone costs per hop). Prints the round-trip time
and the CPU each side spends per round trip, with the server on the same CPU as the client and
on the other one. It bounds what a Unix-socket transport for a memserver on the same host could
save (docs/BENCHMARKS.md, "QD1 is wakeups and Python per event").

    uv run python benchmarks/loopback_roundtrip.py [--count 20000] [--size 4096]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

PAGE = 4096
SOCK_BUF = 4 << 20  # as duvm's sockets: a whole reply fits


def pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def big_buffers(*socks: socket.socket) -> None:
    for s in socks:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            s.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


def cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run(kind: str, client_cpu: int, server_cpu: int, count: int, size: int) -> str:
    a, b = pair(kind)
    big_buffers(a, b)
    pid = os.fork()
    if pid == 0:  # the server: answer every request with a page
        os.sched_setaffinity(0, {server_cpu})
        a.close()
        buf = bytearray(size)
        for _ in range(count):
            b.recv_into(buf, 64)
            b.sendall(buf)
        os._exit(0)
    os.sched_setaffinity(0, {client_cpu})
    b.close()
    view = memoryview(bytearray(size))
    children0 = cpu(resource.getrusage(resource.RUSAGE_CHILDREN))
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(count):
        a.sendall(b"x" * 64)
        got = 0
        while got < size:
            got += a.recv_into(view[got:])
    elapsed, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    a.close()
    server = cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - children0
    return (
        f"{kind:4}  server on CPU {server_cpu}: round trip {elapsed / count * 1e6:6.1f} µs, "
        f"CPU per round trip: client {(cpu(r1) - cpu(r0)) / count * 1e6:5.1f} µs, "
        f"server {server / count * 1e6:5.1f} µs"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=20000, help="round trips per case")
    ap.add_argument("--size", type=int, default=PAGE, help="bytes of each reply (default 4096)")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in cpus if c != cpus[0]][:1]
    for server_cpu in [cpus[0], *others]:
        for kind in ("unix", "tcp"):
            print(run(kind, cpus[0], server_cpu, args.count, args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
