"""Cost of ``gputaskman fleet``'s poller: 200 simulated hosts polled at 1 Hz, one of them slow.

A child process runs the hosts: 200 lightweight HTTP/1.1 endpoints on loopback (asyncio, one
listening port each, keep-alive and a Content-Length as ``gputaskman serve`` answers) serving
recorded snapshots, the lines of tests/recordings (the demo and a DRM fixture tree: synthetic
GPU numbers, real documents of 14-17 KB). Each host takes a new sample (the next recorded
line) every `--change-every` seconds and, like ``serve``, answers a poll that names the
sample it already has (``If-None-Match``) with a bodiless 304. Two scenarios by default: a
new sample every second (serve's default interval, so nearly every poll reads a whole new
document) and every 5 seconds. Host 0 holds every answer for `--slow` seconds (5 by
default) before sending it.

This process runs the real `fleet.poller.Poller` over them (interval 1 s) and measures, over
`--seconds` after a warm-up:

* CPU: the poller thread's own user+system time (``/proc/self/task/TID/stat``), as a share of
  one core, and the whole process's (the poller plus this measuring loop);
* documents read per second (each one through `reader.read_document`);
* the slow host's effect on the others: for every other host, the gaps between successive
  answers (a poll held behind the slow host would show a gap of about `--slow` seconds) and
  the answers' latency.

Run twice by default: with the poller's default timeout (2 s: the slow host is reported
``slow``) and with a timeout longer than the slow answer (the slow host's answer arrives,
5 s late, and must still hold no one else). The hosts' own CPU (the child process) is not
the poller's and is not counted.

Run: ``uv run python benchmarks/gtm_fleet_poll.py [--hosts 200] [--seconds 30] [--slow 5]
[--change-every S ...]``.
Numbers depend on the machine and on what else runs; report them with that caveat.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDINGS = ROOT / "packages" / "gputaskman" / "tests" / "recordings"


# ---------------------------------------------------------------------------- the hosts


def _bodies() -> list[bytes]:
    out = []
    for name in ("demo.jsonl", "drm.jsonl"):
        out += [line for line in (RECORDINGS / name).read_bytes().splitlines() if line.strip()]
    return out


_NOT_MODIFIED = b"HTTP/1.1 304 Not Modified\r\nETag: %s\r\nContent-Length: 0\r\n\r\n"


def _answer(body: bytes, etag: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nServer: gputaskman\r\nContent-Type: application/json\r\n"
        b"ETag: %s\r\nContent-Length: %d\r\n\r\n" % (etag, len(body)) + body
    )


def run_hosts(
    n: int,
    slow: float,
    change_every: float,
    ready: multiprocessing.Queue,
    stop: multiprocessing.Event,
) -> None:
    bodies = _bodies()

    async def main() -> None:
        ports = []

        def handler(i: int):
            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    while True:
                        head = await reader.readuntil(b"\r\n\r\n")
                        if i == 0 and slow:
                            await asyncio.sleep(slow)
                        # a new sample every `change_every` seconds, as serve's sampler
                        sample = int(time.time() / change_every) + i
                        etag = b'"%d"' % sample
                        if b"If-None-Match: " + etag + b"\r\n" in head:
                            writer.write(_NOT_MODIFIED % etag)
                        else:
                            writer.write(_answer(bodies[sample % len(bodies)], etag))
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
                finally:
                    writer.close()

            return handle

        for i in range(n):
            server = await asyncio.start_server(handler(i), "127.0.0.1", 0, backlog=64)
            ports.append(server.sockets[0].getsockname()[1])
        ready.put(ports)
        while not stop.is_set():
            await asyncio.sleep(0.2)

    asyncio.run(main())


# ---------------------------------------------------------------------------- measuring


def thread_cpu(tid: int) -> float:
    """User + system seconds of thread `tid` of this process."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def measure(
    ports: list[int], seconds: float, warmup: float, timeout: float, whole: bool = False
) -> dict:
    from gputaskman.fleet.poller import Poller
    from gputaskman.fleet.targets import parse_target

    targets = [parse_target(f"127.0.0.1:{p}") for p in ports]
    poller = Poller(targets, interval=1.0, timeout=timeout, backoff_max=30.0, table_only=not whole)
    poller.start()
    tid = poller.thread_id
    time.sleep(warmup)
    seen = {i: [] for i in range(1, len(ports))}
    last = {i: None for i in seen}
    latencies: list[float] = []
    seq0 = sum(s.seq for s in poller.states())
    cpu0, proc0, wall0 = thread_cpu(tid), time.process_time(), time.monotonic()
    while time.monotonic() - wall0 < seconds:
        states = poller.states()
        for i in seen:
            s = states[i]
            if s.answered_at != last[i]:
                last[i] = s.answered_at
                seen[i].append(time.monotonic())
                if s.latency_s is not None:
                    latencies.append(s.latency_s)
        time.sleep(0.05)
    wall = time.monotonic() - wall0
    cpu, proc = thread_cpu(tid) - cpu0, time.process_time() - proc0
    states = poller.states()
    seqs = sum(s.seq for s in states) - seq0
    poller.stop()
    gaps = [b - a for ts in seen.values() for a, b in itertools.pairwise(ts)]
    gaps.sort()
    latencies.sort()
    return {
        "timeout_s": timeout,
        "wall_s": wall,
        "poller_cpu_pct": 100 * cpu / wall,
        "process_cpu_pct": 100 * proc / wall,
        "docs_per_s": seqs / wall,
        "gap_median_s": statistics.median(gaps) if gaps else None,
        "gap_p99_s": gaps[int(0.99 * (len(gaps) - 1))] if gaps else None,
        "gap_max_s": gaps[-1] if gaps else None,
        "latency_median_ms": 1000 * statistics.median(latencies) if latencies else None,
        "latency_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "others_up": sum(s.up for s in states[1:]),
        "slow_host": f"{states[0].status}" + (f" ({states[0].reason})" if states[0].reason else ""),
        "slow_host_answers": states[0].seq,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--slow", type=float, default=5.0, help="seconds host 0 holds each answer")
    p.add_argument(
        "--change-every",
        type=float,
        action="append",
        help="seconds between a host's samples (default: 1, then 5)",
    )
    p.add_argument(
        "--whole",
        action="store_true",
        help="read every document whole, as --json and record do (default: the table's part, "
        "as the TUI and --once do)",
    )
    args = p.parse_args(argv)
    for change in args.change_every or [1.0, 5.0]:
        run_scenario(args, change)
    return 0


def run_scenario(args: argparse.Namespace, change: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    hosts = ctx.Process(
        target=run_hosts, args=(args.hosts, args.slow, change, ready, stop), daemon=True
    )
    hosts.start()
    try:
        ports = ready.get(timeout=60)
        print(
            f"{args.hosts} simulated hosts on loopback (recorded snapshots, "
            f"{min(len(b) for b in _bodies())}-{max(len(b) for b in _bodies())} bytes, a new one "
            f"every {change:g} s), host 0 answers after {args.slow:g} s; poll interval 1 s; "
            f"{args.seconds:g} s measured "
            f"after {args.warmup:g} s; load average {os.getloadavg()[0]:.1f}, "
            f"{os.cpu_count()} CPUs; documents read "
            f"{'whole' if args.whole else 'for the table (the TUI)'}"
        )
        for timeout in (2.0, args.slow + 3.0):
            r = measure(ports, args.seconds, args.warmup, timeout, args.whole)
            print(
                f"timeout {r['timeout_s']:g} s: poller thread {r['poller_cpu_pct']:.2f}% of a "
                f"core (process {r['process_cpu_pct']:.2f}%), {r['docs_per_s']:.1f} documents/s; "
                f"other hosts: {r['others_up']} up, gap between answers median "
                f"{r['gap_median_s']:.2f} s, p99 {r['gap_p99_s']:.2f} s, max "
                f"{r['gap_max_s']:.2f} s; latency median {r['latency_median_ms']:.1f} ms, p99 "
                f"{r['latency_p99_ms']:.1f} ms; slow host: {r['slow_host']}, "
                f"{r['slow_host_answers']} answers; load average {os.getloadavg()[0]:.1f}"
            )
    finally:
        stop.set()
        hosts.join(10)
        if hosts.is_alive():
            hosts.terminate()


if __name__ == "__main__":
    sys.exit(main())
