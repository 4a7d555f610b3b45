"""Faults on a real 4-node cluster (network namespaces, veth, bridge) under a verifying NBD
workload (libnbd, many requests in flight): kill -9 a memserver, cut a link and restore it, slow
a link with tbf, restart a memserver, R=1 loss, and a pool too small for the export.

With R=2 every byte must come back intact and no request may fail; with R=1 a lost memserver
shows as I/O errors, never as other bytes. Each test also checks the mechanism through the
daemon's control socket (replicas dropped, stalls aborted, repairs done) and, in teardown, that
no namespace or process is left. Root only; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from duvm.base import control_socket
from duvm.node.lifecycle import control
from duvm.testing import netns_cluster

SYS_PY = "/usr/bin/python3"
WORKLOAD = str(Path(__file__).parents[1] / "src" / "duvm" / "testing" / "nbd_workload.py")


def _skip_reason() -> str | None:
    if (why := netns_cluster.skip_reason()) is not None:
        return why
    r = subprocess.run([SYS_PY, "-c", "import nbd"], capture_output=True)
    if r.returncode:
        return "python3-libnbd missing in the system Python (apt: python3-libnbd)"
    return None


pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


@pytest.fixture
def cluster():
    c = netns_cluster.Cluster(4)
    with c:
        yield c
    assert c.namespaces_left() == []  # teardown removed every namespace (and so every veth)
    assert all(p.poll() is not None for p in c.procs.values())


def workload(sock: str, seconds: float, **kw) -> subprocess.Popen:
    args = [SYS_PY, WORKLOAD, f"nbd+unix:///?socket={sock}", "--seconds", str(seconds)]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(
    p: subprocess.Popen, timeout: float = 240, c: netns_cluster.Cluster | None = None
) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hang: say what the daemon saw, for the next reader
        p.kill()
        p.communicate()
        why = f"workload still running after {timeout} s"
        if c is not None:
            try:
                why += f"; daemon health: {health(str(c.dir / 'daemon.sock'))}"
            except Exception as e:  # diagnostics only: never hide the hang itself
                why += f"; daemon health unavailable: {e}"
            why += f"; daemon log tail: {c.log('daemon')[-4000:]}"
        raise AssertionError(why) from None
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    res["stderr"] = err[-2000:]
    return res


def health(sock: str) -> dict:
    return control_socket.query(control_socket.default_path(sock))["store"]


def wait_health(sock: str, cond, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(sock)
        if cond(h):
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"health condition not reached: {h}")
        time.sleep(0.2)


def start(
    c: netns_cluster.Cluster, replicas: int = 2, size: str = "24M", capacity: str = "40M"
) -> str:
    for node in (2, 3, 4):
        c.memserver(node, capacity)
    return c.daemon(1, [2, 3, 4], size, replicas=replicas)


def assert_intact(res: dict) -> None:
    assert res["mismatches"] == 0, res
    assert res["read_eio"] == 0 and res["write_eio"] == 0, res
    assert res["verified_pages"] > 0 and res["pages_written"] > 0, res


def test_kill9_memserver_during_io_r2_loses_nothing_and_repairs(cluster) -> None:
    sock = start(cluster)
    w = workload(sock, 12)
    time.sleep(3)
    cluster.kill9(2)
    res = result(w, c=cluster)
    assert_intact(res)
    h = wait_health(sock, lambda h: h["degraded_slabs"] == 0)
    assert h["replicas_dropped"] > 0 and h["repairs_done"] > 0
    assert h["peers"][0]["slabs"] == 0 and h["peers"][0]["connected"] is False
    assert h["pages_lost_now"] == 0
    # `duvm status` reads the same through the control socket
    info = control.DaemonInfo(cluster.procs["daemon"].pid, sock, [], 24 << 20, 2, "", 0.0)
    shown = control.daemon_health(info)
    assert shown is not None and shown["repairs_done"] == h["repairs_done"]
    st = {
        "enabled": False,
        "device": None,
        "swap": None,
        "daemon": None,
        "peers": [],
        "replication": shown,
    }
    assert "0 of 24 slabs degraded" in control.format_status(st)


def test_link_down_and_up_r2(cluster) -> None:
    sock = start(cluster)
    w = workload(sock, 16)
    time.sleep(3)
    cluster.link(3, up=False)
    time.sleep(8)  # longer than the daemon's stall timeout (5 s)
    cluster.link(3, up=True)
    res = result(w, c=cluster)
    assert_intact(res)
    h = wait_health(sock, lambda h: h["degraded_slabs"] == 0)
    assert h["stalls_aborted"] + h["failovers"] > 0 and h["replicas_dropped"] > 0
    assert h["peers"][1]["breaker_trips"] > 0


def test_slow_link_r2_still_intact(cluster) -> None:
    sock = start(cluster)
    w = workload(sock, 12)
    time.sleep(2)
    cluster.slow(4)
    time.sleep(6)
    cluster.unslow(4)
    res = result(w, c=cluster)
    assert_intact(res)
    wait_health(sock, lambda h: h["degraded_slabs"] == 0)


def test_memserver_restart_r2_is_repaired_from_the_replica(cluster) -> None:
    sock = start(cluster)
    w = workload(sock, 14)
    time.sleep(3)
    cluster.kill9(3)
    time.sleep(1)
    cluster.memserver(3, "40M")  # back, empty
    res = result(w, c=cluster)
    assert_intact(res)
    h = wait_health(sock, lambda h: h["degraded_slabs"] == 0)
    assert h["replicas_dropped"] > 0 and h["repairs_done"] > 0


def test_r1_loss_is_an_io_error_never_other_bytes(cluster) -> None:
    sock = start(cluster, replicas=1, size="24M")
    w = workload(sock, 8)
    time.sleep(3)
    cluster.kill9(2)
    time.sleep(0.5)
    cluster.memserver(2, "40M")  # restarted empty: its pages are gone
    res = result(w, c=cluster)
    assert res["mismatches"] == 0, res
    assert res["read_eio"] > 0 and res["lost_pages"] > 0, res  # the loss is visible
    h = health(sock)
    assert h["peers"][0]["namespace_losses"] == 1 or h["peers"][0]["connected"] is False


def test_full_pool_refuses_instead_of_growing(cluster) -> None:
    for node in (2, 3):
        cluster.memserver(node, "16M")
    with pytest.raises(RuntimeError, match="cannot hold"):
        cluster.daemon(1, [2, 3], "24M", replicas=2)  # 48 MiB of copies, 32 MiB of pool
    assert not os.path.exists(cluster.dir / "daemon.sock")
    # Nothing stayed reserved: an export needing exactly the whole pool still fits.
    sock = cluster.daemon(1, [2, 3], "16M", replicas=2, name="fits")
    assert health(sock)["degraded_slabs"] == 0
