"""What security costs: authentication, TLS and page encryption, measured against a real
`duvm memserver` process on loopback.

Modes (one memserver process each, same client code):
  plain    no secret, no TLS (loopback default)
  secret   cluster secret: mutual HMAC challenge-response at connect, nothing per request
  tls      TLS 1.3 with a server certificate (client verifies it) plus the secret
  mtls     mutual TLS (client certificate, cluster CA) and no secret
For each: connect+authenticate time (median of --connects), 4 KiB STORE/LOAD at QD1 (p50)
and QD16 (ops/s), and the CPU both processes spent per request.

Encryption (CryptStore, AES-256-GCM on the owning node): seal/open cost per 4 KiB page in
process (no I/O), then RemoteStore vs CryptStore(RemoteStore) 4 KiB reads/writes over the
`plain` memserver.

    uv run python benchmarks/bench_security.py [--seconds 2] [--repeat 3] [--pin]

Certificates and the secret are generated into a temporary directory at start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/duvm/tests"))

from bench_memserver import timed
from duvm.store.crypt_store import CryptStore
from duvm.store.memclient import MemClient
from duvm.store.memory_store import MemoryStore
from duvm.store.page_cipher import PurePageCipher
from duvm.store.remote_store import RemoteStore
from duvm.wire import auth

PS = 4096


def start_memserver(extra: list[str], pin: bool) -> tuple[subprocess.Popen, tuple[str, int]]:
    cmd = [
        sys.executable,
        "-m",
        "duvm.cli",
        "memserver",
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "96M",
        *extra,
    ]
    if pin:
        cmd = ["taskset", "-c", "1", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"listening on ([\d.]+):(\d+)", line)
    if not m:
        proc.kill()
        raise SystemExit(f"memserver did not start: {line!r}")
    return proc, (m.group(1), int(m.group(2)))


async def protocol_cases(
    addr, pid: int, sec: auth.PeerSecurity | None, seconds: float, connects: int
) -> list[dict]:
    t = []
    for i in range(connects):
        c = MemClient(*addr, f"conn/{i}", security=sec)
        t0 = time.perf_counter()
        await c.connect()
        t.append(time.perf_counter() - t0)
        await c.close()
    res = [
        {
            "case": "connect+auth",
            "ops_s": 1 / statistics.median(t),
            "mib_s": 0.0,
            "p50_us": statistics.median(t) * 1e6,
            "client_us_op": float("nan"),
            "server_us_op": float("nan"),
        }
    ]
    c = MemClient(*addr, "bench/sec", security=sec)
    await c.connect()
    await c.reserve(4096)
    page = os.urandom(PS)
    await c.store(range(1024), os.urandom(1024 * PS))
    outs = [memoryview(bytearray(PS)) for _ in range(16)]

    async def store1(w: int, i: int) -> None:
        await c.store([(w * 64 + i) % 1024], page)

    async def load1(w: int, i: int) -> None:
        await c.load([(w * 64 + i * 7) % 1024], outs[w])

    for qd in (1, 16):
        res.append(await timed(f"STORE 4K QD{qd}", store1, qd, seconds, pid))
        res.append(await timed(f"LOAD 4K QD{qd}", load1, qd, seconds, pid))
    await c.release()
    await c.close()
    return res


async def crypt_cases(addr, pid: int, seconds: float) -> list[dict]:
    res = []
    # in process, no I/O: the cost of sealing and opening one page, on the path that runs
    # here (compiled unless DUVM_PURE_PYTHON or no build) and on the pure-Python reference
    page = memoryview(os.urandom(PS))
    out = memoryview(bytearray(PS))
    mems = {}
    for path in ("compiled", "pure"):
        mem = CryptStore(MemoryStore(1024 * PS))
        if path == "pure":
            mem.cipher = PurePageCipher(os.urandom(32))
        elif isinstance(mem.cipher, PurePageCipher):
            continue  # not built here (duvm doctor says why)
        mems[path] = mem
    cases = [
        (f"{verb} 4K (in process, {path})", fn)
        for path, mem in mems.items()
        for verb, fn in (
            ("seal", lambda i, mem=mem: mem.write((i % 1024) * PS, page)),
            ("open", lambda i, mem=mem: mem.read((i % 1024) * PS, out)),
        )
    ]
    for label, fn in cases:
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            for i in range(1000):
                await fn(n + i)
            n += 1000
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        res.append(
            {
                "case": label,
                "ops_s": n / dt,
                "mib_s": n * PS / dt / (1 << 20),
                "client_us_op": cpu / n * 1e6,
                "server_us_op": 0.0,
            }
        )
    plain_mem = MemoryStore(1024 * PS)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        for i in range(1000):
            await plain_mem.write(((n + i) % 1024) * PS, page)
        n += 1000
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    res.append(
        {
            "case": "MemoryStore write 4K (baseline)",
            "ops_s": n / dt,
            "mib_s": n * PS / dt / (1 << 20),
            "client_us_op": cpu / n * 1e6,
            "server_us_op": 0.0,
        }
    )
    remote = await RemoteStore.open([addr], 16 << 20, "bench/crypt")
    for name, store in (("RemoteStore", remote), ("CryptStore(RemoteStore)", CryptStore(remote))):
        await store.write(0, memoryview(os.urandom(16 << 20)))
        bufs = [memoryview(bytearray(PS)) for _ in range(16)]

        async def rd(w: int, i: int, store=store, bufs=bufs) -> None:
            await store.read(((w * 97 + i * 31) % 4096) * PS, bufs[w])

        async def wr(w: int, i: int, store=store) -> None:
            await store.write(((w * 97 + i * 31) % 4096) * PS, page)

        for qd in (1, 16):
            res.append(await timed(f"{name} read 4K QD{qd}", rd, qd, seconds, pid))
            res.append(await timed(f"{name} write 4K QD{qd}", wr, qd, seconds, pid))
    await remote.close()
    return res


def print_table(title: str, runs: list[list[dict]]) -> None:
    print(f"\n## {title}")
    print(f"{'case':34} {'ops/s':>9} {'p50 us':>7} {'p99 us':>7} {'cli us/op':>9} {'srv us/op':>9}")
    for i, first in enumerate(runs[0]):
        col = {k: statistics.median(r[i][k] for r in runs) for k in first if k != "case"}
        p50 = f"{col['p50_us']:7.0f}" if "p50_us" in col else f"{'':7}"
        p99 = f"{col['p99_us']:7.0f}" if "p99_us" in col else f"{'':7}"
        print(
            f"{first['case']:34} {col['ops_s']:9.0f} {p50} {p99} "
            f"{col['client_us_op']:9.1f} {col['server_us_op']:9.1f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per case (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case, median reported")
    ap.add_argument("--connects", type=int, default=50, help="connections timed per mode")
    ap.add_argument("--pin", action="store_true", help="server on CPU 1, client on CPU 0")
    ap.add_argument("--modes", default="plain,secret,tls,mtls,crypt")
    args = ap.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {0})
    from test_security import _make_pki  # the same test-time PKI the tests use

    tmp = Path(tempfile.mkdtemp(prefix="duvm-bench-sec-"))
    pki = _make_pki(tmp)
    secret = tmp / "secret"
    subprocess.run(
        [sys.executable, "-m", "duvm.cli", "secret", "generate", str(secret)],
        check=True,
        capture_output=True,
    )
    kr = auth.Keyring.from_file(secret)
    modes = {
        "plain": ([], None),
        "secret": (["--secret-file", str(secret)], auth.PeerSecurity(kr)),
        "tls": (
            [
                "--secret-file",
                str(secret),
                "--tls-cert",
                pki["server"],
                "--tls-key",
                pki["server_key"],
            ],
            auth.PeerSecurity(kr, auth.client_tls_context(pki["ca"])),
        ),
        "mtls": (
            ["--tls-cert", pki["server"], "--tls-key", pki["server_key"], "--tls-ca", pki["ca"]],
            auth.PeerSecurity(
                None, auth.client_tls_context(pki["ca"], pki["client"], pki["client_key"])
            ),
        ),
    }
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    print(
        f"# bench_security: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
        f"pinned={'server cpu1, client cpu0' if args.pin else 'no'}, "
        f"median of {args.repeat} x {args.seconds:g}s"
    )
    wanted = args.modes.split(",")
    for mode, (flags, sec) in modes.items():
        if mode not in wanted:
            continue
        proc, addr = start_memserver(flags, args.pin)
        try:
            runs = [
                runner(protocol_cases(addr, proc.pid, sec, args.seconds, args.connects))
                for _ in range(args.repeat)
            ]
        finally:
            proc.terminate()
            proc.wait(10)
        print_table(f"memserver, {mode}", runs)
    if "crypt" in wanted:
        proc, addr = start_memserver([], args.pin)
        try:
            runs = [runner(crypt_cases(addr, proc.pid, args.seconds)) for _ in range(args.repeat)]
        finally:
            proc.terminate()
            proc.wait(10)
        print_table("page encryption (AES-256-GCM, CryptStore)", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
