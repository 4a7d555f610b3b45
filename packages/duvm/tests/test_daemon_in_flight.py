"""What a daemon holds while a memserver lags: a real daemon (two copies, encrypted) and two
real memservers on loopback, one of them SIGSTOPped while fio's nbd engine keeps 64 writes of
256 KiB in flight. The daemon may let in only `nbdserver.MAX_IN_FLIGHT_BYTES` (4 MiB) of payload
before it stops reading (the rest waits in the client's socket): on a node short of memory
every byte it takes beyond that is a fresh page from reclaim, which waits on the daemon."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from test_daemon import Procs, need, procs  # noqa: F401 - the fixture

MiB = 1 << 20


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_lagging_memserver_holds_the_daemon_to_its_in_flight_cap(procs: Procs) -> None:  # noqa: F811
    """Catches a daemon that keeps reading requests while a memserver lags (its in-flight cap
    raised or ignored): each write it lets in holds its payload and its sealed copy, and with
    64 MiB allowed this load took 32.9 MiB of fresh memory, against about 8.5 with 4 MiB. Every
    write is then acknowledged once the memserver answers again."""
    need("fio")
    lagging, port_a = procs.memserver("160M")
    _, port_b = procs.memserver("160M")
    daemon, sock = procs.daemon(
        [port_a, port_b], "128M", "test-in-flight", replicas=2, extra=("--encrypt",)
    )
    fio = [
        "fio",
        "--name=lag",
        "--ioengine=nbd",
        f"--uri=nbd+unix:///?socket={sock}",
        "--size=128M",
        "--bs=256k",
        "--output-format=terse",
    ]
    # every slab placed and every buffer class made once, so what follows is the backlog alone
    subprocess.run([*fio, "--rw=write", "--iodepth=64"], check=True, capture_output=True)
    base = _rss_kib(daemon.pid)
    lagging.send_signal(signal.SIGSTOP)
    resume = threading.Timer(4.0, lagging.send_signal, [signal.SIGCONT])
    resume.start()
    try:
        run = subprocess.Popen(
            [*fio, "--rw=randwrite", "--iodepth=64", "--runtime=6", "--time_based"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        peak = base
        while run.poll() is None:
            peak = max(peak, _rss_kib(daemon.pid))
            time.sleep(0.05)
        out, err = run.communicate()
    finally:
        resume.cancel()
        lagging.send_signal(signal.SIGCONT)
    assert run.returncode == 0, out[-1000:] + err
    grew_mib = (peak - base) / 1024
    # payloads and sealed copies of 4 MiB of writes, and slack for the rest of the daemon
    assert grew_mib < 16, f"the daemon grew by {grew_mib:.1f} MiB"
    assert daemon.poll() is None
