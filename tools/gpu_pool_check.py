"""Check duvm's pool under a GPU workload: pageable host memory goes to the pool and comes back
intact, pinned memory stays resident, and where HMM is active a GPU kernel reads pageable
memory larger than its cgroup's RAM limit.

The same script runs on a GPU machine and on a CPU-only one (CI); where there is no GPU, the
GPU steps are skipped and the output says so. Steps:

1. what ``duvm doctor`` reports of this node's GPU (``gpu-hmm``) and of locked or pinned RAM;
2. duvm enabled on this machine, as ``duvm demo`` does it: 3 memservers on loopback proving
   a temporary cluster secret, ``duvm enable`` with its own state directory (kernel nbd where
   the kernel has it, else the nbdfuse + loop fallback by name: the workload's memory cgroup
   keeps the machine from running short), the device at the highest swap priority;
3. tools/gpu_pool_worker.py in a memory cgroup limited to ``--limit-mib``: pageable buffers of
   ``--mib`` (PyTorch CPU tensors moved to the GPU and back in turns, or without PyTorch/CUDA
   an mmap read and rewritten on the CPU), every byte verified each round; a pinned buffer
   (``pin_memory=True``, or ``mlock`` without CUDA) checked resident page by page; with HMM a
   GPU kernel summing the whole pageable buffer in place. Meanwhile the cgroup's swap use, the
   device's, and the memservers' pages are sampled, and ``gputaskman --json`` is read once for
   the worker's row (VRAM, bytes in the pool, pinned bytes: n/a where it has no such field);
4. ``duvm disable``, the memservers stopped, and a look for anything left behind (swap, loop
   devices, mounts under the state directory, the cgroup, processes).

stdout: JSON lines, each ``{"step": ..., "status": "pass"|"fail"|"skip"|"info", ...}``, the last
one ``{"step": "summary", "ok": ..., ...}``. Exit status 0 when every check passed, 1 when one
failed (a bad byte among them), 2 when it cannot run here (not root, no way to attach a device,
another swap at the highest priority).

    sudo uv run python tools/gpu_pool_check.py                       # CPU: 192 MiB, 64 MiB limit
    sudo uv run python tools/gpu_pool_check.py --python /usr/bin/python3 --require-gpu \\
        --mib 6144 --limit-mib 2048 --pinned-mib 256                  # a GPU node with PyTorch

``--python`` runs the worker with another interpreter (one that has PyTorch); the worker needs
only the standard library. On a GPU node the limit must leave room for the CUDA libraries the
worker maps, so it is larger there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from duvm.base import cgroup
from duvm.cli import demo
from duvm.node.attach import attach_state, kernel_swap, processes
from duvm.node.doctor import doctor_gpu
from duvm.node.lifecycle import control
from duvm.node.lifecycle.config import with_secret

WORKER = Path(__file__).resolve().with_name("gpu_pool_worker.py")
MIB = 1 << 20


def emit(step: str, status: str, **fields: Any) -> None:
    print(json.dumps({"step": step, "status": status, **fields}), flush=True)


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class Watch(threading.Thread):
    """Samples, until stopped: the cgroup's swap use, the swap device's, memserver pages."""

    def __init__(self, cg: cgroup.MemoryCgroup, device: str, sampler: demo.Sampler) -> None:
        super().__init__(daemon=True)
        self.cg, self.device, self.sampler = cg, device, sampler
        self.cgroup_swap_peak: int | None = None
        self.device_used_peak_kb = 0
        self.stop = threading.Event()

    def sample(self) -> None:
        now = self.cg.swap_bytes()  # None: the kernel does not account it
        if now is not None:
            self.cgroup_swap_peak = max(self.cgroup_swap_peak or 0, now)
        entry = kernel_swap.swap_entry(self.device)
        if entry is not None:
            self.device_used_peak_kb = max(self.device_used_peak_kb, entry.used_kb)
        with contextlib.suppress(Exception):  # a display helper never takes the run down
            self.sampler.sample()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(0.2)


def gputaskman_command() -> list[str] | None:
    exe = shutil.which("gputaskman")
    if exe:
        return [exe, "--json"]
    if importlib.util.find_spec("gputaskman") is not None:
        code = "import sys; from gputaskman.cli import main; sys.exit(main())"
        return [sys.executable, "-c", code, "--json"]
    return None


def _value(entry: dict[str, Any], names: tuple[str, ...]) -> tuple[str | None, Any]:
    """The first of `names` in `entry` (a reading's value, or the number itself)."""
    for key in entry:
        if any(n in key for n in names):
            v = entry[key]
            return key, v.get("value") if isinstance(v, dict) else v
    return None, None


def gputaskman_row(pid: int) -> dict[str, Any]:
    """The worker's row in `gputaskman --json`: VRAM, bytes in the pool, pinned bytes, each
    n/a where gputaskman has no such field or no such row."""
    out: dict[str, Any] = {"vram_bytes": "n/a", "pool_bytes": "n/a", "pinned_bytes": "n/a"}
    cmd = gputaskman_command()
    if cmd is None:
        return {**out, "why": "gputaskman is not installed"}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        doc = json.loads(res.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {**out, "why": f"gputaskman --json gave nothing readable: {exc}"}
    rows = [p for p in doc.get("processes") or [] if isinstance(p, dict) and p.get("pid") == pid]
    if not rows:
        gone = doc.get("unavailable")
        why = (gone.get("detail") or gone.get("reason")) if isinstance(gone, dict) else None
        why = why or "not among its GPU processes"
        return {**out, "why": f"no row for pid {pid}: {why}", "backend": doc.get("backend")}
    row = rows[0]
    for field, names in (
        ("vram_bytes", ("vram_bytes",)),
        ("pool_bytes", ("pool", "swap")),
        ("pinned_bytes", ("pinned", "locked")),
    ):
        key, value = _value(row, names)
        out[field] = "n/a" if value is None else value
        out[f"{field}_key"] = key
    return {**out, "keys": sorted(row)}


def leftovers(state_dir: Path, device: str | None, pids: list[int], cg: str | None) -> list[str]:
    left = []
    for bf in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if bf.read_text().startswith(str(state_dir)):
                left.append(f"loop device {bf.parent.parent.name}")
    for line in Path("/proc/mounts").read_text().splitlines():
        if line.split()[1].startswith(str(state_dir)):
            left.append(f"mount {line.split()[1]}")
    if device and kernel_swap.swap_entry(device) is not None:
        left.append(f"swap {device}")
    if cg and Path(cg).exists():
        left.append(f"cgroup {cg}")
    left += [f"process {p}" for p in pids if processes.pid_alive(p)]
    left += [f"state {p.name}" for p in (state_dir / "state.json",) if p.exists()]
    return left


def run_worker(
    args: argparse.Namespace, device: str, sampler: demo.Sampler, summary: dict[str, Any]
) -> dict[str, Any] | None:
    """The worker in its memory cgroup, watched; its result (None: it gave none)."""
    cmd = [args.python, str(WORKER), "--mib", str(args.mib), "--pinned-mib", str(args.pinned_mib)]
    cmd += ["--rounds", str(args.rounds), "--chunk-mib", str(args.chunk_mib)]
    cmd += ["--require-gpu"] if args.require_gpu else []
    result = None
    with cgroup.MemoryCgroup(args.limit_mib * MIB, prefix="duvm-gpucheck") as cg:
        summary["cgroup"] = str(cg.path)
        watch = Watch(cg, device, sampler)
        watch.start()
        with tempfile.TemporaryFile("w+") as err:
            proc = cg.popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            summary["pids"].append(proc.pid)
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                event = doc.pop("event", None)
                if event == "ready":
                    row = gputaskman_row(proc.pid)
                    emit("gputaskman", "info", **row)
                    summary["gputaskman"] = row
                elif event == "round":
                    emit("round", "info", **doc)
                elif event == "result":
                    result = doc
            proc.wait()
            err.seek(0)
            summary["worker_exit"] = proc.returncode
            summary["worker_oom_kills"] = cg.oom_kills()
            summary["worker_stderr_tail"] = err.read()[-2000:] or None
        watch.stop.set()
        watch.join(10)
        watch.sample()
        summary["cgroup_swap_peak_bytes"] = watch.cgroup_swap_peak
        summary["device_used_peak_kb"] = watch.device_used_peak_kb
    return result


def verdicts(result: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, bool]:
    """Each check of the run, True when it passed."""
    r = result or {}
    rounds_bytes = r.get("pageable_bytes", 0) * (2 if r.get("gpu_moves") == "run" else 1)
    want = (rounds_bytes + r.get("pinned_bytes", 0)) * r.get("rounds", 0)
    # the device held pages, and the worker saw its own pageable pages swapped out (pagemap);
    # the cgroup's own swap count too, where the kernel keeps one
    swap_seen = [summary.get("device_used_peak_kb", 0), r.get("pageable_swapped_max", 0)]
    if summary.get("cgroup_swap_peak_bytes") is not None:
        swap_seen.append(summary["cgroup_swap_peak_bytes"])
    return {
        "every byte verified": bool(r)
        and r.get("bad_chunks") == 0
        and r.get("intact") is True
        and r.get("bytes_verified") == want > 0,
        "swap used": all(v > 0 for v in swap_seen),
        "pinned stayed resident": r.get("pinned_resident") is True
        and r.get("pinned_checks", 0) > 0,
        "gpu kernel": not str(r.get("gpu_kernel", "")).startswith("FAIL"),
        "worker exit 0": summary.get("worker_exit") == 0,
        "worker not OOM-killed": not summary.get("worker_oom_kills"),  # None: not reported
        "disabled cleanly": summary.get("swapoff_ok") is True,
        "nothing left behind": summary.get("left") == [],
    }


def run(args: argparse.Namespace) -> int:
    problems = demo.preflight()
    others = demo.competing_swaps()
    if others:
        problems.append(f"swap {others} is active at the highest priority: pages would go there")
    if problems:
        emit("preflight", "fail", problems=problems)
        emit("summary", "fail", ok=False, error="cannot run here: " + "; ".join(problems))
        return 2
    emit("doctor", "info", **{c.name: c.detail for c in (doctor_gpu.check_gpu_hmm(),)})
    emit("doctor", "info", **{"pinned-memory": doctor_gpu.check_pinned().detail})
    state_dir: Path = args.state_dir
    size = args.size_mib * MIB if args.size_mib else (args.mib + args.mib // 2) * MIB
    capacity = max(size * 2 // 3 + 16 * MIB, 32 * MIB)  # 2 copies over 3 memservers
    secret = state_dir / "gpucheck.secret"
    cfg = control.Config(
        peers=[],
        size=size,
        replicas=2,
        method=demo.demo_method(args.method),
        state_dir=state_dir,
        secret_file=secret,
        priority=demo.MAX_PRIORITY,
        daemon_args=with_secret([], secret),
    )
    summary: dict[str, Any] = {"state_dir": str(state_dir), "pids": [], "cgroup": None}
    servers: demo.Memservers | None = None
    enabled, result, device = False, None, None
    try:
        demo.write_temporary_secret(secret)
        servers = demo.Memservers(3, capacity, secret)
        summary["pids"] += servers.pids
        cfg.peers = servers.addrs
        cfg.validate()
        att = control.enable(cfg)
        enabled, device = True, att.device
        summary["pids"] += [
            p
            for p in (
                att.extra.get("daemon_pid"),
                att.extra.get("supervisor_pid"),
                att.nbdfuse_pid,
                att.holder_pid,
            )
            if isinstance(p, int)
        ]
        emit("enable", "pass", device=att.device, method=att.method, size_mib=size // MIB)
        security = control.peer_security(cfg.daemon_args, cfg.peers)
        sampler = demo.Sampler(servers.addrs, security=security)
        sampler.sample()
        since = dict(sampler.counters)
        before = vmstat()
        result = run_worker(args, att.device or "", sampler, summary)
        after = vmstat()
        summary["pswpout"] = after["pswpout"] - before["pswpout"]
        summary["pswpin"] = after["pswpin"] - before["pswpin"]
        summary["memserver_stored_pages"] = sampler.moved(since, "pages_stored")
        summary["memserver_peak_pages"] = dict(sampler.peak)
        try:
            control.disable(state_dir)
            enabled, summary["swapoff_ok"] = False, True
        except attach_state.SwapoffFailed as exc:
            summary["swapoff_ok"], summary["error"] = False, str(exc)
    except (control.ControlError, attach_state.AttachError, cgroup.CgroupError, OSError) as exc:
        summary["error"] = str(exc)
    finally:
        if enabled and summary.get("swapoff_ok") is not False:
            with contextlib.suppress(control.ControlError, attach_state.AttachError):
                control.disable(state_dir, force=True)
                enabled = False
        if servers is not None and enabled:  # swapoff failed: pages still live there
            summary["error"] = (summary.get("error") or "") + (
                f"; left running so that no swapped page is lost: the device, its daemon and "
                f"the memservers (pids {servers.pids}); free memory, run `duvm disable "
                f"--state-dir {state_dir}`, then stop those pids"
            )
            servers.release()
        elif servers is not None:
            servers.close()
        if not enabled:
            secret.unlink(missing_ok=True)
    summary["left"] = leftovers(state_dir, device, summary["pids"], summary["cgroup"])
    if result is not None:
        emit("worker", "pass" if result.get("intact") else "fail", **result)
    checks = verdicts(result, summary)
    for name, ok in checks.items():
        emit("check", "pass" if ok else "fail", check=name)
    ok = all(checks.values()) and not summary.get("error")
    emit("summary", "pass" if ok else "fail", ok=ok, checks=checks, worker=result, **summary)
    return 0 if ok else 1


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _raise_on_signal)  # unwind through the teardown
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=192, help="pageable memory of the worker, MiB")
    p.add_argument("--limit-mib", type=int, default=64, help="the worker's cgroup RAM limit")
    p.add_argument("--pinned-mib", type=int, default=16, help="the pinned buffer, MiB")
    p.add_argument("--chunk-mib", type=int, default=8, help="moved to the GPU at a time, MiB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--size-mib", type=int, default=0, help="swap device size (default 1.5x)")
    p.add_argument(
        "--method",
        choices=("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE),
        default="auto",
        help="how to attach the device (auto: kernel nbd where the kernel has it, else "
        "the nbdfuse + loop fallback)",
    )
    p.add_argument("--state-dir", type=Path, default=Path("/run/duvm-gpucheck"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the worker")
    p.add_argument("--require-gpu", action="store_true", help="fail without PyTorch + CUDA")
    args = p.parse_args(argv)
    if not 2 * args.limit_mib <= args.mib <= 4 * args.limit_mib:
        p.error("--mib must be 2 to 4 times --limit-mib, so the worker swaps")
    if args.limit_mib <= args.pinned_mib + 2 * args.chunk_mib:
        p.error("--limit-mib must leave room beside the pinned buffer and two chunks")
    args.state_dir.mkdir(parents=True, exist_ok=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
