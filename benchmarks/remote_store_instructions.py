"""Instructions per request of the daemon's remote path (RemoteStore + MemClient), by callgrind.

Wall-clock numbers on the shared 2-core development VM vary 2.5x from run to run; instruction
counts do not. This script starts `duvm memserver` on loopback (not under valgrind), then runs
itself twice under `valgrind --tool=callgrind`: once doing only the setup (connect, reserve,
prefill) and once doing the setup plus N requests. (difference) / N is what one request costs
in the daemon-side process, user space only: RemoteStore, MemClient, the page codec, uvloop.
The NBD layer is not included (it is about 24-30k instructions per 4 KiB request).

The store is driven the way `nbdconnection` drives it: its coroutine is stepped by hand and resumed
from the awaited future's done callback; the requests that become ready in one loop iteration
are started together, corked (`store.batching.cork()`), as the NBD server does for the requests
of one read; QD16, random page-aligned offsets in a 16 MiB export prefilled with random data.

    uv run python benchmarks/remote_store_instructions.py [--pages 1] [--requests 4000]

Needs valgrind (apt install valgrind). Takes about a minute per case on the development VM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import subprocess
import sys
from functools import partial

QD = 16
EXPORT_PAGES = 4096


async def drive(port: int, mode: str, n: int, pages: int) -> None:
    """The measured workload (runs inside valgrind)."""
    from duvm.store.remote_store import RemoteStore

    store = await RemoteStore.open(
        [("127.0.0.1", port)], EXPORT_PAGES * 4096, f"instr:{os.getpid()}", repair=False
    )
    big = memoryview(bytearray(os.urandom(4096 * 64)))
    for p in range(0, EXPORT_PAGES, 64):
        await store.write(p * 4096, big)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    count = {"issued": 0, "completed": 0}
    bufs = [memoryview(bytearray(4096 * pages)) for _ in range(QD)]
    rng = random.Random(1)

    ready: list[int] = []

    def start_ready() -> None:
        corked = store.batching.cork()
        for i in ready:
            start(i)
        ready.clear()
        if corked:
            store.batching.uncork()

    def start(i: int) -> None:
        count["issued"] += 1
        off = rng.randrange(EXPORT_PAGES // pages) * pages * 4096
        coro = store.write(off, bufs[i]) if mode == "write" else store.read(off, bufs[i])
        step(i, coro)

    def step(i: int, coro: object, *_: object) -> None:
        try:
            fut = coro.send(None)  # type: ignore[attr-defined]
        except StopIteration:
            count["completed"] += 1
            if count["issued"] + len(ready) < n:
                # Like an NBD client's next requests: those that become ready in one loop
                # iteration are started together, corked, as nbdconnection does for one read.
                if not ready:
                    loop.call_soon(start_ready)
                ready.append(i)
            elif count["completed"] == n:
                done.set_result(None)
            return
        fut._asyncio_future_blocking = False
        fut.add_done_callback(partial(step, i, coro))

    if n:
        corked = store.batching.cork()
        for i in range(min(QD, n)):
            start(i)
        if corked:
            store.batching.uncork()
        await done
    await store.close()


def instructions(port: int, mode: str, n: int, pages: int) -> int:
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--drive",
        str(port),
        mode,
        str(n),
        str(pages),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode or not m:
        raise SystemExit(f"callgrind run failed:\n{out.stderr[-2000:]}")
    return int(m.group(1))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--drive":
        port, mode, n, pages = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        import uvloop

        uvloop.run(drive(port, mode, n, pages))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=1, help="pages per request (1..64)")
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests measured (default 4000 for 1 page, 500 otherwise)",
    )
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt install valgrind)", file=sys.stderr)
        return 1
    if not 1 <= args.pages <= 64:
        print("--pages must be 1..64", file=sys.stderr)
        return 2
    n = args.requests or (4000 if args.pages == 1 else 500)
    cmd = [
        sys.executable,
        "-m",
        "duvm.cli",
        "memserver",
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "64M",
        "--no-mlock",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        if not m:
            print(f"memserver did not start: {line!r}", file=sys.stderr)
            return 1
        port = int(m.group(1))
        for mode in ("write", "read"):
            base = instructions(port, mode, 0, args.pages)
            total = instructions(port, mode, n, args.pages)
            print(
                f"{mode} {args.pages * 4} KiB: {(total - base) / n / 1000:.1f}k instructions "
                f"per request ({n} requests, QD{QD})"
            )
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
