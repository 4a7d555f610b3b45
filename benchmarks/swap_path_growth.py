"""How much memory the swap path's processes take while they serve: a deployed daemon and its
two memservers, the resident and locked KiB of each before and after each phase of swap-like
traffic, and what each memserver grows by per page it came to hold.

    uv run python benchmarks/swap_path_growth.py [--size 512M] [--mix-s 20]

Why it matters: on a node short of memory, a page these processes fault in for the first
time must come from reclaim, which cannot write to swap on their behalf (they are I/O
flushers); below the min watermark they can wait or spin there while the swap writes that
would free memory wait for them (docs/ARCHITECTURE.md, "Staying alive under memory
pressure"). Growth in steady state is that risk, in KiB.

The daemon runs as `duvm enable` starts it in the deployed configuration (two copies,
encrypted, a cluster secret; locked in RAM, as root) with fio's nbd engine as the client:
a fill of the whole device in random 64 KiB writes, 4 KiB random reads and writes for
`--mix-s` seconds, a read of every block in 128 KiB requests, then 256 KiB writes at QD64
while one memserver is stopped for 4 s (what the daemon holds for a lagging memserver).
Needs fio.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from daemon_instructions import wait_for  # a sibling script: benchmarks/ is on the path
from duvm.base.units import parse_size

PY = [sys.executable, "-m", "duvm.cli"]
FIELDS = ("VmRSS", "VmLck")


def _memory(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0])
    return out


def _fio(uri: str, size: str, *extra: str) -> None:
    cmd = ["fio", "--name=g", "--ioengine=nbd", f"--uri={uri}", f"--size={size}"]
    subprocess.run([*cmd, "--output-format=terse", *extra], check=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="512M", help="the device (default 512M)")
    ap.add_argument("--mix-s", type=int, default=20, help="seconds of 4 KiB traffic")
    args = ap.parse_args()
    if shutil.which("fio") is None:
        raise SystemExit("fio not found (apt install fio)")
    procs: dict[str, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="duvm-growth-") as tmp:
        d = Path(tmp)
        secret = d / "cluster.secret"
        subprocess.run([*PY, "secret", "generate", str(secret)], check=True, capture_output=True)
        sec = ["--secret-file", str(secret)]
        try:
            ports = []
            for i in range(2):
                log = d / f"memserver{i}.log"
                with open(log, "wb") as out:
                    procs[f"memserver{i}"] = p = subprocess.Popen(
                        [*PY, "memserver", "--listen", "127.0.0.1:0", "--capacity", "1G", *sec],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                ports.append(wait_for(log, r"listening on [\d.]+:(\d+)", p))
            peers = ",".join(f"127.0.0.1:{p}" for p in ports)
            with open(d / "daemon.log", "wb") as out:
                procs["daemon"] = daemon = subprocess.Popen(
                    [
                        *PY,
                        "daemon",
                        "--peers",
                        peers,
                        "--replicas",
                        "2",
                        "--encrypt",
                        *sec,
                        "--size",
                        args.size,
                        "--socket",
                        str(d / "nbd.sock"),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            wait_for(d / "daemon.log", r"(serving)", daemon)
            uri = f"nbd+unix:///?socket={d}/nbd.sock"
            phases = [
                ("fill, random 64 KiB writes", ["--rw=randwrite", "--bs=64k", "--iodepth=16"]),
                (
                    f"{args.mix_s} s of random 4 KiB reads and writes",
                    [
                        "--rw=randrw",
                        "--bs=4k",
                        "--iodepth=32",
                        f"--runtime={args.mix_s}",
                        "--time_based",
                    ],
                ),
                ("read of every block, 128 KiB", ["--rw=read", "--bs=128k", "--iodepth=8"]),
            ]
            # a memserver that lags (here: stopped for 4 s) while 256 KiB writes keep coming:
            # the daemon holds every write it let in until that memserver answers
            phases.append(
                (
                    "256 KiB writes, one memserver stopped for 4 s",
                    ["--rw=randwrite", "--bs=256k", "--iodepth=64", "--runtime=8", "--time_based"],
                )
            )
            before = {n: _memory(p.pid) for n, p in procs.items()}
            first = before
            print(f"device {args.size}, deployed (2 copies, encrypted); KiB: VmRSS / VmLck")
            start = "; ".join(f"{n} {m['VmRSS']} / {m['VmLck']}" for n, m in first.items())
            print(f"start: {start}")
            for name, extra in phases:
                lag = None
                if "stopped" in name:
                    lag = threading.Timer(4.0, procs["memserver1"].send_signal, [signal.SIGCONT])
                    procs["memserver1"].send_signal(signal.SIGSTOP)
                    lag.start()
                _fio(uri, args.size, *extra)
                if lag is not None:
                    lag.join()
                now = {n: _memory(p.pid) for n, p in procs.items()}
                grew = "; ".join(
                    f"{n} +{now[n]['VmRSS'] - before[n]['VmRSS']} / "
                    f"+{now[n]['VmLck'] - before[n]['VmLck']}"
                    for n in procs
                )
                print(f"{name}: {grew}")
                before = now
            pages = parse_size(args.size) // 4096
            for n in procs:
                if n.startswith("memserver"):
                    rss = before[n]["VmRSS"] - first[n]["VmRSS"]
                    print(f"{n}: {rss * 1024 / pages:.0f} bytes of its own per page held")
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGCONT)
                p.terminate()
            for p in procs.values():
                p.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
