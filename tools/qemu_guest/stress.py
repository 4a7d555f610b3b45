"""Memory-pressure stress runs of duvm in QEMU guests: does the node ever hang or panic?

Each run boots the Debian guest (`boot.py`) with memservers on the host, lets the guest run the
default `duvm enable --config` (no extra daemon flags unless `--daemon-args`), and starts a
workload that is NOT in a memory cgroup, sized at a percentage of the guest's RAM, touching its
chunks sequentially or in random order and verifying every byte. With ``kill`` in a run's
set-up there are two memservers (two copies of each page) and the last one is SIGKILLed when
the fill reaches half-way; with ``stop`` the only memserver is SIGSTOPped there and continued
20 s later (every request waits on the last replica, D36); with ``dkillP`` (issue 48) there are
two memservers and the daemon itself is SIGKILLed at P % of the fill, the workload left running:
the supervisor's standby must take the device over (the guest waits for it to be ready before
the workload starts, as on a node that has been up a while). A watchdog ends a run as hung
when no page moved (and the guest script said nothing) for `--stall` seconds. With ``rdma``
the memservers run in the guest on Soft-RoCE and pages move by RDMA (``rdma_check.run_swap``;
the guest gets their arenas on top of its RAM; the same watchdog). A hung run's console ends
with the kernel's SysRq dumps (blocked tasks, memory, the running CPU, every task).

Every run ends as one of:

``verified``      the workload finished and every byte was intact, `duvm disable` succeeded
``oom-killed``    the kernel's OOM killer ended the workload (acceptable past 100 % of RAM);
                  the guest went on and `duvm disable` succeeded
``hung``          the watchdog fired (or the run's deadline passed)
``panicked``      the guest kernel panicked
``bad-pages``     the workload read back bytes that differ, or swap I/O failed
``failed``        anything else (enable failed, the workload died otherwise); the reason says

Usage (root; a few minutes per run on a 2-core VM)::

    uv run python tools/qemu_guest/stress.py --out /tmp/stress            # the default matrix
    uv run python tools/qemu_guest/stress.py --only 384:110:random        # one set-up
    uv run python tools/qemu_guest/stress.py --dkill --out /tmp/dkill     # the daemon-kill matrix
    uv run python tools/qemu_guest/stress.py --daemon-args=--no-realtime  # the old defaults

Results: one JSON line per run in OUT/results.jsonl (with the kernel's messages of interest),
each run's logs in OUT/RUN/, and a table on stdout. docs/BENCHMARKS.md records the last
matrix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import boot  # sibling module; tools/ is not a package

OUTCOMES = ("verified", "oom-killed", "hung", "panicked", "bad-pages", "failed")
# kernel messages worth keeping with a run's result
_KERNEL = re.compile(
    r"(Kernel panic.*|block nbd\d+: .*|Out of memory: Killed process \d+ "
    r"\(\S+\)|(?:Read|Write)-error on swap-device.*|I/O error, dev (?:nbd|loop).*)"
)


@dataclass(frozen=True)
class Setup:
    mem_mib: int  # guest RAM (QEMU -m)
    pct: int  # workload size, % of the guest's RAM
    order: str  # sequential | random
    kill: bool = False  # two memservers, the last SIGKILLed half-way through the fill
    stop: bool = False  # one memserver, SIGSTOPped half-way through the fill for 20 s
    rdma: bool = False  # memservers in the guest, pages over RDMA (Soft-RoCE), not on the host
    dkill: int | None = None  # two memservers; the daemon SIGKILLed at this % of the fill

    @property
    def name(self) -> str:
        event = (
            ":kill"
            if self.kill
            else ":stop"
            if self.stop
            else f":dkill{self.dkill}"
            if self.dkill is not None
            else ""
        )
        return f"{self.mem_mib}:{self.pct}:{self.order}{event}{':rdma' if self.rdma else ''}"

    @property
    def memservers(self) -> int:
        return 2 if self.kill or self.dkill is not None else 1

    @property
    def workload_mib(self) -> int:
        return self.mem_mib * self.pct // 100

    def guest_kwargs(self) -> dict[str, Any]:
        """`boot.run_guest` arguments for this set-up (the CI's pressure guest uses them too)."""
        swap_mib = max(256, 2 * self.mem_mib)  # the device holds the overflow, twice over
        return {
            "workload_mib": self.workload_mib,
            "cgroup_mib": None,
            "mem_mib": self.mem_mib,
            "swap_size": f"{swap_mib}M",
            "capacity": f"{swap_mib}M",
            "host_memservers": True,
            "memservers": self.memservers,
            "kill_memserver_at": 50 if self.kill else None,
            "kill_at_pct": self.dkill,
            "stop_memserver_at": 50 if self.stop else None,
            "order": self.order,
            "chunk_kib": 1024 if self.order == "sequential" else 64,
        }

    def rdma_kwargs(self) -> dict[str, Any]:
        """`rdma_check.run_swap` arguments: the memservers live in the guest, so it gets their
        arenas on top of `mem_mib` (its programs keep about the RAM of the host-memserver
        set-up) and the workload stays a percentage of `mem_mib`."""
        swap_mib = max(256, 2 * self.mem_mib)
        memservers = self.memservers
        return {
            "mem_mib": self.mem_mib + memservers * swap_mib + 96,
            "workload_mib": self.workload_mib,
            "cgroup_mib": None,
            "swap_size": f"{swap_mib}M",
            "capacity": f"{swap_mib}M",
            "memservers": memservers,
            "kill_memserver_at": 50 if self.kill else None,
            "kill_daemon_at": self.dkill,
            "order": self.order,
            "chunk_kib": 1024 if self.order == "sequential" else 64,
        }

    @classmethod
    def parse(cls, text: str) -> Setup:
        parts = text.split(":")
        rdma = parts[-1:] == ["rdma"]
        if rdma:
            parts = parts[:-1]
        event = parts[3] if len(parts) == 4 else ""
        dkill = None
        if event.startswith("dkill") and event[5:].isdigit() and 0 <= int(event[5:]) <= 100:
            dkill = int(event[5:])
        elif event not in ("", "kill", "stop"):
            parts = []  # refused below
        if len(parts) not in (3, 4):
            raise ValueError(f"a set-up is MEM:PCT:ORDER[:kill|:stop|:dkillP][:rdma], not {text!r}")
        order = parts[2]
        if order not in ("sequential", "random"):
            raise ValueError(f"order must be sequential or random, not {order!r}")
        if rdma and event == "stop":
            raise ValueError("a set-up over RDMA cannot stop its memserver (it runs in the guest)")
        return cls(
            int(parts[0]), int(parts[1]), order, event == "kill", event == "stop", rdma, dkill
        )


def default_matrix() -> list[Setup]:
    """22 runs: 256 and 384 MiB guests at 80/95/110 % in both orders, a 1 GiB guest at 95 and
    110 %, two memservers with one killed (384 MiB at 80/95 %, 256 MiB at 95 %), and the only
    memserver stopped for 20 s (384 MiB at 95 %, both orders)."""
    runs = [
        Setup(m, p, o) for m in (256, 384) for p in (80, 95, 110) for o in ("sequential", "random")
    ]
    runs += [Setup(1024, 95, "sequential"), Setup(1024, 110, "random")]
    runs += [Setup(384, p, o, kill=True) for p in (80, 95) for o in ("sequential", "random")]
    runs += [Setup(256, 95, o, kill=True) for o in ("sequential", "random")]
    runs += [Setup(384, 95, o, stop=True) for o in ("sequential", "random")]
    return runs


def dkill_matrix() -> list[Setup]:
    """Issue 48's matrix, 22 runs: the daemon SIGKILLed at 25, 50 and 90 % of the fill, with
    the workload (no cgroup, left running) at 80, 95 and 110 % of a 384 MiB guest's RAM, in
    random order for the 80 and 110 % runs and sequential for 95 %, over TCP (host
    memservers) and over RDMA (memservers in the guest, Soft-RoCE); and at 95 %, killed
    half-way, a 256 MiB and a 1 GiB guest over each."""
    runs = [
        Setup(384, p, "sequential" if p == 95 else "random", dkill=k, rdma=r)
        for r in (False, True)
        for p in (80, 95, 110)
        for k in (25, 50, 90)
    ]
    return runs + [
        Setup(m, 95, "random", dkill=50, rdma=r) for r in (False, True) for m in (256, 1024)
    ]


def gap_facts(run: boot.GuestRun) -> dict[str, Any]:
    """What a daemon kill cost (``dkill`` runs), from the guest's own clock: when the first
    request completed after the kill and when every request held across it had (the device's
    counters), the supervisor's takeover line, the kernel's request-timer retry after the kill
    (console), and the longest one chunk of the workload took."""
    res = run.events.get("resumed", {})
    killed = run.events.get("killed", {})
    log = res.get("supervisor_log") or ""
    took = next((ln for ln in log.splitlines() if "took over" in ln), None)
    retry = None
    at = killed.get("uptime_at_kill")
    for m in re.finditer(r"\[\s*(\d+\.\d+)\] block nbd\d+: Connection timed out", run.console):
        if at is not None and float(m.group(1)) >= at:
            retry = round(float(m.group(1)) - at, 1)
            break
    result = (run.events.get("workload") or {}).get("result") or {}
    return {
        "resumed_s": res.get("seconds"),
        "gap": res.get("gap"),
        "takeover": took.split(" ", 2)[-1] if took else None,
        "kernel_retry_after_kill_s": retry,
        "max_chunk_s": result.get("max_chunk_s"),
        "max_chunk_phase": result.get("max_chunk_phase"),
        "standby": run.events.get("standby"),
        # connections the kernel took after the kill (each "reconnected socket"), and those the
        # supervisor handed because the kernel reported the device's connection dead
        "reconnected": len(re.findall(r"block nbd\d+: reconnected socket", run.console)),
        "mended": sum("connection dead while daemon pid" in ln for ln in log.splitlines()),
        # the daemon's connection cut on purpose after the workload (`guest_cut`)
        "cut": {
            k: (run.events.get("cut") or {}).get(k)
            for k in ("served_after_s", "read_error", "error", "reconnected_before")
        },
        # a second crash with the standby gone: a daemon forked from the supervisor (`guest_fork`)
        "fork": {
            k: (run.events.get("fork") or {}).get(k)
            for k in ("served_after_s", "read_error", "error", "replaced")
        },
        # the supervisor SIGKILLed after the workload: the daemon's guard restored the timer
        "guard": {
            k: (run.events.get("guard") or {}).get(k)
            for k in ("io_timeout_before", "io_timeout_after", "restored_after_s")
        },
    }


def classify(run: boot.GuestRun) -> tuple[str, str]:
    """(outcome, reason) of one guest run; see the module docstring."""
    console = run.console
    if "Kernel panic" in console:
        return "panicked", _first(console, r"Kernel panic[^\n]*")
    if run.hung:
        return "hung", "no page moved and the guest said nothing for the watchdog's period"
    if run.timed_out:
        return "hung", "the run's deadline passed"
    work = run.events.get("workload")
    result = (work or {}).get("result") or {}
    if result.get("bad_chunks"):
        return "bad-pages", f"{result['bad_chunks']} chunk(s) differ"
    if re.search(r"(Read|Write)-error on swap-device|I/O error, dev (nbd|loop)", console):
        return "bad-pages", _first(
            console,
            r"(?:Read|Write)-error on swap-device[^\n]*"
            r"|I/O error, dev (?:nbd|loop)[^\n]*",
        )
    disabled = run.events.get("disable", {}).get("rc") == 0
    if work is None:
        enable = run.events.get("enable", {})
        if enable.get("rc") not in (0, None):
            return "failed", f"enable failed: {str(enable.get('stderr', ''))[-300:]}"
        crash = run.events.get("crash", {}).get("error")
        return "failed", crash or "the guest ended before the workload did"
    if work.get("rc") == 0 and result.get("intact"):
        return (
            ("verified", "")
            if disabled
            else (
                "failed",
                "verified, but disable failed: " + str(run.events.get("disable"))[-300:],
            )
        )
    if work.get("rc") == -9 and re.search(r"Out of memory: Killed process \d+ \(python", console):
        return ("oom-killed", "") if disabled else ("failed", "OOM-killed, then disable failed")
    return "failed", f"workload exit {work.get('rc')}: {str(result)[-300:]}"


def _first(text: str, pattern: str) -> str:
    m = re.search(pattern, text)
    return m.group(0)[:300] if m else ""


def run_one(
    setup: Setup,
    out: Path,
    *,
    daemon_args: str,
    stall_s: float,
    timeout_s: float,
    sysctl: str = "",
    method: str = "kernel-nbd",
    guest_env: dict[str, str] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Boot one guest for `setup` (with `workers` daemon workers and as many vCPUs); its logs
    in OUT/NAME-TIME; one result record."""
    work = out / f"{setup.name.replace(':', '-')}-{time.strftime('%H%M%S')}"
    work.mkdir(parents=True)
    started = time.time()
    if setup.rdma:
        import rdma_check  # sibling module

        run = rdma_check.run_swap(
            **setup.rdma_kwargs(),
            timeout_s=timeout_s,
            stall_s=stall_s,
            workdir=work,
            guest_env=guest_env,
        )
        killed = run.events.get("memserver_killed")
        run.memserver_killed_at = killed["t"] if killed else None
    else:
        run = boot.run_guest(
            **setup.guest_kwargs(),
            daemon_args=daemon_args,
            stall_s=stall_s,
            timeout_s=timeout_s,
            workdir=work,
            sysctl=sysctl,
            method=method,
            guest_env=guest_env,
            cpus=workers,
            workers=workers,
        )
    outcome, reason = classify(run)
    facts = boot.summary(run)
    return {
        "setup": asdict(setup),
        "name": setup.name,
        "outcome": outcome,
        "reason": reason,
        "daemon_args": daemon_args,
        "workers": workers,
        "sysctl": sysctl,
        "method": method,
        "guest_env": guest_env or {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "seconds": run.seconds,
        "pages_out": facts["pages_out"],
        "pages_in": facts["pages_in"],
        "memserver_killed_at": run.memserver_killed_at,
        "memserver_stopped_at": run.memserver_stopped_at,
        "daemon_kill": gap_facts(run) if setup.dkill is not None else None,
        "kernel": sorted(set(_KERNEL.findall(run.console)))[:20],
        "logs": str(work),
    }


def _guest_env(a: argparse.Namespace) -> dict[str, str] | None:
    env = {}
    if a.nbd_io_timeout_ms:
        env["DUVM_NBD_IO_TIMEOUT_MS"] = str(a.nbd_io_timeout_ms)
    if a.console_loglevel is not None:
        env["DUVM_CONSOLE_LOGLEVEL"] = str(a.console_loglevel)
    return env or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="folder for results and logs")
    p.add_argument(
        "--only",
        action="append",
        metavar="MEM:PCT:ORDER[:kill|:stop|:dkillP][:rdma]",
        help="run only these set-ups (repeatable), e.g. 384:110:random:kill, 384:95:random:stop, "
        "384:95:sequential:dkill50; :rdma runs the memservers in the guest and moves pages over "
        "Soft-RoCE (rdma_check.py)",
    )
    p.add_argument(
        "--nbd-io-timeout-ms",
        type=int,
        metavar="MS",
        help="the block queue's timer in ms instead of the supervisor's 1000 (DECISIONS.md "
        "D48, item 6): the guest sets the nbd driver's request timeout to 0 and the queue's "
        "io_timeout to MS after enable",
    )
    p.add_argument(
        "--console-loglevel",
        type=int,
        metavar="N",
        help="the guest kernel's console log level (7: a hung task's stack reaches the console)",
    )
    p.add_argument(
        "--dkill",
        action="store_true",
        help="the daemon-kill matrix (issue 48: dkill_matrix) instead of the default one",
    )
    p.add_argument("--repeat", type=int, default=1, help="run the whole list N times")
    p.add_argument(
        "--daemon-args",
        default="",
        metavar="ARGS",
        help="extra `duvm daemon` flags in the guest (default: none, the defaults)",
    )
    p.add_argument(
        "--sysctl",
        default="",
        metavar="'NAME=VALUE ...'",
        help="guest kernel settings, e.g. 'kernel.sched_rt_runtime_us=-1'",
    )
    p.add_argument(
        "--stall",
        type=float,
        default=60,
        metavar="S",
        help="hung when no page moves for S seconds (default 60)",
    )
    p.add_argument("--timeout", type=float, default=900, metavar="S", help="per run")
    p.add_argument(
        "--method",
        choices=("kernel-nbd", "nbdfuse-loop"),
        default="kernel-nbd",
        help="how the guest's duvm attaches (nbdfuse-loop: the fallback without kernel nbd)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="`duvm enable --workers N` in a guest of N vCPUs (DECISIONS.md D49; not with :rdma)",
    )
    p.add_argument(
        "--stop-on-bad",
        action="store_true",
        help="stop after the first run that hung, panicked or lost pages",
    )
    a = p.parse_args(argv)
    try:
        setups = (
            [Setup.parse(s) for s in a.only]
            if a.only
            else dkill_matrix()
            if a.dkill
            else default_matrix()
        )
    except ValueError as exc:
        p.error(str(exc))
    if not 1 <= a.workers <= 8:
        p.error("--workers takes 1 to 8 (one vCPU each)")
    if a.workers > 1 and (bad := [s.name for s in setups if s.rdma]):
        p.error(f"--workers {a.workers} runs over TCP (the guest's memservers on the host): {bad}")
    if why := boot.problems():
        print(f"stress: cannot boot the guest here: {'; '.join(why)}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    records = []
    todo = [s for _ in range(a.repeat) for s in setups]
    for n, setup in enumerate(todo, 1):
        print(f"[{n}/{len(todo)}] {setup.name} ...", end=" ", flush=True)
        try:
            rec = run_one(
                setup,
                a.out,
                daemon_args=a.daemon_args,
                stall_s=a.stall,
                timeout_s=a.timeout,
                sysctl=a.sysctl,
                method=a.method,
                guest_env=_guest_env(a),
                workers=a.workers,
            )
        except boot.GuestUnavailable as exc:
            print(f"\nstress: cannot boot the guest here: {exc}", file=sys.stderr)
            return 2
        records.append(rec)
        with open(a.out / "results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{rec['outcome']} in {rec['seconds']} s {rec['reason']}".rstrip(), flush=True)
        if rec["daemon_kill"]:
            print(f"    daemon kill: {json.dumps(rec['daemon_kill'])}", flush=True)
        if a.stop_on_bad and rec["outcome"] in ("hung", "panicked", "bad-pages"):
            break
    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    print(" ".join(f"{o} {c}" for o, c in counts.items()))
    return 0 if not (counts["hung"] or counts["panicked"] or counts["bad-pages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
