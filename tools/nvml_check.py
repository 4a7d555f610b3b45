"""Check gputaskman's NVML backend against nvidia-smi on a real NVIDIA GPU.

Starts a workload with a known footprint on GPU 0 (a safetensors "model" file loaded through a
kept-open ``safe_open``, so the file stays memory-mapped and named by ``--model``; a further
allocation; a bf16 matrix-product loop for engine load), then reads the same moment three ways:
``nvidia-smi``'s CSV queries, PyTorch's own counters, and ``gputaskman --json``. Each check
compares one number and says PASS, FAIL or SKIP with both values.

Needs python3 with torch (and safetensors for the model check), nvidia-smi on the PATH, and
gputaskman importable (``PYTHONPATH=packages/gputaskman/src`` from the repository root).

    python3 tools/nvml_check.py --out DIR

Writes into DIR: ``report.json`` (every check), ``gputaskman.json`` and ``gputaskman-once.txt``,
``nvidia-smi.txt``, ``query-gpu.csv``, ``compute-apps.csv``, ``workload.log``. Exit status 0
when no check failed, 1 when one did, 2 when there is no NVIDIA GPU to check.

Health and MIG (every run; ``--health-only`` skips the workload and needs no PyTorch): each
GPU's health readings and MIG state in ``gputaskman --json`` are compared with what
``nvidia-smi -q -x`` says of the same GPU (`compare_health`, saved as ``nvidia-smi-q.xml``):
ECC volatile and aggregate counts, retired pages, remapped rows, the fan, the slowdown clock
event reasons, the MIG mode, each MIG instance's ids and memory and the instance of each
process; PCIe rates (nvidia-smi samples 20 ms, gputaskman a refresh) and NVLink (not in
``-q``) are listed with both values, not judged. XID: one gputaskman process samples twice
and its count must then be measured. ``--cost`` times each NVML call a refresh makes for
health and MIG on GPU 0 (median of 200, ``costs.json``). Nothing is set or cleared: only Get
calls, and an XID event set of this process's own; a GPU's MIG mode is read, never changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nvml_health_check as hc  # the health and MIG comparison (beside this file)

MIB = 1 << 20

WORKLOAD = r"""
import os, sys, time
import torch
model, weights_mib, extra_mib = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seconds = float(sys.argv[5])
dev = "cuda:0"
keep = []
try:
    from safetensors import safe_open
    from safetensors.torch import save_file
    if not os.path.exists(model):
        rows = 4096
        cols = weights_mib * (1 << 20) // 2 // rows
        save_file({"layer.0.weight": torch.ones(rows, cols, dtype=torch.bfloat16)}, model)
    handle = safe_open(model, framework="pt", device=dev)  # kept open: the file stays mapped
    keep = [handle.get_tensor(k) for k in handle.keys()]
except ImportError as err:
    print("no safetensors:", err, flush=True)
extra = torch.ones(extra_mib * (1 << 20), dtype=torch.uint8, device=dev)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
torch.cuda.synchronize()
print("ready", torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
print("done", flush=True)
"""


def smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False
    ).stdout


def csv_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def query_gpus() -> list[dict[str, str]]:
    fields = "index,pci.bus_id,name,driver_version,memory.used,memory.total,utilization.gpu"
    rows = csv_rows(smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits"))
    return [dict(zip(fields.split(","), r, strict=False)) for r in rows]


def run_gputaskman(*args: str) -> tuple[str, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", "from gputaskman.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return out.stdout + out.stderr, time.monotonic() - t0


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(
        self, name: str, ok: bool | None, gputaskman: Any, reference: Any, note: str = ""
    ) -> None:
        verdict = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        self.rows.append(
            {
                "check": name,
                "verdict": verdict,
                "gputaskman": gputaskman,
                "reference": reference,
                "note": note,
            }
        )
        print(
            f"{verdict:4}  {name}: gputaskman={gputaskman!r} reference={reference!r} {note}",
            flush=True,
        )

    @property
    def failed(self) -> bool:
        return any(r["verdict"] == "FAIL" for r in self.rows)


def value(reading: Any) -> Any:
    return reading.get("value") if isinstance(reading, dict) else None


def compare(
    doc: dict[str, Any],
    before: list[dict[str, str]],
    after: list[dict[str, str]],
    apps: list[list[str]],
    pid: int,
    ready: list[str],
    model: str,
    checks: Checks,
) -> None:
    adapters = [a for a in doc.get("adapters", []) if a.get("backend") == "nvml"]
    checks.add("backend", doc.get("backend") == "nvml", doc.get("backend"), "nvml")
    checks.add(
        "driver version",
        doc.get("driver_version") == before[0]["driver_version"],
        doc.get("driver_version"),
        before[0]["driver_version"],
    )
    checks.add("adapter count", len(adapters) == len(before), len(adapters), len(before))
    for smi_gpu, smi_after in zip(before, after, strict=False):
        i = int(smi_gpu["index"])
        a = next((x for x in adapters if x.get("index") == i), None)
        if a is None:
            checks.add(f"gpu{i} present", False, None, smi_gpu["pci.bus_id"])
            continue
        m = a.get("metrics") or {}
        checks.add(f"gpu{i} name", a.get("name") == smi_gpu["name"], a.get("name"), smi_gpu["name"])
        checks.add(
            f"gpu{i} pci bus id",
            (a.get("pci_bus_id") or "").lower() == smi_gpu["pci.bus_id"].lower(),
            a.get("pci_bus_id"),
            smi_gpu["pci.bus_id"],
        )
        total = value(m.get("memory_total_bytes"))
        ref_total = int(smi_gpu["memory.total"]) * MIB
        checks.add(
            f"gpu{i} memory total (1 MiB)",
            total is not None and abs(total - ref_total) < MIB,
            total,
            ref_total,
            "nvidia-smi rounds down to MiB",
        )
        used = value(m.get("memory_used_bytes"))
        lo = min(int(smi_gpu["memory.used"]), int(smi_after["memory.used"])) * MIB - 64 * MIB
        hi = (max(int(smi_gpu["memory.used"]), int(smi_after["memory.used"])) + 1) * MIB + 64 * MIB
        checks.add(
            f"gpu{i} memory used (within the two nvidia-smi reads, 64 MiB slack)",
            used is not None and lo <= used <= hi,
            used,
            [lo, hi],
        )
        kinds = {k: (r or {}).get("kind") for k, r in m.items() if value(r) is not None}
        checks.add(
            f"gpu{i} memory readings measured",
            kinds.get("memory_used_bytes") == "measured",
            kinds.get("memory_used_bytes"),
            "measured",
        )
        if i == 0:
            util = value(m.get("util_gpu_percent"))
            checks.add(
                "gpu0 utilisation under a matrix-product loop > 0",
                util is not None and util > 0,
                util,
                [smi_gpu["utilization.gpu"], smi_after["utilization.gpu"]],
            )
    smi_pids = {int(r[0]): int(r[1]) * MIB for r in apps if r and r[0].isdigit() and r[1].isdigit()}
    procs = {p.get("pid"): p for p in doc.get("processes", [])}
    checks.add(
        "nvidia-smi lists the workload's pid",
        pid in smi_pids,
        None,
        sorted(smi_pids),
        f"workload pid {pid}; a PID-namespaced sandbox lists host pids or none",
    )
    p = procs.get(pid)
    checks.add(
        "gputaskman lists the workload's pid", p is not None, sorted(k for k in procs if k), pid
    )
    torch_reserved = int(ready[2]) if len(ready) > 2 else None
    if p is None:
        return
    vram = value(p.get("vram_bytes"))
    if pid in smi_pids:
        checks.add(
            "workload VRAM equals nvidia-smi's (1 MiB)",
            vram is not None and abs(vram - smi_pids[pid]) < MIB,
            vram,
            smi_pids[pid],
        )
    else:
        checks.add(
            "workload VRAM equals nvidia-smi's", None, vram, None, "nvidia-smi did not list the pid"
        )
    checks.add(
        "workload VRAM >= torch memory_reserved",
        vram is not None and torch_reserved is not None and vram >= torch_reserved,
        vram,
        torch_reserved,
        "the CUDA context adds to what torch holds",
    )
    checks.add(
        "workload VRAM kind",
        (p.get("vram_bytes") or {}).get("kind") == "measured",
        (p.get("vram_bytes") or {}).get("kind"),
        "measured",
    )
    got = (p.get("model") or {}).get("path")
    sources = (p.get("model") or {}).get("sources")
    checks.add("model file found for the workload", got == model, got, model, f"sources {sources}")


def health_checks(out: Path, doc: dict[str, Any], checks: Checks) -> None:
    """`compare_health` against a ``nvidia-smi -q -x`` read now, and the XID two-sample check."""
    xml_text = smi("-q", "-x")
    (out / "nvidia-smi-q.xml").write_text(xml_text)
    try:
        hc.compare_health(doc, xml_text, checks)
    except Exception as err:  # a format this script does not know: say so, do not crash
        checks.add("nvidia-smi -q -x parses", False, None, None, repr(err))
    hc.xid_two_samples(checks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the report and raw outputs")
    ap.add_argument(
        "--weights-mib", type=int, default=2048, help="size of the model file (default 2048)"
    )
    ap.add_argument("--extra-mib", type=int, default=4096, help="further allocation (default 4096)")
    ap.add_argument(
        "--seconds", type=float, default=40.0, help="how long the workload runs (default 40)"
    )
    ap.add_argument(
        "--health-only", action="store_true", help="health and MIG checks only (no PyTorch)"
    )
    ap.add_argument("--cost", action="store_true", help="time each health and MIG NVML call")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi on the PATH: nothing to check", file=sys.stderr)
        return 2
    if args.cost:
        hc.nvml_costs(args.out)
    if args.health_only:
        checks = Checks()
        text, _ = run_gputaskman("--json")
        (args.out / "gputaskman.json").write_text(text)
        try:
            health_checks(args.out, json.loads(text), checks)
        finally:
            (args.out / "report.json").write_text(json.dumps(checks.rows, indent=1))
        return 1 if checks.failed else 0
    (args.out / "nvidia-smi.txt").write_text(smi() + "\n" + smi("-q"))
    model = "/tmp/nvml-check-model.safetensors"
    log = (args.out / "workload.log").open("w")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKLOAD,
            "--model",
            model,
            str(args.weights_mib),
            str(args.extra_mib),
            str(args.seconds),
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    checks = Checks()
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().split()
        log.write(" ".join(ready) + "\n")
        if not ready or ready[0] != "ready":
            checks.add("workload started", False, None, "ready", " ".join(ready))
            return 1
        time.sleep(3.0)  # let the utilisation counter see the loop
        before = query_gpus()
        apps_text = smi(
            "--query-compute-apps=pid,used_memory,process_name", "--format=csv,noheader,nounits"
        )
        text, seconds = run_gputaskman("--json")
        after = query_gpus()
        once, _ = run_gputaskman("--once")
        (args.out / "query-gpu.csv").write_text(
            json.dumps({"before": before, "after": after}, indent=1)
        )
        (args.out / "compute-apps.csv").write_text(apps_text)
        (args.out / "gputaskman.json").write_text(text)
        (args.out / "gputaskman-once.txt").write_text(once)
        try:
            doc = json.loads(text)
        except ValueError as err:
            checks.add("gputaskman --json parses", False, text[:300], "a JSON document", str(err))
            return 1
        checks.add(
            "gputaskman --json wall time (s)",
            None,
            round(seconds, 2),
            None,
            "one process start and sample",
        )
        compare(doc, before, after, csv_rows(apps_text), child.pid, ready, model, checks)
        health_checks(args.out, doc, checks)  # while the workload still runs
    finally:
        child.terminate()
        child.wait(timeout=30)
        log.close()
        (args.out / "report.json").write_text(json.dumps(checks.rows, indent=1))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
