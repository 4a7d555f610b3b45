"""gputaskman showing the duvm pool: real duvm memservers and a real daemon on loopback, read
through their local status sockets by `gputaskman --json`, `--once` and the TUI.

gputaskman does not import duvm; these tests start duvm's processes as a user would (the
workspace installs both packages) and write pages through a real NBD client (qemu-io).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gputaskman.base.readings import Reading
from gputaskman.render.report import null_rule_violations
from gputaskman.sampling import duvmpool, host, procfacts
from gputaskman.sampling.host import SwapDevice, SwapInfo
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("duvm") is None, reason="duvm is not installed in this environment"
)
PAGE = 4096


def _start(args: list[str], ready: str, log: Path) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "duvm.cli", *args],
        stdout=f,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc._log = f  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise AssertionError(f"duvm {args[0]} did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    proc._log.close()  # type: ignore[attr-defined]


class Pool:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.memservers: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.daemon: subprocess.Popen | None = None
        self.nbd = str(tmp / "nbd.sock")
        self.ctl = self.nbd + ".ctl"
        self.ms_ctl: list[str] = []

    def memserver(self) -> None:
        i = len(self.memservers)
        log = self.tmp / f"ms{i}.log"
        ctl = str(self.tmp / f"ms{i}.ctl")
        p = _start(
            [
                "memserver",
                "--listen",
                "127.0.0.1:0",
                "--capacity",
                "32M",
                "--no-mlock",
                "--control-socket",
                ctl,
            ],
            "listening on",
            log,
        )
        self.memservers.append(p)
        self.ports.append(int(log.read_text().split("listening on 127.0.0.1:")[1].split()[0]))
        self.ms_ctl.append(ctl)

    def start_daemon(self, replicas: int) -> None:
        peers = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.daemon = _start(
            [
                "daemon",
                "--peers",
                peers,
                "--size",
                "8M",
                "--socket",
                self.nbd,
                "--replicas",
                str(replicas),
                "--no-mlock",
                "--client-id",
                "node-a",
            ],
            "serving export",
            self.tmp / "daemon.log",
        )

    def write(self, offset: int, length: int, pattern: int = 7) -> None:
        r = subprocess.run(
            [
                "qemu-io",
                "-f",
                "raw",
                "-c",
                f"write -P {pattern} {offset} {length}",
                f"nbd+unix:///?socket={self.nbd}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr + r.stdout

    def close(self) -> None:
        if self.daemon is not None:
            _stop(self.daemon)
        for p in self.memservers:
            _stop(p)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io (qemu-utils) is not installed")
    p = Pool(tmp_path)
    try:
        yield p
    finally:
        p.close()
    # clean side effects: every process gone, sockets removed by their owners
    assert all(m.poll() is not None for m in p.memservers)
    assert not os.path.exists(p.nbd)


def _gtm(args: list[str], sockets: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, duvmpool.ENV: ":".join(sockets)}
    r = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return r


def test_gtm_json_and_once_show_pages_per_peer_and_what_a_memserver_lends(pool: Pool):
    pool.memserver()
    pool.memserver()
    pool.start_daemon(replicas=2)
    pool.write(0, 1 << 20)  # 256 pages, one slab, a copy on each memserver
    pool.write(4 << 20, 64 << 10)  # 16 more pages in another slab
    socks = [pool.ctl, *pool.ms_ctl]
    doc = json.loads(_gtm(["--json"], socks).stdout)
    assert null_rule_violations(doc) == []
    duvm = doc["system"]["duvm"]
    assert duvm["kind"] == "runtime" and duvm["errors"] == {}
    (d,) = duvm["daemons"]
    assert d["socket"] == pool.ctl and d["health"] == "ok" and d["reasons"] == []
    assert d["pid"] == pool.daemon.pid
    assert d["pages_written"]["value"] == 272 and d["pages_written"]["kind"] == "runtime"
    peers = {p["peer"]: p for p in d["peers"]}
    assert set(peers) == {f"127.0.0.1:{p}" for p in pool.ports}
    for p in peers.values():  # replicas 2 over 2 memservers: every page on both
        assert p["connected"] is True
        assert p["pages"]["value"] == 272
        assert p["pages"]["source"] == f"duvm daemon:{pool.ctl}"
        assert p["reserved_pages"]["value"] == 2048  # 8 MiB reserved on each
    # each memserver: what it lends and to whom (its own STATUS, via its control socket)
    lending = {m["socket"]: m for m in duvm["lending"]}
    assert set(lending) == set(pool.ms_ctl)
    for m in lending.values():
        (b,) = m["borrowers"]
        assert b["client_id"] == "node-a"
        assert b["stored_bytes"]["value"] == 272 * PAGE
        assert m["used_bytes"]["value"] == 272 * PAGE
        assert m["capacity_bytes"]["value"] == 32 << 20
    # the offline tools (replay, diff) read a document with system.duvm as they read others
    from gputaskman.document.reader import read_document
    from gputaskman.offline import diff, recorded

    recorded.snapshot_from_json(doc)
    assert diff.diff(read_document(doc), read_document(doc)) is not None
    text = _gtm(["--once"], socks).stdout
    assert "duvm  pool ok" in text
    for port in pool.ports:
        assert f"peer 127.0.0.1:{port}  up  our pages 272 pages (1.1 MiB)" in text
    assert text.count("to node-a  1.1 MiB stored, 8.0 MiB reserved") == 2


def test_lost_memserver_shows_as_degraded_pool(pool: Pool):
    pool.memserver()
    pool.memserver()
    pool.start_daemon(replicas=2)
    pool.write(0, 1 << 20)
    _stop(pool.memservers[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        pool.write(0, 1 << 20, pattern=9)  # the write drops the dead replica
        got = duvmpool.sample([pool.ctl])
        assert got.errors == {}
        d = got.daemons[0]
        if d.health != "ok":
            break
        assert time.monotonic() < deadline, "the daemon never noticed the dead memserver"
        time.sleep(0.2)
    assert d.health in ("degraded", "failing")
    assert any("slab" in r or "not connected" in r for r in d.reasons)
    dead = next(p for p in d.peers if p.peer == f"127.0.0.1:{pool.ports[1]}")
    live = next(p for p in d.peers if p.peer == f"127.0.0.1:{pool.ports[0]}")
    assert live.pages.value == 256
    assert dead.pages.value == 0  # its slab replica was dropped: no pages of ours there


async def test_tui_system_panel_shows_the_pool(pool: Pool, monkeypatch):
    from gputaskman.tui.app import create_app
    from gputaskman.tui.widgets.system_panel import SystemPanel

    pool.memserver()
    pool.start_daemon(replicas=1)
    pool.write(0, 64 << 10)
    monkeypatch.setenv(duvmpool.ENV, pool.ctl)
    app = create_app(interval=60.0)  # the real collector and host sampler
    async with app.run_test(size=(160, 60)) as pilot:
        for _ in range(400):
            await pilot.pause(0.02)
            if app.samples:
                break
        text = str(app.query_one(SystemPanel).render())
    assert "duvm  pool ok" in text
    assert f"peer 127.0.0.1:{pool.ports[0]}  up  our pages 16 pages" in text


# --------------------------------------------------------------------- where swapped bytes are


def _swaps(*names: str) -> SwapInfo:
    r = Reading.measured(0, "/proc/meminfo")
    return SwapInfo(r, r, r, tuple(SwapDevice(n, "partition", 1 << 20, 0, -2) for n in names))


def test_a_real_daemon_told_its_swap_device_makes_swapped_bytes_the_pools(tmp_path: Path):
    """End to end with a real `duvm daemon` (local RAM) told its swap device through duvm's
    own client, as `duvm enable` tells it: gputaskman reads the device from the daemon's
    status and labels swapped bytes "pool" only when /proc/swaps' only active device is that
    one. This machine's /proc/swaps is used where it lists exactly one device; otherwise
    (none here, usually) the swap info is a constructed `host.SwapInfo`. Catches a daemon
    that never names its device (the label could never be "pool") and a label given although
    another device is active or the only one is not the daemon's."""
    control_socket = pytest.importorskip("duvm.base.control_socket")
    nbd = str(tmp_path / "nbd.sock")
    ctl = nbd + ".ctl"
    daemon = _start(
        [
            "daemon",
            "--memory",
            "--size",
            "4M",
            "--socket",
            nbd,
            "--no-mlock",
            "--no-realtime",
            "--no-io-flusher",
        ],
        "serving export",
        tmp_path / "daemon.log",
    )
    try:
        before = duvmpool.sample([ctl])
        assert before.errors == {} and before.daemons[0].swap_device is None
        held, why = procfacts.swap_holder(_swaps("/dev/nbd0"), before)
        assert held == "swap" and "does not name its swap device" in why, why

        real = host.HostSampler(duvm=False).sample([os.getpid()]).swap
        ours = real.devices[0].filename if real.devices and len(real.devices) == 1 else None
        device = ours or "/dev/nbd0"
        control_socket.tell_swap_device(ctl, device)
        after = duvmpool.sample([ctl])
        (d,) = after.daemons
        assert after.errors == {} and d.swap_device == device and d.socket == ctl
        assert procfacts.swap_holder(_swaps(device), after) == (
            "pool",
            f"{device}, the only active swap device, is duvm's ({ctl})",
        )
        for other in (_swaps("/dev/sda2"), _swaps(device, "/swapfile"), _swaps()):
            assert procfacts.swap_holder(other, after)[0] == "swap", other.devices
        # this machine's own /proc/swaps: the pool's only where its one device is the told one
        assert procfacts.swap_holder(real, after)[0] == ("pool" if ours else "swap")

        # and through gputaskman's own process, as --json shows it
        doc = json.loads(_gtm(["--json"], [ctl]).stdout)
        (shown,) = doc["system"]["duvm"]["daemons"]
        assert shown["swap_device"] == device
    finally:
        _stop(daemon)
    assert daemon.returncode == 0 and not os.path.exists(ctl)


# --------------------------------------------------------------------------- without a pool


def test_missing_stale_and_garbage_sockets_are_reasons_not_numbers(tmp_path: Path):
    stale = str(tmp_path / "stale.ctl")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()  # the file stays, nothing listens
    garbage = str(tmp_path / "garbage.ctl")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(garbage)
    srv.listen()
    import threading

    def answer() -> None:
        c, _ = srv.accept()
        c.recv(100)
        c.sendall(b"this is not json\n")
        c.close()

    t = threading.Thread(target=answer)
    t.start()
    try:
        info = duvmpool.sample([str(tmp_path / "missing.ctl"), stale, garbage])
    finally:
        t.join(5)
        srv.close()
    assert info.daemons == () and info.lending == ()
    assert info.errors == {
        str(tmp_path / "missing.ctl"): "socket gone",
        stale: "nothing listening (stale socket)",
        garbage: info.errors[garbage],
    }
    assert "Expecting value" in info.errors[garbage]
    lines = duvmpool.pool_lines(info)
    assert lines[0].endswith("missing.ctl: n/a (socket gone)") and len(lines) == 3


def test_no_duvm_on_this_node_adds_nothing_to_the_text(tmp_path: Path):
    assert duvmpool.pool_lines(duvmpool.sample([])) == []
    assert duvmpool.discover({duvmpool.ENV: ""}) == ([], f"${duvmpool.ENV}")
    paths, where = duvmpool.discover({})
    assert where == duvmpool.DEFAULT_GLOB and all(p.startswith("/run/duvm/") for p in paths)


def test_owner_only_socket_read_by_another_user_is_permission_denied(tmp_path: Path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to read as another user")
    path = str(tmp_path / "root.ctl")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o600)
    srv.listen()
    os.chmod(tmp_path, 0o755)
    try:
        code = (
            "from gputaskman.sampling import duvmpool; "
            f"print(duvmpool.sample([{path!r}]).errors[{path!r}])"
        )
        r = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-c",
                code,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        srv.close()
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("permission denied")


# --------------------------------------------------------------------------- the parser

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "store",
                    "peers",
                    "peer",
                    "pages",
                    "role",
                    "capacity_pages",
                    "namespaces",
                    "client_id",
                    "stored_pages",
                    "nbd",
                    "error",
                    "connected",
                    "pid",
                    "degraded_slabs",
                    "pages_lost_now",
                ]
            )
            | st.text(max_size=6),
            kids,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_parse_status_fuzz_never_crashes_and_never_invents_zeros(obj):
    try:
        got = duvmpool.parse_status(obj, "/x.ctl")
    except ValueError:
        return
    doc = {
        "system": {
            "duvm": duvmpool.pool_json(
                duvmpool.PoolInfo(
                    (got,) if isinstance(got, duvmpool.DaemonPool) else (),
                    (got,) if isinstance(got, duvmpool.Lending) else (),
                )
            )
        }
    }
    assert null_rule_violations(json.loads(json.dumps(doc))) == []
    duvmpool.pool_lines(duvmpool.PoolInfo((got,) if isinstance(got, duvmpool.DaemonPool) else ()))


def test_parse_status_reads_fields_and_leaves_unknowns_unknown():
    d = duvmpool.parse_status(
        {
            "pid": 5,
            "size_bytes": 8 << 20,
            "store": {
                "replicas": 2,
                "degraded_slabs": 1,
                "peers": [
                    {"peer": "a:1", "connected": True, "pages": 10},
                    {"peer": "b:1", "connected": False},
                ],
            },
        },
        "/s.ctl",
    )
    assert isinstance(d, duvmpool.DaemonPool)
    assert d.health == "degraded" and d.reasons == (
        "not connected: b:1",
        "1 slab(s) below 2 replicas",
    )
    a, b = d.peers
    assert a.pages.value == 10 and a.pages.kind.value == "runtime"
    assert b.pages.value is None and b.pages.reason is not None  # unknown, not 0
    assert d.pages_written.value is None
    with pytest.raises(ValueError, match="refused: permission denied"):
        duvmpool.parse_status({"error": "permission denied"}, "/s.ctl")


# --------------------------------------------------------------------------- duvm enabled


def _enable_skip_reason() -> str | None:
    try:
        from duvm.cli import demo
    except ImportError as e:
        return f"duvm not importable: {e}"
    problems = demo.preflight()
    return "; ".join(problems) if problems else None


@pytest.mark.root
@pytest.mark.slow
def test_gtm_once_on_a_node_with_duvm_enabled_shows_where_its_pages_are(tmp_path: Path):
    """`duvm enable` (real kernel swap on the duvm device), a workload pushed into swap by its
    cgroup limit, then `gputaskman --once`: the swap device and this node's pages per peer."""
    why = _enable_skip_reason()
    if why:
        pytest.skip(why)
    import tempfile

    from duvm.base import cgroup
    from duvm.cli import demo
    from duvm.node.attach import attach, attach_state
    from duvm.node.lifecycle import control

    # Swap is machine-wide: with another device at the top priority, or another cgroup whose
    # swapped pages could not come home, this test could neither place nor free its pages.
    others = demo.competing_swaps()
    if others:
        pytest.skip(
            f"swap {others} is active at priority {demo.MAX_PRIORITY}: the workload's "
            "pages would be shared with it"
        )
    blocking = cgroup.swap_headroom_problems()
    if blocking:
        pytest.skip(f"another memory cgroup has more in swap than room: {blocking[0]}")
    state = Path(tempfile.mkdtemp(prefix="gtm-duvm-", dir="/tmp"))  # short: socket paths
    servers = demo.Memservers(2, 96 << 20)

    def duvm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "duvm.cli", *args, "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    try:
        res = duvm(
            "enable",
            "--method",  # the workload runs in a memory cgroup: the fallback is safe here
            demo.demo_method("auto"),
            "--peers",
            ",".join(servers.addrs),
            "--size",
            "128M",
            "--replicas",
            "1",
            "--priority",
            str(demo.MAX_PRIORITY),
        )
        assert res.returncode == 0, res.stderr
        att = attach_state.load_state(control.state_path(state))
        assert att is not None and att.device
        ctl = str(state / "nbd.sock.ctl")
        with cgroup.MemoryCgroup(48 << 20, prefix="gtm-duvm") as cg:
            proc = cg.popen(
                [sys.executable, "-m", "duvm.cli.workload", "--mib", "112", "--hold"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert proc.stderr is not None
                line = proc.stderr.readline().strip()
                if line != "filled":
                    proc.wait(60)
                    raise AssertionError(
                        f"workload did not fill (exit {proc.returncode}, "
                        f"{cg.name}): {line} {proc.stderr.read()[-1500:]}"
                    )
                text = _gtm(["--once"], [ctl]).stdout
                doc = json.loads(_gtm(["--json"], [ctl]).stdout)
                out, err = proc.communicate("go\n", timeout=300)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            assert proc.returncode == 0, err[-2000:]
            assert json.loads(out.splitlines()[-1])["intact"] is True
        # the swap device the kernel uses is listed, and where its pages are
        assert att.device in text
        swap = next(d for d in doc["system"]["swap"]["devices"] if d["filename"] == att.device)
        used_pages = swap["used_bytes"]["value"] // PAGE
        assert used_pages > 0
        (d,) = doc["system"]["duvm"]["daemons"]
        assert d["health"] == "ok"
        assert d["swap_device"] == att.device  # `duvm enable` told the daemon its device
        pages = {p["peer"]: p["pages"]["value"] for p in d["peers"]}
        assert set(pages) == set(servers.addrs)
        # every page the kernel swapped out is somewhere in the pool (one replica each);
        # pages may have been written and not yet freed, never fewer than in use
        assert sum(pages.values()) >= used_pages * 0.9, (pages, used_pages)
        for addr in servers.addrs:  # --once ran a moment earlier: counts may differ a little
            m = re.search(rf"peer {re.escape(addr)}  up  our pages (\d+) pages", text)
            assert m is not None, text
        assert sum(int(n) for n in re.findall(r"our pages (\d+) pages", text)) > 0
        # Swap is machine-wide: another test's cgroup may have pages on our device for a
        # while, and disable rightly refuses (exit 3) until they can come home. Wait for it.
        deadline = time.monotonic() + 180
        while (res := duvm("disable")).returncode == 3 and time.monotonic() < deadline:
            time.sleep(2)
        assert res.returncode == 0, res.stderr
    finally:
        # Never stop the daemon or its memservers while the device is still swap: pages of
        # any process on this machine may be on it (swap is machine-wide), and they would be
        # lost. Detach (swapoff first) until it succeeds; if it never does, leave everything
        # running and say so.
        deadline, why = time.monotonic() + 300, ""
        while True:
            try:
                attach.detach(control.state_path(state))
                break
            except Exception as e:  # SwapoffFailed and friends: pages cannot come home yet
                why = str(e)
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"cannot detach {state} ({why}); the daemon and memservers "
                        f"{servers.pids} are left running so that no page is lost"
                    )
                time.sleep(2)
        control.stop_daemon(state)
        servers.close()
        shutil.rmtree(state, ignore_errors=True)
