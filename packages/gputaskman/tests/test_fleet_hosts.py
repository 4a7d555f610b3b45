"""Five real `gputaskman serve` instances on loopback, polled by the fleet: the DRM fixture
tree through ``--sysroot``, the demo, a replayed recording, one that expects a different
token, and one behind a proxy that holds its answers (a slow host). During the test one
instance is killed and restarted on its port.

What is checked: each host's row says what it is (up with its GPUs, refused, slow,
unreachable), never zeros; a slow or dead host delays no other host's answers; the fleet
totals count only measured memory of hosts that are up; ``fleet --json``, ``fleet record``
and the per-host ``summary``, ``diff`` and ``replay`` work on what the fleet wrote.

GPU numbers are synthetic (the demo, a DRM fixture tree, recordings of both): no GPU here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gputaskman.base import schema
from gputaskman.document import fleetdoc
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fixtures.drm_fixtures import write_demo_tree
from gputaskman.fleet.poller import Poller
from gputaskman.fleet.targets import parse_target
from gputaskman.fleet.view import fleet_rows, fleet_totals
from gputaskman.offline.playback import RecordSource

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fleet_helpers import TOKEN_A, TOKEN_B, Serve, SlowProxy, token_file, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # five serve processes: about 20 s

RECORDING = HERE / "recordings" / "demo.jsonl"
SLOW_DELAY = 3.0  # the proxy holds each answer this long
TIMEOUT = 1.5  # the fleet's per-poll timeout: the proxied host is slow
INTERVAL = 0.2


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    tree = d / "tree"
    write_demo_tree(tree)
    a, b = token_file(d, TOKEN_A, "a.token"), token_file(d, TOKEN_B, "b.token")
    serves = {
        "drm": Serve(["--token-file", str(a)], before=("--sysroot", str(tree))),
        "demo": Serve(["--demo", "--token-file", str(a)]),
        "replay": Serve(["--replay", str(RECORDING), "--token-file", str(a)]),
        "other-token": Serve(["--demo", "--token-file", str(b)]),
        "slow": Serve(["--replay", str(HERE / "recordings" / "drm.jsonl"), "--token-file", str(a)]),
    }
    for s in serves.values():  # start all, then wait: the five start side by side
        s.start()
    proxy = None
    try:
        for s in serves.values():
            s.ready()
        proxy = SlowProxy(serves["slow"].port, SLOW_DELAY)
        ports = {k: s.port for k, s in serves.items()}
        ports["slow"] = proxy.port
        yield serves, ports, d, a
    finally:
        for s in serves.values():
            s.stop()
        if proxy is not None:
            proxy.close()


def _targets(ports: dict[str, int]):
    return [parse_target(f"127.0.0.1:{ports[k]}") for k in ports]


def _by_name(poller: Poller, ports: dict[str, int]) -> dict[str, object]:
    names = {f"127.0.0.1:{p}": k for k, p in ports.items()}
    return {names[s.target.name]: s for s in poller.states()}


def test_five_hosts_each_show_what_they_are_and_a_dead_or_slow_one_slows_no_other(fleet):
    """Catches a down host shown as zeros, a slow host that holds the others' polls, a host
    that stays down after its serve is back, and totals that count a host that is not up."""
    serves, ports, _d, _a = fleet
    poller = Poller(
        _targets(ports), interval=INTERVAL, timeout=TIMEOUT, token=TOKEN_A, backoff_max=0.5
    )
    poller.start()
    try:

        def states():
            return _by_name(poller, ports)

        wait_for(
            lambda: (
                all(states()[k].up for k in ("drm", "demo", "replay"))
                and states()["other-token"].status is HostStatus.REFUSED
                and states()["slow"].status is HostStatus.SLOW
            ),
            30,
            "three hosts up, one refused, one slow",
        )
        st = states()
        assert "did not accept the token (HTTP 401)" in st["other-token"].reason
        assert st["other-token"].document is None  # a refusal carries nothing
        assert st["slow"].reason == f"no whole answer within {TIMEOUT:g} s"
        assert {a.vendor for a in st["drm"].document.adapters} == {"amd", "intel"}
        assert any("synthetic, not measured" in n for n in st["demo"].document.notes)
        assert any("replayed recording" in n for n in st["replay"].document.notes)

        # the slow host delays no one: the others keep answering every interval (a poll
        # that waited for the slow one would leave a gap of the timeout, 1.5 s, each time: at
        # most 3 in 6 s). Bounds with room for a loaded machine, whose serves may answer late.
        quick = ("drm", "demo", "replay")
        seen = {k: [states()[k].answered_at] for k in quick}
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            for k in quick:
                if states()[k].answered_at != seen[k][-1]:
                    seen[k].append(states()[k].answered_at)
            time.sleep(0.02)
        for k in quick:
            gaps = [b - a for a, b in zip(seen[k], seen[k][1:], strict=False)]
            assert len(gaps) >= 6 and max(gaps) < TIMEOUT, (k, gaps)
        assert states()["slow"].status is HostStatus.SLOW
        for k in ("drm", "demo", "replay"):
            assert states()[k].latency_s < TIMEOUT

        rows = {r.host: r for r in fleet_rows(poller.states()) if r.adapter is None}
        for k in ("other-token", "slow"):
            row = rows[f"127.0.0.1:{ports[k]}"]
            assert row.memory_used is None and row.util is None and row.processes == ""
            assert str(row.status) in row.gpu  # the reason, not a number

        up_totals = fleet_totals(poller.states())
        assert up_totals.up == 3 and up_totals.by_status == {"up": 3, "refused": 1, "slow": 1}

        # killed: unreachable, its numbers gone from the totals; restarted: up again
        serves["demo"].kill()
        wait_for(lambda: states()["demo"].status is HostStatus.UNREACHABLE, 10, "demo unreachable")
        down = states()["demo"]
        assert down.reason == "connection refused"
        assert down.document is not None  # the last answer is kept, and said to be old
        row = next(r for r in fleet_rows(poller.states()) if r.state is down)
        assert row.adapter is None and "unreachable: connection refused" in row.gpu
        assert "last answer" in row.gpu and row.memory_used is None
        t = fleet_totals(poller.states())
        assert t.up == 2 and t.gpus == up_totals.gpus - len(down.document.adapters)
        seq = down.seq
        serves["demo"].start().ready()
        wait_for(lambda: states()["demo"].up and states()["demo"].seq > seq, 20, "demo back up")
        assert fleet_totals(poller.states()).up == 3
    finally:
        poller.stop()


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_fleet_json_record_and_the_offline_tools_per_host(fleet, tmp_path):
    """Catches a fleet document whose hosts' snapshots do not validate, a record line that
    repeats an old snapshot, and offline tools that cannot pick one host out of a fleet file."""
    _serves, ports, _d, a = fleet
    hosts = tmp_path / "hosts"
    hosts.write_text("# the five\n" + "".join(f"127.0.0.1:{p}  # {k}\n" for k, p in ports.items()))
    common = ["--hosts", str(hosts), "--token-file", str(a), "--timeout", str(TIMEOUT)]
    r = _cli(*common, "--json")
    assert r.returncode == 0, r.stderr
    doc = fleetdoc.check_fleet(json.loads(r.stdout))
    names = {f"127.0.0.1:{p}": k for k, p in ports.items()}
    by = {names[h["name"]]: h for h in doc["hosts"]}
    assert by["other-token"]["status"] == "refused" and by["other-token"]["snapshot"] is None
    assert by["slow"]["status"] == "slow" and by["slow"]["snapshot"] is None
    for k in ("drm", "demo", "replay"):
        assert by[k]["status"] == "up" and schema.errors(by[k]["snapshot"]) == []
    assert doc["summary"]["hosts_up"] == 3 and doc["summary"]["hosts_total"] == 5
    used = doc["summary"]["memory_used_bytes"]
    assert used["kind"] == "measured" and used["value"] > 0

    text = _cli(*common, "--once")
    assert text.returncode == 0 and "hosts 3/5 up" in text.stdout
    assert "refused: the host did not accept the token" in text.stdout

    rec = tmp_path / "fleet.jsonl"
    r = _cli("record", str(rec), *common, "--interval", "0.3", "--count", "4")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in rec.read_text().splitlines()]
    assert len(lines) == 4
    demo = f"127.0.0.1:{ports['demo']}"
    taken = [
        h["snapshot"]["taken"]
        for line in lines
        for h in line["hosts"]
        if h["name"] == demo and h["snapshot"] is not None
    ]
    assert len(taken) >= 2 and len(set(taken)) == len(taken)  # each snapshot once

    summary = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "summary", str(rec), "--host", demo],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    assert f"(host {demo})" in summary.stdout and f"{len(taken)} snapshots" in summary.stdout
    every = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "summary", str(rec)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert every.returncode == 0 and every.stdout.count("gputaskman summary") == 3  # up hosts
    diff = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "diff", f"{rec}@1", f"{rec}@-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert diff.returncode == 0, diff.stderr
    assert diff.stdout.count("== host ") == 3 and f"== host {demo} ==" in diff.stdout
    source = RecordSource.open(rec, host=demo)
    assert len(source.frames) == len(taken)
    snap, _system = source.load(0)
    assert snap.adapters and snap.processes
    replay = subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "replay", str(rec)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 2 and "name a host with --host" in replay.stderr
    assert demo in replay.stderr
