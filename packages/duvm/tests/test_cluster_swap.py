"""The kernel swap path on a namespace cluster, with faults: a program whose pages the kernel
swapped to duvm keeps every byte when a memserver is killed (R=2), and two nodes swapping to
each other's memservers at the same time both finish (no deadlock), within a time bound.

Daemons run in node namespaces; the attach layer (nbdfuse + loop, or kernel nbd) and the
workload's memory cgroup are in the root namespace (the kernel is shared). Teardown detaches
swap, loop, FUSE, cgroups, processes and namespaces, also on failure. Root only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from duvm.base import cgroup, control_socket
from duvm.cli import demo
from duvm.node.attach import attach, attach_state, kernel_swap
from duvm.testing import netns_cluster

LIMIT_MIB, WORKLOAD_MIB = 48, 160


def _skip_reason() -> str | None:
    if (why := netns_cluster.skip_reason()) is not None:
        return why
    problems = demo.preflight()
    return "; ".join(problems) if problems else None


pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


def vmstat() -> dict[str, int]:
    return {
        k: int(v)
        for k, v in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    }


@pytest.fixture
def cluster():
    c = netns_cluster.Cluster(4)
    states: list[Path] = []
    c.states = states  # type: ignore[attr-defined]
    c.__enter__()
    try:
        yield c
    finally:
        # Swap off while the daemons and memservers still run (they hold the pages), also
        # when the test failed: closing the cluster first would leave a dead swap device.
        errors = []
        for st in states:
            try:
                attach.detach(st, force=True)
            except Exception as e:  # keep tearing down; report below
                errors.append(f"{st}: {e}")
        if not errors:
            c.close()
    # A swap device that could not be turned off keeps its daemon and memservers: killing
    # them would turn the kernel's pages on it into I/O errors for whoever owns them.
    assert not errors, f"swap still on; cluster {c.tag} left running: {errors}"
    assert c.namespaces_left() == []
    swaps = kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())
    assert not [e for e in swaps if str(c.dir) in e.filename]
    mounts = Path("/proc/mounts").read_text()
    assert str(c.dir) not in mounts


def attach_swap(c: netns_cluster.Cluster, sock: str, name: str) -> attach_state.Attachment:
    state = c.dir / f"{name}.state.json"
    c.states.append(state)  # type: ignore[attr-defined]
    run = c.dir / f"run-{name}"
    run.mkdir()
    # Highest priority: the workload's pages must go to this device, not to another swap
    # device that something else on the machine attached.
    # The workload runs in a memory cgroup, so the fallback is safe here (demo_method).
    method = demo.demo_method("auto")
    return attach.attach(sock, state, run_dir=run, method=method, priority=32767)


def start_workload(cg: cgroup.MemoryCgroup, seed: int) -> subprocess.Popen:
    return cg.popen(
        [
            sys.executable,
            "-m",
            "duvm.cli.workload",
            "--mib",
            str(WORKLOAD_MIB),
            "--seed",
            str(seed),
            "--hold",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
    )


def wait_filled(p: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    assert p.stderr is not None
    for line in p.stderr:
        if "filled" in line:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"workload did not fill (exit {p.poll()})")


def finish(p: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = p.communicate("go\n", timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}: {out[-500:]} {err[-1500:]}"
    res = json.loads(out.strip().splitlines()[-1])
    assert res["intact"] is True and res["bad_chunks"] == 0, res
    return res


def test_swap_survives_memserver_kill_r2(cluster) -> None:
    c = cluster
    for node in (2, 3, 4):
        c.memserver(node, "192M")
    sock = c.daemon(1, [2, 3, 4], "160M", replicas=2)
    attach_swap(c, sock, "a")
    before = vmstat()
    with cgroup.MemoryCgroup(LIMIT_MIB << 20, prefix="duvmt-swap") as cg:
        p = start_workload(cg, 11)
        try:
            wait_filled(p)
            h = control_socket.query(control_socket.default_path(sock))["store"]
            assert h["pages_written"] > 0  # the program's pages are on the memservers now
            victim = max(range(3), key=lambda i: h["peers"][i]["slabs"]) + 2
            c.kill9(victim)
            res = finish(p)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    after = vmstat()
    assert after["pswpout"] > before["pswpout"] and after["pswpin"] > before["pswpin"]
    h = control_socket.query(control_socket.default_path(sock))["store"]
    assert h["pages_lost_now"] == 0 and h["read_errors"] == 0
    assert h["replicas_dropped"] > 0 or h["failovers"] > 0
    assert res["chunks"] == WORKLOAD_MIB


def test_two_nodes_swapping_to_each_other_do_not_deadlock(cluster) -> None:
    c = cluster
    for node in (1, 2):
        c.memserver(node, "192M")
    sock_a = c.daemon(1, [2], "160M", replicas=1, name="da")
    sock_b = c.daemon(2, [1], "160M", replicas=1, name="db")
    attach_swap(c, sock_a, "a")
    attach_swap(c, sock_b, "b")
    t0 = time.monotonic()
    with (
        cgroup.MemoryCgroup(LIMIT_MIB << 20, prefix="duvmt-x1") as cg1,
        cgroup.MemoryCgroup(LIMIT_MIB << 20, prefix="duvmt-x2") as cg2,
    ):
        p1, p2 = start_workload(cg1, 21), start_workload(cg2, 22)
        try:
            wait_filled(p1)
            wait_filled(p2)
            finish(p1, timeout=300)
            finish(p2, timeout=300)
        finally:
            for p in (p1, p2):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert time.monotonic() - t0 < 600
    for sock in (sock_a, sock_b):
        h = control_socket.query(control_socket.default_path(sock))["store"]
        assert h["pages_stored"] > 0 and h["read_errors"] == 0  # both devices were used
