"""A verifying block workload through a real NBD client (libnbd), for fault tests and the soak.

Run it with the Python that has libnbd's binding (Debian's python3-libnbd lives in the system
Python, not in a virtual environment)::

    /usr/bin/python3 nbd_workload.py nbd+unix:///?socket=/run/duvm/nbd.sock --seconds 20

It needs nothing from duvm: stdlib and `nbd` only. It keeps, per 4 KiB page, the version last
written successfully (the bytes are a pure function of page and version, so nothing is kept in
memory), issues random writes and reads of 1-16 pages with `--depth` requests in flight (libnbd's
aio API), verifies every read against the model, and finally reads back every page. It prints
one JSON object: operations done, EIO results, and `mismatches`, the count of reads that
returned bytes other than the last written. Mismatches are silent corruption, the one outcome
that must never happen; EIO is allowed only where a test expects data loss.

A write that fails leaves its pages "unknown" (the store may hold either version, or report
EIO): such pages are not compared until written again. A read that fails with EIO marks its
pages lost, counted in `lost_pages`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time

PAGE = 4096
LOST = -2


def page_bytes(page: int, version: int) -> bytes:
    """The bytes of `page` at `version`: cheap to make, distinct per page and version."""
    seed = hashlib.blake2b(f"{page}:{version}".encode(), digest_size=32).digest()
    return seed * (PAGE // 32)


def main(argv: list[str] | None = None) -> int:
    import nbd  # the system binding; imported here so --help works without it

    ap = argparse.ArgumentParser()
    ap.add_argument("uri")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--pages", type=int, help="pages of the device to use (default all)")
    ap.add_argument("--depth", type=int, default=8, help="requests in flight")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--progress", help="file to write a line to every second (ops so far)")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    h = nbd.NBD()
    h.connect_uri(a.uri)
    npages = min(a.pages or h.get_size() // PAGE, h.get_size() // PAGE)
    version = [0] * npages  # 0: never written (reads as zeros)
    busy = bytearray(npages)  # pages with a request in flight: no overlapping requests
    st = {
        "writes": 0,
        "reads": 0,
        "pages_written": 0,
        "pages_read": 0,
        "write_eio": 0,
        "read_eio": 0,
        "mismatches": 0,
        "lost_pages": 0,
        "verified_pages": 0,
    }
    inflight: dict[int, tuple] = {}

    def check(first: int, n: int, buf: bytes, versions: list[int]) -> None:
        for k in range(n):
            v = versions[k]
            if v < 0:
                continue
            want = bytes(PAGE) if v == 0 else page_bytes(first + k, v)
            if buf[k * PAGE : (k + 1) * PAGE] != want:
                st["mismatches"] += 1
                print(f"MISMATCH page {first + k} version {v}", file=sys.stderr)
            else:
                st["verified_pages"] += 1

    def submit() -> None:
        n = rng.randint(1, 16)
        first = rng.randrange(0, npages - n + 1)
        if any(busy[first : first + n]):
            return
        busy[first : first + n] = b"\x01" * n
        if rng.random() < 0.6:
            vers = [abs(version[first + k]) + 1 for k in range(n)]  # fresh bytes each time
            data = b"".join(page_bytes(first + k, vers[k]) for k in range(n))
            buf = nbd.Buffer.from_bytearray(bytearray(data))
            cookie = h.aio_pwrite(buf, first * PAGE)
            inflight[cookie] = ("w", first, n, vers, buf)
        else:
            buf = nbd.Buffer(n * PAGE)
            cookie = h.aio_pread(buf, first * PAGE)
            inflight[cookie] = ("r", first, n, list(version[first : first + n]), buf)

    def reap() -> None:
        for cookie in list(inflight):
            try:
                if not h.aio_command_completed(cookie):
                    continue
                ok = True
            except nbd.Error as e:
                ok = False
                err = e
            kind, first, n, vers, buf = inflight.pop(cookie)
            busy[first : first + n] = bytes(n)
            if kind == "w":
                st["writes"] += 1
                if ok:
                    st["pages_written"] += n
                    for k in range(n):
                        version[first + k] = vers[k]
                else:
                    st["write_eio"] += 1
                    print(f"write error pages {first}+{n}: {err}", file=sys.stderr)
                    for k in range(n):  # either version may be there, or an error
                        version[first + k] = -vers[k]  # negative: unknown until rewritten
            else:
                st["reads"] += 1
                if ok:
                    st["pages_read"] += n
                    check(first, n, buf.to_bytearray(), vers)
                else:
                    st["read_eio"] += 1
                    print(f"read error pages {first}+{n}: {err}", file=sys.stderr)
                    for k in range(n):
                        if version[first + k] > 0:
                            st["lost_pages"] += 1
                            version[first + k] = -version[first + k]

    t_end = time.monotonic() + a.seconds
    next_progress = 0.0
    while time.monotonic() < t_end:
        while len(inflight) < a.depth:
            submit()
        if inflight:
            h.poll(100)
        reap()
        if a.progress and time.monotonic() > next_progress:
            next_progress = time.monotonic() + 1
            with open(a.progress, "w") as f:
                f.write(json.dumps(st) + "\n")
    while inflight:
        h.poll(100)
        reap()
    # Final pass: every page, in 64-page reads.
    for first in range(0, npages, 64):
        n = min(64, npages - first)
        vers = list(version[first : first + n])
        try:
            buf = h.pread(n * PAGE, first * PAGE)
        except nbd.Error as e:
            st["read_eio"] += 1
            print(f"final read error pages {first}+{n}: {e}", file=sys.stderr)
            st["lost_pages"] += sum(v > 0 for v in vers)
            continue
        check(first, n, buf, vers)
    st["pages"] = npages
    h.shutdown()
    print(json.dumps(st))
    return 0


if __name__ == "__main__":
    sys.exit(main())
