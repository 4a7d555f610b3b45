"""duvm end to end through its own pieces: memservers -> daemon -> attach -> kernel swap.

`duvm demo` as a user runs it (its --json result asserted), and enable/status/disable from the
command line with a workload holding 4x its cgroup limit. Asserted: every byte intact,
/proc/vmstat pswpout and pswpin grew, memservers held pages during the run, swapoff succeeded,
memservers back at 0 pages and 0 reserved after disable (discard and release reached them),
and nothing left behind — also when a test fails half-way (the fixture cleans up by state dir).
Root only; skipped with the reason elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.base import cgroup, ramfs
from duvm.cli import demo
from duvm.node.attach import attach, attach_fuse, attach_state, kernel_swap, processes
from duvm.node.lifecycle import control

LIMIT_MIB, WORKLOAD_MIB = 64, 256
PAGE = 4096
MIN_SWAP_PAGES = ((WORKLOAD_MIB - 2 * LIMIT_MIB) << 20) // PAGE


def _skip_reason() -> str | None:
    if importlib.util.find_spec("duvm.store.remote_store") is None:
        return (
            "the daemon's memserver-backed store (duvm.store.remote_store) is not in this tree yet"
        )
    problems = demo.preflight()
    return "; ".join(problems) if problems else None


pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
]


def duvm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "duvm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def vmstat() -> dict[str, int]:
    return {
        k: int(v)
        for k, v in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    }


def leftovers(state_dir: Path, pids: list[int], cgroups: list[str]) -> list[str]:
    left = []
    for bf in Path("/sys/block").glob("loop*/loop/backing_file"):
        if bf.read_text().startswith(str(state_dir)):
            left.append(f"loop device {bf.parent.parent.name}")
    for line in Path("/proc/mounts").read_text().splitlines():
        if line.split()[1].startswith(str(state_dir)):
            left.append(f"mount {line.split()[1]}")
    for e in kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text()):
        backing = Path("/sys/block", Path(e.filename).name, "loop", "backing_file")
        if backing.exists() and backing.read_text().startswith(str(state_dir)):
            left.append(f"swap {e.filename}")
    left += [f"cgroup {c}" for c in cgroups if Path(c).exists()]
    left += [f"process {p}" for p in pids if processes.pid_alive(p)]
    left += [
        f"state {p.name}"
        for p in (state_dir / "state.json", state_dir / "daemon.json")
        if p.exists()
    ]
    return left


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A short private state dir; whatever a failed test left enabled is disabled by force."""
    others = demo.competing_swaps()
    if others:  # e.g. another test run's device: the workload's pages would be shared with it
        pytest.skip(
            f"swap {others} is active at priority {demo.MAX_PRIORITY}: pages would not "
            "all go to this test's device"
        )
    blocking = cgroup.swap_headroom_problems()
    if blocking:  # another workload here: disable's swapoff safety check would refuse for it
        pytest.skip(
            "another memory cgroup on this machine has more in swap than room under "
            f"its limit, so disable would rightly refuse: {blocking[0]}"
        )
    path = Path(tempfile.mkdtemp(prefix="duvm-en-", dir="/tmp"))
    try:
        yield path
    finally:
        daemon = control.load_daemon(path) if (path / "daemon.json").exists() else None
        with contextlib.suppress(Exception):
            attach.detach(control.state_path(path), force=True)
        with contextlib.suppress(Exception):
            control.stop_daemon(path)
        if daemon is not None and processes.pid_alive(daemon.pid):
            os.kill(daemon.pid, signal.SIGKILL)
        ds = control.daemon_state_dir(path)
        if ramfs.is_mount_point(ds):  # disable unmounts it; a failed test never got there
            with contextlib.suppress(Exception):
                ramfs.release(ds)
        shutil.rmtree(path, ignore_errors=True)


def _reap(state_dir: Path, pids: list[int]) -> None:
    """After a failed demo that left its device attached (so as to lose no page): detach by
    force, stop the daemon, then the memservers it left running."""
    with contextlib.suppress(Exception):
        attach.detach(control.state_path(state_dir), force=True)
    with contextlib.suppress(Exception):
        control.stop_daemon(state_dir)
    for pid in pids:
        with contextlib.suppress(OSError):
            if b"memserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


def test_demo_moves_pages_through_memservers_and_cleans_up(state_dir: Path) -> None:
    res = duvm(
        "demo",
        "--json",
        "--mib",
        str(WORKLOAD_MIB),
        "--limit-mib",
        str(LIMIT_MIB),
        "--state-dir",
        str(state_dir),
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["error"] is not None:
        _reap(state_dir, out["pids"])
    assert out["error"] is None, out["error"]
    assert res.returncode == 0, res.stderr[-2000:]
    assert out["intact"] is True
    assert out["workload"]["chunks"] == WORKLOAD_MIB and out["workload"]["bad_chunks"] == 0
    assert out["pswpout"] >= MIN_SWAP_PAGES and out["pswpin"] >= MIN_SWAP_PAGES
    peaks = out["peak_pages"]
    assert len(peaks) == 3
    # the pages were in memserver RAM, two copies of each (the default with 3 memservers)
    assert out["replicas"] == 2
    assert sum(peaks.values()) >= 2 * MIN_SWAP_PAGES, peaks
    # what moved where, from each memserver's own counters: out to every one, and back in
    assert set(out["stored_pages"]) == set(peaks) and all(out["stored_pages"].values())
    assert sum(out["stored_pages"].values()) >= MIN_SWAP_PAGES, out["stored_pages"]
    assert sum(out["loaded_pages"].values()) > 0, out["loaded_pages"]
    assert out["authenticated"] is True  # the demo's memservers required its temporary secret
    assert not (state_dir / "demo.secret").exists()
    assert out["swapoff_ok"] is True
    assert set(out["pages_after_disable"].values()) == {0}, out["pages_after_disable"]
    assert set(out["reserved_after_disable"].values()) == {0}
    assert len(out["pids"]) >= 4  # 3 memservers, the daemon (and nbdfuse on this path)
    assert leftovers(state_dir, out["pids"], [out["cgroup"]]) == []


def test_enable_status_disable_from_the_command_line(state_dir: Path) -> None:
    """Two copies of each page (the default with 2 or more peers) on memservers that require
    the cluster secret."""
    secret = state_dir / "cluster.secret"
    assert duvm("secret", "generate", str(secret)).returncode == 0
    servers = demo.Memservers(3, 144 << 20, secret)
    cgroups: list[str] = []
    pids = list(servers.pids)
    try:
        peers = ",".join(servers.addrs)
        size = 192 << 20
        # without the secret the daemon cannot reserve: enable fails cleanly and says why
        # the workload runs in a memory cgroup: the fallback is safe here (demo_method)
        method = ("--method", demo.demo_method("auto"))
        res = duvm(
            "enable", *method, "--peers", peers, "--size", "192M", "--state-dir", str(state_dir)
        )
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert "secret" in res.stderr.lower(), res.stderr
        assert not (state_dir / "daemon.json").exists()
        enable = (
            "enable",
            *method,
            "--peers",
            peers,
            "--size",
            "192M",
            "--secret-file",
            str(secret),
            "--state-dir",
            str(state_dir),
            "--priority",
            str(demo.MAX_PRIORITY),
        )  # ahead of any other swap here
        res = duvm(*enable)
        assert res.returncode == 0, res.stderr
        assert "2 copies of each page" in res.stdout
        warnings = [line for line in res.stderr.splitlines() if "warning" in line]
        if "via nbdfuse-loop" in res.stdout:
            # the fallback says it is not for nodes that run out of memory (and, on cgroup
            # v1, that nbdfuse can be swapped out), and nothing else
            assert len(warnings) == 1 and attach_fuse.FALLBACK_UNDER_PRESSURE in warnings[0]
            swappable = "nbdfuse can be swapped out" in warnings[0]
            assert swappable == (cgroup.detect_version() != 2)
        else:
            assert warnings == []
        # the daemon's state is on a ramfs of its own: a restarted daemon can read it back
        # even when everything else on /run was swapped out to this device (duvm.base.ramfs)
        ds = control.daemon_state_dir(state_dir)
        assert ramfs.is_mount_point(ds) and ramfs.filesystem_of(ds) == "ramfs"
        assert (ds / "daemon-state.json").exists()
        again = duvm(*enable)
        assert again.returncode == 1 and "already enabled" in again.stderr

        st = json.loads(duvm("status", "--json", "--state-dir", str(state_dir)).stdout)
        assert st["enabled"] is True and st["swap"]["size_bytes"] > 0
        assert st["device"] and st["method"] in (
            attach_state.METHOD_FUSE,
            attach_state.METHOD_KERNEL,
        )
        # status authenticates to the peers as the daemon does (they refuse anyone else)
        assert [p["health"] for p in st["peers"]] == ["ok"] * 3, st["peers"]
        assert st["daemon"]["replicas"] == 2 and st["replication"]["replicas"] == 2
        # enable told the daemon its swap device: gputaskman labels swapped bytes the pool's
        assert st["daemon"]["swap_device"] == st["device"], st["daemon"]
        # reserve before exposing: every page of the device reserved twice across the peers
        assert sum(p["our_reserved_pages"] for p in st["peers"]) >= 2 * size // PAGE
        pids += [st["daemon"]["pid"]]
        att = attach_state.load_state(control.state_path(state_dir))
        assert att is not None
        pids += [p for p in (att.nbdfuse_pid, att.holder_pid) if p]
        # what serves the swap device runs realtime by default (duvm.base.pressure): the daemon,
        # and nbdfuse on the fallback path, from its first instruction
        for pid in (st["daemon"]["pid"], att.nbdfuse_pid):
            if pid:
                assert os.sched_getscheduler(pid) == os.SCHED_RR, pid

        before = vmstat()
        with cgroup.MemoryCgroup(LIMIT_MIB << 20, prefix="duvm-test") as cg:
            cgroups.append(str(cg.path))
            proc = cg.popen(
                [sys.executable, "-m", "duvm.cli.workload", "--mib", "160", "--hold"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert proc.stderr is not None and proc.stderr.readline().strip() == "filled"
            held = json.loads(duvm("status", "--json", "--state-dir", str(state_dir)).stdout)
            ours = sum(p["our_pages"] for p in held["peers"])
            # two copies of every swapped page
            assert ours >= 2 * (((160 - 2 * LIMIT_MIB) << 20) // PAGE), held["peers"]
            assert held["replication"]["degraded_slabs"] == 0
            assert held["swap"]["used_bytes"] > 0

            # disable now would need RAM the workload's cgroup does not have: refused, intact
            refused = duvm("disable", "--state-dir", str(state_dir))
            assert refused.returncode == 3, refused.stderr
            assert "stays attached" in refused.stderr and cg.name in refused.stderr
            assert (
                json.loads(duvm("status", "--json", "--state-dir", str(state_dir)).stdout)[
                    "enabled"
                ]
                is True
            )

            out, err = proc.communicate("go\n", timeout=300)
            assert proc.returncode == 0, err[-2000:]
            assert json.loads(out.splitlines()[-1])["intact"] is True
        after = vmstat()
        assert after["pswpout"] - before["pswpout"] >= ((160 - 2 * LIMIT_MIB) << 20) // PAGE
        assert after["pswpin"] - before["pswpin"] > 0

        res = duvm("disable", "--state-dir", str(state_dir))
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 15
        while True:
            peers_after = control.peer_statuses(
                servers.addrs,
                security=control.peer_security(["--secret-file", str(secret)], servers.addrs),
            )
            if (
                all(p["pages"] == 0 and p["reserved_pages"] == 0 for p in peers_after)
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.2)
        assert [(p["pages"], p["reserved_pages"]) for p in peers_after] == [(0, 0)] * 3
        st = json.loads(duvm("status", "--json", "--state-dir", str(state_dir)).stdout)
        assert st["enabled"] is False and st["daemon"] is None
    finally:
        servers.close()
    assert leftovers(state_dir, pids, cgroups) == []


def test_enable_fails_cleanly_when_a_peer_is_unreachable(state_dir: Path) -> None:
    servers = demo.Memservers(1, 32 << 20)
    try:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        s.close()
        res = duvm(
            "enable",
            "--method",
            demo.demo_method("auto"),
            "--peers",
            f"{servers.addrs[0]},{dead}",
            "--size",
            "16M",
            "--state-dir",
            str(state_dir),
        )
        assert res.returncode == 1
        assert "daemon" in res.stderr and res.stderr.count("\n") <= 20, res.stderr
        assert "Traceback" not in res.stderr
        (st,) = control.peer_statuses(servers.addrs)
        assert st["reserved_pages"] == 0, "nothing stays reserved after a failed enable"
    finally:
        servers.close()
    assert leftovers(state_dir, servers.pids, []) == []


def _cmdlines() -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                out.append(p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def test_demo_interrupted_midway_leaves_nothing_behind(state_dir: Path) -> None:
    """SIGTERM while the workload holds swapped pages: the demo still tears everything down."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "duvm.cli",
            "demo",
            "--mib",
            str(WORKLOAD_MIB),
            "--limit-mib",
            str(LIMIT_MIB),
            "--state-dir",
            str(state_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ports: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith("    127.0.0.1:"):
                ports = [a.strip() for a in line.split(",")]
            if "fill" in line and "swap used" in line and " 0%" not in line:
                break  # pages are on their way to the memservers now
        assert (
            len(ports) == 3 and attach_state.load_state(control.state_path(state_dir)) is not None
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    parent = cgroup.MemoryCgroup(1 << 20).parent
    demo_groups = [str(p) for p in parent.glob(f"duvm-demo-{proc.pid}-*")]
    assert demo_groups == []
    assert leftovers(state_dir, [], []) == []
    running = [
        c
        for c in _cmdlines()
        if str(state_dir) in c or ("memserver" in c and any(p in c for p in ports))
    ]
    assert running == []
