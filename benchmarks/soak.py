#!/usr/bin/env python3
"""Soak duvm: minutes of kernel swapping on a namespace cluster while faults are injected.

Not part of CI (it runs 10+ minutes and needs root). Layout: a 4-node cluster of network
namespaces (`duvm.testing.netns_cluster`); memservers on nodes 2-4, the daemon on node 1 with
R=2 (or `--replicas`), attached as swap; a workload (`duvm.cli.workload`, random data verified by
digest) holding several times its memory cgroup's limit runs round after round. Meanwhile a fault
injector picks, every `--fault-every` seconds (jittered), one of:

* ``kill9``   SIGKILL a memserver, then start it again empty after a few seconds;
* ``restart`` SIGTERM a memserver and start it again (pages gone, like a reboot);
* ``linkdown`` cut a node's link for 2-9 s (longer than the daemon's 5 s stall timeout or not);
* ``slow``    token-bucket the link to 1 mbit for 5-15 s.

Faults are one at a time: after each, the injector waits until the daemon reports no degraded
slab (repair done) before the next, because R=2 survives one failure at a time by design.

Reported (text, or one JSON object with --json): minutes run, workload rounds, pages moved
through the duvm device (the daemon's counts; pswpout/pswpin deltas too, machine-wide),
faults injected by kind, the daemon's failovers, replicas dropped, stalls aborted, repairs and
pages copied, checksum failures, repair times, and bytes lost: chunks that failed
verification times chunk size plus pages the daemon marked lost (0 expected with R=2). Also
the load average, since the numbers depend on what else runs.

Usage: sudo uv run python benchmarks/soak.py [--minutes 10] [--seed 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

from duvm.base import cgroup, control_socket
from duvm.cli import demo
from duvm.node.attach import attach
from duvm.testing import netns_cluster

PRIORITY = 32767


def vmstat() -> dict[str, int]:
    return {
        k: int(v)
        for k, v in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    }


class Injector(threading.Thread):
    def __init__(
        self,
        c: netns_cluster.Cluster,
        sock: str,
        every: float,
        rng: random.Random,
        stop: threading.Event,
        capacity: str,
    ) -> None:
        super().__init__(daemon=True)
        self.c, self.sock, self.every, self.rng, self.stop = c, sock, every, rng, stop
        self.capacity = capacity
        self.faults: dict[str, int] = {}
        self.repair_s: list[float] = []
        self.errors: list[str] = []

    def health(self) -> dict:
        return control_socket.query(control_socket.default_path(self.sock))["store"]

    def wait_repaired(self, timeout: float = 300) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and not self.stop.is_set():
            if self.health()["degraded_slabs"] == 0:
                self.repair_s.append(round(time.monotonic() - t0, 2))
                return
            time.sleep(0.5)
        if not self.stop.is_set():
            self.errors.append(f"not repaired within {timeout} s")

    def run(self) -> None:
        c, rng = self.c, self.rng
        while not self.stop.wait(self.every * rng.uniform(0.5, 1.5)):
            node = rng.choice([2, 3, 4])
            kind = rng.choice(["kill9", "restart", "linkdown", "slow"])
            try:
                if kind == "kill9":
                    c.kill9(node)
                    time.sleep(rng.uniform(1, 5))
                    c.memserver(node, self.capacity)
                elif kind == "restart":
                    c.memserver(node, self.capacity)  # SIGTERM the old one, start a new one
                elif kind == "linkdown":
                    c.link(node, up=False)
                    time.sleep(rng.uniform(2, 9))
                    c.link(node, up=True)
                else:
                    c.slow(node)
                    time.sleep(rng.uniform(5, 15))
                    c.unslow(node)
            except Exception as e:  # keep soaking; report it
                self.errors.append(f"{kind} on node {node}: {e}")
            self.faults[kind] = self.faults.get(kind, 0) + 1
            self.wait_repaired()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--fault-every", type=float, default=25.0, metavar="SECONDS")
    ap.add_argument("--workload-mib", type=int, default=160)
    ap.add_argument("--limit-mib", type=int, default=48)
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON here too")
    a = ap.parse_args()
    if (why := netns_cluster.skip_reason()) is not None:
        print(f"soak: {why}", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    # The device holds twice the workload: the kernel keeps swap slots of pages it read back
    # (swap cache) for a while, and a full device makes the workload's cgroup OOM. Each
    # memserver can take the R copies of the whole export shared by the two that remain
    # after one fails, plus room for repair.
    size = f"{2 * a.workload_mib}M"
    capacity = f"{2 * a.workload_mib * a.replicas // 2 + 64}M"
    # Stop cleanly (swapoff, detach, namespaces) on SIGTERM too, and on SIGINT even when
    # started in the background with SIGINT ignored.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result: dict = {
        "minutes": a.minutes,
        "replicas": a.replicas,
        "seed": a.seed,
        "workload_mib": a.workload_mib,
        "limit_mib": a.limit_mib,
        "loadavg_start": os.getloadavg(),
    }
    state = None
    with netns_cluster.Cluster(4) as c:
        try:
            for node in (2, 3, 4):
                c.memserver(node, capacity)
            sock = c.daemon(1, [2, 3, 4], size, replicas=a.replicas)
            state = c.dir / "state.json"
            (c.dir / "run").mkdir()
            # Highest priority: the kernel must not spread these pages over another swap
            # device (a test elsewhere on the machine) whose faults we did not inject.
            att = attach.attach(
                sock,
                state,
                run_dir=c.dir / "run",
                method=demo.demo_method("auto"),
                priority=PRIORITY,
            )
            result["device"] = att.device
            before = vmstat()
            stop = threading.Event()
            inj = Injector(c, sock, a.fault_every, rng, stop, capacity)
            inj.start()
            rounds = bad_chunks = failed_rounds = 0
            chunk = 1 << 20
            t_end = time.monotonic() + a.minutes * 60
            with cgroup.MemoryCgroup(a.limit_mib << 20, prefix="duvm-soak") as cg:
                while time.monotonic() < t_end:
                    r = cg.run(
                        [
                            sys.executable,
                            "-m",
                            "duvm.cli.workload",
                            "--mib",
                            str(a.workload_mib),
                            "--seed",
                            str(rounds + 1),
                            "--passes",
                            "2",
                        ],
                        timeout=1800,
                        capture_output=True,
                        text=True,
                    )
                    rounds += 1
                    try:
                        out = json.loads(r.stdout.strip().splitlines()[-1])
                        bad_chunks += out["bad_chunks"]
                        chunk = out.get("chunk_bytes", chunk)
                    except (ValueError, IndexError, KeyError):
                        failed_rounds += 1  # killed (SIGBUS on a lost page) or no output
                    print(
                        f"soak: round {rounds} exit {r.returncode}, faults {inj.faults}",
                        file=sys.stderr,
                        flush=True,
                    )
            stop.set()
            inj.join(120)
            after = vmstat()
            h = control_socket.query(control_socket.default_path(sock))["store"]
            result.update(
                {
                    "rounds": rounds,
                    "failed_rounds": failed_rounds,
                    "bad_chunks": bad_chunks,
                    # the device's own counts (pswpout/pswpin are machine-wide: other devices too)
                    "device_pages_written": h["pages_stored"],
                    "device_pages_read": h["pages_loaded"],
                    "pages_swapped_out": after["pswpout"] - before["pswpout"],
                    "pages_swapped_in": after["pswpin"] - before["pswpin"],
                    "faults": inj.faults,
                    "faults_total": sum(inj.faults.values()),
                    "injector_errors": inj.errors,
                    "repair_seconds": inj.repair_s,
                    "failovers": h["failovers"],
                    "replicas_dropped": h["replicas_dropped"],
                    "stalls_aborted": h["stalls_aborted"],
                    "repairs": h.get("repairs_done"),  # absent: no repairer
                    "repair_pages_copied": h.get("repair_pages_copied"),
                    "checksum_failures": h["checksum_failures"],
                    "read_errors": h["read_errors"],
                    "write_errors": h["write_errors"],
                    "pages_lost": h["pages_lost"],
                    "bytes_lost": bad_chunks * chunk + h["pages_lost"] * 4096,
                    "loadavg_end": os.getloadavg(),
                }
            )
        finally:
            if state is not None:
                try:
                    attach.detach(state, force=True)
                except Exception as e:
                    print(f"soak: detach failed: {e}", file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    ok = result.get("bytes_lost") == 0 and result.get("failed_rounds") == 0
    return 0 if ok or a.replicas < 2 else 1


if __name__ == "__main__":
    sys.exit(main())
