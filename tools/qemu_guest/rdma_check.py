"""Prove a real verbs stack runs in the duvm test guest: Soft-RoCE (rdma_rxe) on its virtio NIC,
``ibv_rc_pingpong`` and ``rping`` over it (host side; issue 31's groundwork).

Theory of operation
-------------------
The guest is the one ``boot.py`` boots (Debian 12's kernel under QEMU/TCG, one vCPU, the host's
/ read-only over 9p, ``init.sh`` as PID 1), with :data:`build_initramfs.RDMA_MODULES` loaded
after the usual modules and ``rdma_guest.py`` as its script instead of ``guest_check.py``. The
verbs userspace is this host's own (Debian packages ibverbs-providers, ibverbs-utils,
rdmacm-utils; iproute2's ``rdma``), seen by the guest through 9p, so :func:`problems` checks it
is installed here. No memservers, no duvm code: only the kernel's rxe, the rdma-core tools and
the guest's own network stack (the RC traffic is rxe0 to itself, so nothing leaves the guest).

``main`` prints what was measured as JSON and exits 0 only when both ``ibv_rc_pingpong`` runs
(completion events and busy polling) passed on both ends; rping, and perftest's one-sided
``ib_read_lat``/``ib_read_bw``/``ib_write_bw`` when the host has perftest, are reported, not
required.
``--veth`` adds two experiments, reported and not judged: rxe on both ends of a veth pair in
two network namespaces, and in the initial one (``rdma_guest.veth_pingpong``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import boot  # sibling modules; tools/ is not a package
import build_initramfs

HERE = Path(__file__).resolve().parent
GUEST_SCRIPT = HERE / "rdma_guest.py"
DUVM_SCRIPT = HERE / "rdma_duvm_guest.py"  # duvm's RDMA transport (`--duvm`)
PINGPONGS = ("pingpong_events", "pingpong_poll")
EXPERIMENTS = ("veth_netns", "veth_init_ns")
PERFTESTS = ("ib_read_lat", "ib_read_bw", "ib_write_bw")  # when the host has perftest
# what the guest runs from this host over 9p: (path, Debian package)
USERSPACE = (
    ("/usr/bin/ibv_rc_pingpong", "ibverbs-utils"),
    ("/usr/bin/ibv_devices", "ibverbs-utils"),
    ("/usr/bin/ibv_devinfo", "ibverbs-utils"),
    ("/usr/bin/rping", "rdmacm-utils"),
    ("/etc/libibverbs.d/rxe.driver", "ibverbs-providers"),
    ("/usr/bin/rdma", "iproute2"),
)
_NUM = r"(\d+(?:\.\d+)?)"
_BYTES = re.compile(rf"(\d+) bytes in {_NUM} seconds = {_NUM} Mbit/sec")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_ITERS = re.compile(rf"(\d+) iters in {_NUM} seconds = {_NUM} usec/iter")


def problems() -> list[str]:
    """Why the RDMA guest cannot run here (empty: it can, apart from fetching the kernel)."""
    out = boot.problems()
    missing = sorted({pkg for path, pkg in USERSPACE if not Path(path).exists()})
    if missing:
        out.append(f"the guest's verbs userspace is missing (Debian packages {', '.join(missing)})")
    if not list(Path("/usr/lib/x86_64-linux-gnu/libibverbs").glob("librxe-*.so")):
        out.append("no rxe verbs provider (Debian package ibverbs-providers)")
    return out


def pingpong_numbers(out: str) -> dict[str, float | int] | None:
    """The figures one ibv_rc_pingpong end prints, or None when it printed none."""
    b, i = _BYTES.search(out), _ITERS.search(out)
    if b is None or i is None:
        return None
    return {
        "bytes": int(b.group(1)),
        "seconds": float(b.group(2)),
        "mbit_s": float(b.group(3)),
        "iters": int(i.group(1)),
        "usec_per_iter": float(i.group(3)),
    }


def perftest_numbers(out: str) -> dict[str, float | int] | None:
    """The result row under perftest's table header (latency or bandwidth), or None."""
    lines = out.splitlines()
    for head, row in itertools.pairwise(lines):
        cells = row.split()
        if not head.lstrip().startswith("#bytes") or not cells:
            continue
        if not all(_NUMBER.fullmatch(c) for c in cells):
            return None
        values = [float(c) for c in cells]
        if "t_avg[usec]" in head and len(values) >= 9:
            keys = ("t_min", "t_max", "t_typical", "t_avg", "t_stdev", "p99", "p99_9")
            return {"bytes": int(values[0]), "iters": int(values[1])} | {
                f"{k}_usec": v for k, v in zip(keys, values[2:9], strict=True)
            }
        if "BW average[MB/sec]" in head and len(values) >= 5:
            return {
                "bytes": int(values[0]),
                "iters": int(values[1]),
                "bw_peak_mb_s": values[2],
                "bw_avg_mb_s": values[3],
                "msg_rate_mpps": values[4],
            }
    return None


def pingpong_ok(ev: dict[str, Any] | None) -> bool:
    """Both ends exited 0 and printed their figures."""
    if not ev or not ev.get("listening"):
        return False
    ends = [ev.get("server"), ev.get("client")]
    return all(
        isinstance(e, dict) and e.get("rc") == 0 and pingpong_numbers(e.get("out", ""))
        for e in ends
    )


def rping_ok(ev: dict[str, Any] | None) -> bool:
    cli = (ev or {}).get("client") or {}
    srv = (ev or {}).get("server") or {}
    return cli.get("rc") == 0 and srv.get("rc") == 0 and "ping data" in cli.get("out", "")


def run_check(
    *,
    python: str = sys.executable,
    mem_mib: int = 256,
    iters: int = 1000,
    size: int = 4096,
    timeout_s: float = 300,
    veth: bool = False,
    workdir: Path | None = None,
    cache: Path = build_initramfs.DEFAULT_CACHE,
    script: Path = GUEST_SCRIPT,
    env: dict[str, str] | None = None,
    stall_s: float | None = None,
) -> boot.GuestRun:
    """Boot the RDMA guest once; always kills QEMU and removes its own temp folder. With
    `stall_s`, the kernel-nbd guest's watchdog (boot.Watchdog) ends a run as hung, after the
    kernel's SysRq dumps."""
    if why := problems():
        raise boot.GuestUnavailable("; ".join(why))
    try:
        kernel = build_initramfs.ensure_kernel(cache, extra=build_initramfs.RDMA_MODULES)
    except build_initramfs.KernelUnavailable as exc:
        raise boot.GuestUnavailable(str(exc)) from exc
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="duvm-rdma-")) if workdir is None else workdir
    qemu: subprocess.Popen[bytes] | None = None
    try:
        env = {
            "DUVM_PYTHON": python,
            "DUVM_SCRIPT": str(script),
            "DUVM_GUEST_IP": "10.0.2.15",
            "DUVM_GATEWAY": boot.HOST_FROM_GUEST,
            "DUVM_RDMA_NETDEV": "eth0",
            "DUVM_RDMA_ITERS": str(iters),
            "DUVM_RDMA_SIZE": str(size),
            "DUVM_RDMA_VETH": "1" if veth else "",
            **(env or {}),
        }
        initrd = build_initramfs.build_initramfs(kernel, env, work / "initramfs.cpio")
        console, results = work / "console.log", work / "results.log"
        monitor = work / "monitor.sock" if stall_s else None
        cmd = boot.qemu_command(kernel, initrd, mem_mib, console, results, monitor=monitor)
        t0 = time.monotonic()
        qemu = boot.start_qemu(cmd, work / "qemu.log")
        watch = boot.Watchdog(console, stall_s, None)
        while qemu.poll() is None and time.monotonic() < t0 + timeout_s and not watch.hung:
            time.sleep(1.0)
            watch.poll(time.monotonic())
        if watch.hung and monitor is not None:
            boot.sysrq(monitor, boot.HUNG_SYSRQ)
            time.sleep(boot.HUNG_SYSRQ_FLUSH_S)
        rc = qemu.poll()
        seconds = round(time.monotonic() - t0, 1)
        boot.kill_group(qemu)
        events, markers = boot.parse_results(boot.read_text(results))
        return boot.GuestRun(
            rc,
            rc is None and not watch.hung,
            seconds,
            events,
            markers,
            boot.read_text(console) + boot.read_text(work / "qemu.log"),
            hung=watch.hung,
        )
    finally:
        if qemu is not None:
            boot.kill_group(qemu)
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


def run_swap(
    *,
    python: str = sys.executable,
    mem_mib: int = 768,
    workload_mib: int = 96,
    cgroup_mib: int | None = 48,
    swap_size: str = "192M",
    capacity: str = "192M",
    memservers: int = 2,
    order: str = "sequential",
    chunk_kib: int = 1024,
    kill_memserver_at: int | None = None,
    kill_daemon_at: int | None = None,
    timeout_s: float = 600,
    stall_s: float | None = None,
    workdir: Path | None = None,
    guest_env: dict[str, str] | None = None,
) -> boot.GuestRun:
    """Kernel-nbd swap over duvm's RDMA transport: `guest_check.py` (the kernel-nbd guest's
    script) with DUVM_RDMA, so two memservers run in the guest on its eth0 address with
    `--rdma on` and a cluster secret made here, and `duvm enable --peers rdma://...,rdma://...
    --size ... --secret-file F` runs with the defaults (two copies, pages encrypted; one with
    `memservers=1`). The workload fills `workload_mib` MiB in a memory cgroup of `cgroup_mib`
    (None: none, it outgrows the guest), touching chunks of `chunk_kib` in `order`, and
    verifies every byte; with `kill_memserver_at` the guest SIGKILLs
    the second memserver when the fill reaches that percentage, with `kill_daemon_at` the
    daemon (its supervisor's standby must take the live device over, over RDMA again; the
    workload runs on)."""
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="duvm-rdma-swap-")) if workdir is None else workdir
    try:
        secret = boot.cluster_secret(python, work)
        env = {
            "DUVM_RDMA": "1",
            "DUVM_PEERS": "",
            "DUVM_LOCAL_MEMSERVERS": str(memservers),
            "DUVM_ORDER": order,
            "DUVM_CHUNK_KIB": str(chunk_kib),
            "DUVM_CAPACITY": capacity,
            "DUVM_SIZE": swap_size,
            "DUVM_MIB": str(workload_mib),
            "DUVM_CGROUP_MIB": "" if cgroup_mib is None else str(cgroup_mib),
            "DUVM_SECRET_FILE": str(secret),
            "DUVM_HUNG_TASK_S": "30",
            "DUVM_KILL_LOCAL_MEMSERVER_AT_PCT": ""
            if kill_memserver_at is None
            else str(kill_memserver_at),
            "DUVM_KILL_AT_PCT": "" if kill_daemon_at is None else str(kill_daemon_at),
            **(guest_env or {}),  # the stress runs' extra settings (console log level)
        }
        return run_check(
            python=python,
            mem_mib=mem_mib,
            timeout_s=timeout_s,
            workdir=work,
            script=boot.GUEST_SCRIPT,
            env=env,
            stall_s=stall_s,
        )
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


def summary(run: boot.GuestRun) -> dict[str, Any]:
    """What was measured, for people and for the test."""
    ev = run.events
    devices = ev.get("devices", {})
    out: dict[str, Any] = {
        "qemu_seconds": run.seconds,
        "timed_out": run.timed_out,
        "guest_exit": run.guest_exit,
        "booted_at": next(
            (float(m.split()[1]) for m in run.markers if m.startswith("DUVM-GUEST-BOOTED ")), None
        ),
        "kernel": ev.get("start", {}).get("kernel"),
        "link_add": {k: ev.get("link_add", {}).get(k) for k in ("cmd", "rc", "out")},
        "rdma_link": (devices.get("rdma_link") or {}).get("out", "").strip() or None,
        "ibv_devices": (devices.get("ibv_devices") or {}).get("out", "").strip() or None,
        "dev_infiniband": devices.get("dev_infiniband"),
        "gids": devices.get("gids"),
    }
    for name in PINGPONGS:
        p = ev.get(name) or {}
        out[name] = {
            "ok": pingpong_ok(p),
            "gid_index": p.get("gid_index"),
            "seconds": p.get("s"),
            "server": pingpong_numbers((p.get("server") or {}).get("out", "")),
            "client": pingpong_numbers((p.get("client") or {}).get("out", "")),
        }
    r = ev.get("rping") or {}
    out["rping"] = {
        "ok": rping_ok(r),
        "seconds": r.get("s"),
        "ping_lines": (r.get("client") or {}).get("out", "").count("ping data"),
    }
    for name in PERFTESTS:
        if (x := ev.get(name)) is not None:
            cli = x.get("client") or {}
            out[name] = {
                "rc": [(x.get("server") or {}).get("rc"), cli.get("rc")],
                "client": perftest_numbers(cli.get("out", "")),
            }
    for name in EXPERIMENTS:
        if (x := ev.get(name)) is not None:
            out[name] = {
                "ok": pingpong_ok(x),
                "failed_steps": x.get("steps"),
                "gid_indexes": [e.get("gid_index") for e in x.get("ends", [])],
                "client": pingpong_numbers((x.get("client") or {}).get("out", "")),
                "client_out": None if pingpong_ok(x) else (x.get("client") or {}).get("out"),
                "rdma_system": (x.get("rdma_system") or {}).get("out", "").strip() or None,
            }
    out["ok"] = all(out[name]["ok"] for name in PINGPONGS)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Soft-RoCE (rdma_rxe) verbs check in the QEMU guest")
    p.add_argument("--mem", type=int, default=256, help="guest RAM (MiB)")
    p.add_argument("--iters", type=int, default=1000, help="ibv_rc_pingpong -n")
    p.add_argument("--size", type=int, default=4096, help="ibv_rc_pingpong -s (bytes)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument(
        "--veth",
        action="store_true",
        help="also try rxe across a veth pair (two network namespaces, then one); not judged",
    )
    p.add_argument("--keep", type=Path, help="keep the logs in this folder")
    p.add_argument("--verbose", action="store_true", help="also every step's raw output")
    a = p.parse_args(argv)
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
    try:
        run = run_check(
            mem_mib=a.mem,
            iters=a.iters,
            size=a.size,
            timeout_s=a.timeout,
            veth=a.veth,
            workdir=a.keep,
        )
    except boot.GuestUnavailable as exc:
        print(f"rdma_check: cannot boot the guest here: {exc}", file=sys.stderr)
        return 2
    s = summary(run)
    print(json.dumps(s, indent=2))
    if a.verbose:
        print(json.dumps(run.events, indent=2))
    if not s["ok"]:
        print(json.dumps(run.events, indent=2)[-6000:], file=sys.stderr)
        print(run.console_tail(), file=sys.stderr)
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
