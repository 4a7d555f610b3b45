#!/usr/bin/env python3
"""User-space instructions per NBD request of the whole duvm daemon and its memserver (callgrind).

Wall-clock numbers on a shared 2-core VM drift; instruction counts do not. This starts a
memserver and a daemon (or `duvm daemon --memory` with `--local`), both under
`valgrind --tool=callgrind`, prefills the export, zeroes the counters, sends exactly N requests
with fio's nbd engine (`--number_ios`), dumps the counters and prints instructions / N for each
process: the NBD layer, the store, the memory client, the page codec, uvloop and the memserver,
user space only (syscalls' kernel time is not counted). Start-up is excluded by the zeroing.

    uv run python benchmarks/daemon_instructions.py [--rw randread] [--bs 4k] [--qd 16]
                                                    [--requests 4000] [--local | --deployed]

`--deployed` measures what `duvm enable` runs on a cluster: two memservers, two copies of each
page, pages encrypted, peers authenticated by a cluster secret.

Needs valgrind (apt install valgrind) and fio. About a minute per run on the development VM.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited: {path.read_text()[-2000:]}")
        m = re.search(pattern, path.read_text() if path.exists() else "")
        if m:
            return m.group(1) if m.groups() else m.group(0)
        time.sleep(0.2)
    raise SystemExit(f"no {pattern!r} in {path} after {timeout} s")


def fio(uri: str, *extra: str) -> None:
    subprocess.run(
        [
            "fio",
            "--name=b",
            "--ioengine=nbd",
            f"--uri={uri}",
            "--size=32M",
            "--output-format=terse",
            *extra,
        ],
        check=True,
        capture_output=True,
    )


def instructions(out_glob: list[Path]) -> int:
    """Events of the newest dump (the one after the measured requests)."""
    newest = max(out_glob, key=lambda p: p.stat().st_mtime)
    m = re.search(r"^(?:summary|totals): (\d+)", newest.read_text(), re.M)
    if not m:
        raise SystemExit(f"no totals in {newest}")
    return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rw", default="randread", help="fio --rw (default randread)")
    ap.add_argument("--bs", default="4k", help="request size (default 4k)")
    ap.add_argument("--qd", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--requests", type=int, default=4000, help="requests measured (default 4000)")
    ap.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy the callgrind files here (read them with callgrind_annotate)",
    )
    how = ap.add_mutually_exclusive_group()
    how.add_argument(
        "--local", action="store_true", help="duvm daemon --memory: the NBD layer alone"
    )
    how.add_argument(
        "--deployed",
        action="store_true",
        help="two memservers, --replicas 2, --encrypt, a cluster secret",
    )
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control", "fio"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt install valgrind fio)")
    py = [sys.executable, "-m", "duvm.cli"]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="duvm-instr-") as tmp:
        d = Path(tmp)

        def start(name: str, cmd: list[str]) -> subprocess.Popen:
            vg = [
                "valgrind",
                "--tool=callgrind",
                "--dump-instr=no",
                f"--callgrind-out-file={d}/{name}.%p.cg",
            ]
            with open(d / f"{name}.log", "wb") as log:
                p = subprocess.Popen([*vg, *cmd], stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            return p

        try:
            peers = ["--memory"]
            security: list[str] = []
            if args.deployed:
                secret = d / "cluster.secret"
                subprocess.run([*py, "secret", "generate", str(secret)], check=True)
                security = ["--secret-file", str(secret)]
            if not args.local:
                ports = []
                for i in range(2 if args.deployed else 1):
                    name = f"memserver{i}"
                    ms = start(
                        name,
                        [
                            *(*py, "memserver", "--listen", "127.0.0.1:0"),
                            *("--capacity", "64M", "--no-mlock", *security),
                        ],
                    )
                    ports.append(wait_for(d / f"{name}.log", r"listening on [\d.]+:(\d+)", ms))
                peers = ["--peers", ",".join(f"127.0.0.1:{p}" for p in ports)]
            if args.deployed:
                peers += ["--replicas", "2", "--encrypt", *security]
            daemon = start(
                "daemon", [*py, "daemon", *peers, "--size", "32M", "--socket", str(d / "nbd.sock")]
            )
            wait_for(d / "daemon.log", r"(serving)", daemon)
            uri = f"nbd+unix:///?socket={d}/nbd.sock"
            fio(uri, "--rw=write", "--bs=256k", "--iodepth=4")  # every block written once
            for p in procs:
                subprocess.run(
                    ["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True
                )
            fio(
                uri,
                f"--rw={args.rw}",
                f"--bs={args.bs}",
                f"--iodepth={args.qd}",
                f"--number_ios={args.requests}",
                "--norandommap",
                "--randrepeat=0",
            )
            for p in procs:
                subprocess.run(
                    ["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True
                )
            time.sleep(1)
            print(
                f"{args.rw} {args.bs} QD{args.qd}, {args.requests} requests"
                f"{' (daemon --memory)' if args.local else ''}"
                f"{' (deployed: 2 memservers, 2 copies, encrypted)' if args.deployed else ''}:"
            )
            for name in ("daemon", "memserver0", "memserver1"):
                files = list(d.glob(f"{name}.*.cg*"))
                if files:
                    n = instructions(files) // args.requests
                    print(f"  {name:9} {n:>8,} instructions per request")
                    if args.keep:  # for callgrind_annotate: where the instructions went
                        args.keep.mkdir(parents=True, exist_ok=True)
                        for f in files:
                            shutil.copy(f, args.keep / f.name)
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
