"""Cost of ``gputaskman fleet --prometheus``: 2,000 simulated hosts' series in a real
Prometheus, the fleet read from it at 1 Hz.

A child process plays the hosts: one loopback HTTP server answering ``/metrics?host=N`` with
what ``gputaskman serve`` exports (`render.exporter`'s families in Prometheus's text format)
for the recorded snapshots of tests/recordings (the demo and a DRM fixture tree: synthetic
GPU numbers), host N at each scrape the next recorded line, stamped with the time of the
scrape as a new sample (as a serve sampling every second is). A real ``prometheus``
(Debian's, on loopback, its own data directory) scrapes the 2,000 as the job ``gputaskman``
(one target each, told apart by their ``instance`` label), every `--scrape-interval`
seconds (15 by default, a common setting).

Once every host is up in Prometheus, this process measures:

* **first screen**: from a new `PromFleet` to the fleet's rows built (`view.fleet_rows`)
  after its first round, which reads every host's series (median of `--first-runs`);
* **1 Hz**: a `PromFleet` refreshing every second (each round reads the series of only the
  hosts whose sample changed) and, every second, the rows and totals the fleet table is made
  of, for `--seconds`: the refresh thread's CPU, the rows' and totals' (this thread's), the
  whole process's, rounds per second and hosts read per second. The table's drawing is not
  here: it draws only the rows on screen (`gtm_tui_cost.py --fleet` measures that);
* Prometheus's own CPU (share of one core over the same window) and resident memory, and
  the simulated hosts' CPU, beside it.

Run: ``uv run python benchmarks/gtm_fleet_prometheus.py [--hosts 2000] [--seconds 60]
[--scrape-interval 15]``. Needs ``prometheus`` (``apt install prometheus``). Numbers depend
on the machine and on what else runs; report them with that caveat.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDINGS = ROOT / "packages" / "gputaskman" / "tests" / "recordings"
STAMP = b"gputaskman_sample_timestamp_seconds "


def _expositions() -> list[bytes]:
    """Each recorded snapshot as serve's /metrics text (its sample time a placeholder)."""
    from gputaskman.document.reader import read_document
    from gputaskman.render.exporter import Cached, snapshot_families
    from prometheus_client import CollectorRegistry, generate_latest

    out = []
    for name in ("demo.jsonl", "drm.jsonl"):
        for line in (RECORDINGS / name).read_bytes().splitlines():
            if not line.strip():
                continue
            snap = read_document(line).snapshot()

            class _One:
                def collect(self, snap=snap):
                    return snapshot_families(Cached(snap, None, snap.taken, 0.01), snap.taken)

            reg = CollectorRegistry(auto_describe=False)
            reg.register(_One())
            text = generate_latest(reg)
            lines = [b"%TAKEN%" if ln.startswith(STAMP) else ln for ln in text.split(b"\n")]
            out.append(b"\n".join(lines))
    return out


def run_hosts(port_out: multiprocessing.Queue) -> None:  # the child process
    texts = _expositions()
    scrapes: dict[str, int] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode()
                host = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query).get("host")
                n = int(host[0]) if host else 0
                key = str(n)
                i = scrapes[key] = scrapes.get(key, n) + 1
                body = texts[i % len(texts)].replace(b"%TAKEN%", STAMP + repr(time.time()).encode())
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        port_out.put(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def proc_cpu(pid: int | str, task: int | None = None) -> float:
    """User+system seconds of a process (or one of its threads)."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(url: str, expr: str) -> list:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=30) as r:
        return json.loads(r.read())["data"]["result"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--scrape-interval", type=int, default=15)
    p.add_argument("--first-runs", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("needs prometheus (apt install prometheus)", file=sys.stderr)
        return 2

    from gputaskman.fleet.promapi import PromClient
    from gputaskman.fleet.promfleet import PromFleet
    from gputaskman.fleet.view import ViewCache, fleet_rows, fleet_totals

    q: multiprocessing.Queue = multiprocessing.Queue()
    hosts_proc = multiprocessing.Process(target=run_hosts, args=(q,), daemon=True)
    hosts_proc.start()
    port = q.get(timeout=60)
    tmp = Path(tempfile.mkdtemp(prefix="gtm-prom-bench-"))
    prom_port = free_port()
    url = f"http://127.0.0.1:{prom_port}"
    configs = "".join(
        f"      - targets: ['127.0.0.1:{port}']\n"
        f"        labels: {{instance: 'gpu-{i:04d}:9835', __param_host: '{i}'}}\n"
        for i in range(args.hosts)
    )
    (tmp / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: {args.scrape_interval}s\n"
        f"  scrape_timeout: {min(10, args.scrape_interval)}s\n"
        f"scrape_configs:\n  - job_name: gputaskman\n    static_configs:\n{configs}"
    )
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    results: dict = {"hosts": args.hosts, "scrape_interval_s": args.scrape_interval}
    try:
        deadline = time.monotonic() + 10 * args.scrape_interval + 60
        up = 0
        while time.monotonic() < deadline:
            try:
                got = _query(url, 'count(up{job="gputaskman"} == 1)')
                up = int(float(got[0]["value"][1])) if got else 0
            except OSError:
                up = 0
            if up >= args.hosts:
                break
            if prom.poll() is not None:
                print((tmp / "prometheus.log").read_text()[-2000:], file=sys.stderr)
                return 1
            time.sleep(1)
        print(f"{up}/{args.hosts} hosts up in Prometheus", file=sys.stderr)
        if up < args.hosts:
            return 1
        series = _query(url, 'count({__name__=~"gputaskman_.+",job="gputaskman"})')
        results["series"] = int(float(series[0]["value"][1]))

        firsts = []
        for _ in range(args.first_runs):
            t0 = time.perf_counter()
            fleet = PromFleet(PromClient(url, timeout=30), interval=1.0, table_only=True)
            fleet.refresh()
            rows = fleet_rows(fleet.states())
            firsts.append(time.perf_counter() - t0)
            assert fleet.error is None, fleet.error
            fleet.client.close()
        results["first_screen_s"] = statistics.median(firsts)
        results["first_screen_all_s"] = firsts
        results["rows"] = len(rows)

        fleet = PromFleet(PromClient(url, timeout=30), interval=1.0, table_only=True)
        fleet.refresh()
        fleet.start()
        time.sleep(2)
        tid = fleet.thread_id
        me = os.getpid()
        c_thread, c_proc = proc_cpu(me, tid), proc_cpu(me)
        c_prom, c_hosts = proc_cpu(prom.pid), proc_cpu(hosts_proc.pid)
        rounds, seqs = fleet.version, sum(s.seq for s in fleet.states())
        t0 = time.monotonic()
        rss = []
        cache = ViewCache()  # as the fleet table keeps one
        table_cpu = 0.0
        while time.monotonic() - t0 < args.seconds:
            time.sleep(1.0)
            started = time.thread_time()
            states = fleet.states()
            fleet_rows(states, cache=cache)
            fleet_totals(states, cache)
            table_cpu += time.thread_time() - started
            rss.append(rss_mib(prom.pid))
        wall = time.monotonic() - t0
        results.update(
            {
                "seconds": wall,
                "fleet_thread_core_pct": 100 * (proc_cpu(me, tid) - c_thread) / wall,
                "fleet_process_core_pct": 100 * (proc_cpu(me) - c_proc) / wall,
                "table_rows_and_totals_core_pct": 100 * table_cpu / wall,
                "rounds_per_s": (fleet.version - rounds) / wall,
                "hosts_read_per_s": (sum(s.seq for s in fleet.states()) - seqs) / wall,
                "prometheus_core_pct": 100 * (proc_cpu(prom.pid) - c_prom) / wall,
                "prometheus_rss_mib": max(rss),
                "hosts_sim_core_pct": 100 * (proc_cpu(hosts_proc.pid) - c_hosts) / wall,
                "errors": fleet.error,
            }
        )
        fleet.stop()
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
        log.close()
        hosts_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in results.items():
        print(f"{k:24} {v:.3f}" if isinstance(v, float) else f"{k:24} {v}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
