"""``gputaskman fleet --prometheus``: the fleet read from a real Prometheus (Debian's 2.42,
installed by .ci/run) that scrapes five real ``gputaskman serve`` instances on loopback
every second: the DRM fixture tree through ``--sysroot``, the demo, a replayed recording,
one killed during the test, and one that expects a token Prometheus does not have.

Prometheus runs the shipped examples as written (prometheus/scrape.yml with rules.yml;
prometheus/federation.yml for a second, global server), only pointed at these hosts and
made faster. What is checked: every measured number agrees with polling the same hosts
directly (each serve samples once, so both read the same sample); each host that is down
says why, in Prometheus's words; the recording rules sum measured memory as the fleet's
totals do; the global server shows the same fleet; ``fleet record`` writes each sample once;
over TLS, Prometheus's own client-certificate protection (``--web.config.file``) lets the
fleet in with its certificate and keeps it out without one, in one line.

GPU numbers are synthetic (the demo, a DRM fixture tree, recordings of both): no GPU here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from gputaskman.document import fleetdoc
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fixtures.drm_fixtures import write_demo_tree

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from fleet_helpers import TOKEN_A, TOKEN_B, Serve, token_file, wait_for  # noqa: E402
from prom_helpers import Prometheus  # noqa: E402

pytestmark = pytest.mark.slow  # five serve processes and two Prometheus servers: about 30 s

RECORDING = HERE / "recordings" / "demo.jsonl"
ONE_SAMPLE = ("--sample-interval", "3600")  # each serve samples once: both ways read it
TIMESTAMP_SERIES = 'gputaskman_sample_timestamp_seconds{job="gputaskman"}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("prom-fleet")
    tree = d / "tree"
    write_demo_tree(tree)
    a, b = token_file(d, TOKEN_A, "a.token"), token_file(d, TOKEN_B, "b.token")
    serves = {
        "drm": Serve(["--token-file", str(a), *ONE_SAMPLE], before=("--sysroot", str(tree))),
        "demo": Serve(["--demo", "--token-file", str(a), *ONE_SAMPLE]),
        "replay": Serve(["--replay", str(RECORDING), "--token-file", str(a), *ONE_SAMPLE]),
        "killed": Serve(["--demo", "--token-file", str(a), *ONE_SAMPLE]),
        "other-token": Serve(["--demo", "--token-file", str(b), *ONE_SAMPLE]),
    }
    prom = None
    try:
        for s in serves.values():
            s.start()
        for s in serves.values():
            s.ready()
        names = {f"127.0.0.1:{s.port}": k for k, s in serves.items()}
        prom = Prometheus(d, list(names), config=_example_scrape(list(names), a)).wait_ready()

        def scraped() -> bool:
            up = {r["metric"]["instance"]: r["value"][1] for r in prom.query("up")}
            return len(up) == 5 and sorted(up.values()) == ["0", "1", "1", "1", "1"]

        wait_for(scraped, 30, "Prometheus to scrape the five hosts")
        yield SimpleNamespace(serves=serves, names=names, prom=prom, token=a)
    finally:
        if prom is not None:
            prom.stop()
        for s in serves.values():
            s.stop()


EXAMPLES = HERE.parent / "prometheus"


def _example_scrape(targets: list[str], token: Path) -> str:
    """The shipped scrape example (prometheus/scrape.yml, with its rules.yml) as written,
    pointed at these hosts, and every second instead of every 15."""
    text = (EXAMPLES / "scrape.yml").read_text()
    text = text.replace("scrape_interval: 15s", "scrape_interval: 1s")
    text = text.replace("evaluation_interval: 15s", "evaluation_interval: 1s")
    text = text.replace("scrape_timeout: 10s", "scrape_timeout: 1s")
    text = text.replace("- rules.yml", f"- {EXAMPLES / 'rules.yml'}")
    text = text.replace("credentials_file: gputaskman.token", f"credentials_file: {token}")
    hosts = "".join(f"          - {t}\n" for t in targets)
    return text.replace("          - gpu-node-01:9835\n          - gpu-node-02:9835\n", hosts)


def _fleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# the system object's numbers serve exports (the rest are not in its series)
SYSTEM_EXPORTED = {
    "memory": ("total_bytes", "available_bytes", "used_bytes", "cached_bytes"),
    "swap": ("total_bytes", "used_bytes"),
    "cpu": ("percent",),
}


def _measured(doc: dict) -> dict[tuple, object]:
    """Every measured number in a fleet document's snapshots that serve exports, by host
    and place: GPUs, processes (with their RAM and CPU) and the system panel."""
    out: dict[tuple, object] = {}
    for h in doc["hosts"]:
        s = h["snapshot"]
        if s is None:
            continue
        system = s["system"] or {}
        places = [
            ((section, k), (system.get(section) or {}).get(k))
            for section, keys in SYSTEM_EXPORTED.items()
            for k in keys
        ]
        for d in (system.get("swap") or {}).get("devices") or ():
            places += [(("device", d["filename"], k), d[k]) for k in ("size_bytes", "used_bytes")]
        for place, r in places:
            if r and r["kind"] == "measured" and r["value"] is not None:
                out[(h["name"], *place)] = r["value"]
        for a in s["adapters"]:
            for k, r in (a["metrics"] or {}).items():
                if r and r["kind"] == "measured" and r["value"] is not None:
                    out[(h["name"], a["pci_bus_id"], k)] = r["value"]
        for p in s["processes"]:
            keys = ("vram_bytes", "paged_bytes", "footprint_bytes", "ram_bytes", "cpu_percent")
            readings = {k: p[k] for k in keys}
            readings.update(p["engines"])
            for k, r in readings.items():
                if r and r["kind"] == "measured" and r["value"] is not None:
                    out[(h["name"], p["pid"], p["gpu"], k)] = r["value"]
    return out


def test_prometheus_agrees_with_direct_polling_on_every_measured_number(cluster):
    """Catches a measured number lost, changed or moved to another GPU or process on its
    way through Prometheus (the system panel and each process's RAM and CPU included), and
    a down host shown without Prometheus's reason."""
    serves, names, prom, a = cluster.serves, cluster.names, cluster.prom, cluster.token
    via = _fleet("--prometheus", prom.url, "--json")
    assert via.returncode == 0, via.stderr
    direct = _fleet("--token-file", str(a), *names, "--json")
    assert direct.returncode == 0, direct.stderr
    pdoc, ddoc = json.loads(via.stdout), json.loads(direct.stdout)
    fleetdoc.check_fleet(pdoc)
    p, q = _measured(pdoc), _measured(ddoc)
    assert len(p) > 40 and p == q
    # the system panel and the processes' RAM and CPU came through (the demo's at least)
    count = Counter(k[-1] for k in p)
    assert len([k for k in p if k[1:] == ("memory", "total_bytes")]) == 4
    assert count["percent"] >= 2 and count["size_bytes"] >= 3
    assert count["ram_bytes"] >= 6 and count["cpu_percent"] >= 6
    hosts = {names[h["name"]]: h for h in pdoc["hosts"]}
    assert sorted(hosts) == sorted(serves)
    for k in ("drm", "demo", "replay", "killed"):
        assert hosts[k]["status"] == "up" and hosts[k]["snapshot"] is not None
        assert any("Prometheus's series" in n for n in hosts[k]["snapshot"]["notes"])
    refused = hosts["other-token"]
    assert refused["status"] == "refused" and refused["snapshot"] is None
    assert "401 Unauthorized" in refused["reason"]
    # the fleet totals count the same measured memory both ways
    for key in ("memory_used_bytes", "memory_total_bytes", "memory_used_inferred_bytes", "gpus"):
        assert pdoc["summary"][key] == ddoc["summary"][key], key


def test_direct_and_prometheus_fleets_agree_on_every_field_serve_exports(cluster):
    """Catches a field serve exports that the fleet read from Prometheus loses or changes,
    and one it does not export shown with a value: the lower-bound flag of the demo's
    second GPU (its graphics process list failed), a process without a GPU (the demo's
    CPU-only llama-cli), the driver version, a process's contexts, a model, the problems
    with their GPU, the system panel. Each host's two documents are diffed field by field
    (tests/prom_compare.py)."""
    from prom_compare import differences, not_exported_violations

    names, prom, a = cluster.names, cluster.prom, cluster.token
    via = _fleet("--prometheus", prom.url, "--json")
    direct = _fleet("--token-file", str(a), *names, "--json")
    assert via.returncode == direct.returncode == 0, via.stderr + direct.stderr
    pdoc = {h["name"]: h for h in json.loads(via.stdout)["hosts"]}
    ddoc = {h["name"]: h for h in json.loads(direct.stdout)["hosts"]}
    compared, wrong = 0, []
    for name, d in ddoc.items():
        if d["status"] != "up" or pdoc[name]["status"] != "up":
            continue
        s, p = d["snapshot"], pdoc[name]["snapshot"]
        wrong += [f"{names[name]}: {w}" for w in differences(s, p) + not_exported_violations(p)]
        compared += 1
    assert wrong == [], "\n".join(wrong)
    assert compared >= 3  # the DRM tree, the demo and the replayed recording (killed later)
    demo = pdoc[next(n for n, k in names.items() if k == "demo")]["snapshot"]
    # what the issue saw lost, as the document has it
    assert [a["attributed_complete"] for a in demo["adapters"]] == [False, False]
    assert demo["adapters"][1]["process_list"]["graphics"]["reason"] == "query failed"
    assert demo["driver_version"] == "550.54.14"
    (cpu_only,) = [p for p in demo["processes"] if p["name"] == "llama-cli"]
    assert cpu_only["gpu"] is None and cpu_only["vram_bytes"]["value"] is None


def test_an_open_host_is_its_live_view_while_its_serve_answers(cluster):
    """Catches a drill-down that stays on the view built from series when the host's own
    serve answers (no command lines, no memory split), or one that shows another host."""
    from gputaskman.fleet.promapi import PromClient
    from gputaskman.fleet.promfleet import PromFleet

    serves, names, prom = cluster.serves, cluster.names, cluster.prom
    demo = f"127.0.0.1:{serves['demo'].port}"
    fleet = PromFleet(PromClient(prom.url), interval=0.5, token=TOKEN_A, table_only=True)
    try:
        fleet.refresh()

        def state(name: str):
            return next(s for s in fleet.states() if s.target.name == name)

        assert state(demo).from_series
        fleet.focus(demo)
        wait_for(lambda: not state(demo).from_series, 20, "the open host's live answer")
        live = state(demo)
        assert live.up and live.document is not None and live.body is not None
        assert not any("Prometheus" in n for n in live.document.notes)
        assert live.document.system is not None  # the host's own document, whole
        others = [s for s in fleet.states() if s.target.name != demo]
        assert all(s.from_series or not s.up for s in others) and len(others) == len(names) - 1
        fleet.focus(None)
        assert state(demo).from_series
    finally:
        fleet.stop()


def test_a_job_prometheus_scrapes_nothing_of_is_an_error_naming_its_jobs(cluster):
    """Catches a mistyped --job shown as an empty fleet ("hosts 0/0 up", exit 0): the
    error names the jobs Prometheus has, on stderr, and the exit status is 1."""
    prom = cluster.prom
    for mode in ("--once", "--json"):
        r = _fleet("--prometheus", prom.url, "--job", "nope", mode)
        assert r.returncode == 1 and r.stdout == "", r.stdout
        assert 'scrapes no target of job "nope"' in r.stderr, r.stderr
        assert 'its jobs: "gputaskman"' in r.stderr and r.stderr.count("\n") == 1


async def test_an_open_host_whose_serve_refuses_the_fleet_says_so(cluster):
    """Catches a host view built from series whose status says its own /snapshot.json
    "did not answer" when it answered 401 (Prometheus has the hosts' token, the fleet was
    given none): the status line must say what it answered."""
    from gputaskman.fleet.promapi import PromClient
    from gputaskman.fleet.promfleet import PromFleet
    from gputaskman.tui.fleet_app import FleetApp

    demo = f"127.0.0.1:{cluster.serves['demo'].port}"
    fleet = PromFleet(PromClient(cluster.prom.url), interval=0.5, table_only=True)
    fleet.refresh()
    app = FleetApp(fleet)
    try:
        async with app.run_test(size=(200, 60)) as pilot:
            app.drill(demo)
            for _ in range(200):  # the open host's own serve polled once (a thread)
                fleet.refresh()
                app.request_refresh()
                await pilot.pause(0.05)
                if "HTTP 401" in str(app.status.content):
                    break
            state = app.host_state()
            assert state.up and state.from_series and state.whole
            status = str(app.status.content)
            assert "built from Prometheus's series: its own /snapshot.json: refused" in status
            assert "wants a token (HTTP 401)" in status and "did not answer" not in status
    finally:
        fleet.stop()


def _value(prom: Prometheus, expr: str) -> float | None:
    got = prom.query(expr)
    return float(got[0]["value"][1]) if got else None


def test_the_shipped_recording_rules_sum_measured_memory_as_the_fleet_does(cluster):
    """Catches a recording rule (prometheus/rules.yml) that sums other than the fleet's
    totals: an estimate added to measured memory, or a down host counted as up."""
    prom, a = cluster.prom, cluster.token
    names = list(cluster.names)
    r = _fleet("--token-file", str(a), *names, "--json")
    summary = json.loads(r.stdout)["summary"]
    wait_for(
        lambda: _value(prom, "job:gputaskman_gpu_memory_used_bytes:sum") is not None,
        30,
        "the rules to be evaluated",
    )
    used = _value(prom, "job:gputaskman_gpu_memory_used_bytes:sum")
    total = _value(prom, "job:gputaskman_gpu_memory_total_bytes:sum")
    assert used == summary["memory_used_bytes"]["value"]
    assert total == summary["memory_total_bytes"]["value"]
    assert _value(prom, "job:gputaskman_hosts_up:count") == 4
    assert _value(prom, "job:gputaskman_hosts_down:count") == 1
    unmeasured = summary["gpus"] - summary["gpus_measured"]
    assert _value(prom, "job:gputaskman_gpus_memory_unmeasured:count") == unmeasured > 0
    per_host = prom.query("instance:gputaskman_gpu_memory_used_bytes:sum")
    assert len(per_host) == 4


POD = "6f1c2a4e-8b1d-4c3e-9a57-0d2b7e5f9c11"  # the DRM fixture tree's llama-server's pod


def test_prometheus_scrapes_each_processs_owner_and_memory_and_records_vram_per_pod(cluster):
    """Catches an owner or a swapped / locked / pinned reading lost between serve and a real
    Prometheus (the DRM fixture tree's llama-server runs in a kubelet pod's containerd
    container with 12 MiB swapped out), and a shipped per-pod rule that records other than
    the process's measured VRAM."""
    prom = cluster.prom
    drm = next(f"127.0.0.1:{s.port}" for k, s in cluster.serves.items() if k == "drm")
    (info,) = prom.query(f'gputaskman_process_owner_info{{instance="{drm}",pod_uid="{POD}"}}')
    m = info["metric"]
    assert (m["pid"], m["name"], m["qos"]) == ("4100", "llama-server", "burstable")
    assert (m["container_id"], m["container_runtime"]) == ("3f" * 32, "containerd")
    assert m["user"] == "root" and "slurm_job" not in m and "session" not in m  # empty: absent
    sessions = prom.query(f'gputaskman_process_owner_info{{instance="{drm}",session="2"}}')
    assert len(sessions) >= 3  # the tree's other processes: a login session's
    (swapped,) = prom.query(f'gputaskman_process_swapped_bytes{{instance="{drm}",pid="4100"}}')
    assert swapped["metric"]["swapped_to"] == "swap" and float(swapped["value"][1]) == 12 << 20
    locked = prom.query(f'gputaskman_process_locked_bytes{{instance="{drm}"}}')
    assert locked and all(float(r["value"][1]) == 0 for r in locked)  # a measured zero
    vram = prom.query(f'sum(gputaskman_process_vram_bytes{{instance="{drm}",pid="4100"}})')
    (total,) = prom.query(f'gputaskman_owner_vram_bytes{{instance="{drm}",by="pod",owner="{POD}"}}')
    assert float(total["value"][1]) == float(vram[0]["value"][1]) > 0
    rule = f'instance_pod:gputaskman_process_vram_bytes:sum{{instance="{drm}",pod_uid="{POD}"}}'
    wait_for(lambda: bool(prom.query(rule)), 30, "the per-pod rule to be evaluated")
    (recorded,) = prom.query(rule)
    assert float(recorded["value"][1]) == float(vram[0]["value"][1])


def test_a_global_prometheus_federating_the_site_shows_the_same_fleet(cluster, tmp_path):
    """Catches a federation example (prometheus/federation.yml) that loses the hosts'
    labels or their `up` series: the global fleet would miss hosts, or show a down host
    as up."""
    prom = cluster.prom
    text = (EXAMPLES / "federation.yml").read_text()
    text = text.replace("scrape_interval: 15s", "scrape_interval: 1s")
    text = text.replace("scrape_timeout: 10s", "scrape_timeout: 1s")
    text = text.replace(
        "          - prometheus-site-a:9090\n          - prometheus-site-b:9090\n",
        f"          - 127.0.0.1:{prom.port}\n",
    )
    world = Prometheus(tmp_path, [], config=text).wait_ready()
    try:

        def federated() -> bool:
            up = world.query('up{job="gputaskman"}')
            return len(up) == 5 and len(world.query(TIMESTAMP_SERIES)) == 4

        wait_for(federated, 30, "the global Prometheus to federate the site's series")
        site = _fleet("--prometheus", prom.url, "--json")
        glob = _fleet("--prometheus", world.url, "--json")
        assert site.returncode == glob.returncode == 0, glob.stderr
        sdoc, gdoc = json.loads(site.stdout), json.loads(glob.stdout)
        assert _measured(gdoc) == _measured(sdoc) and len(_measured(gdoc)) > 40
        up = {h["name"] for h in sdoc["hosts"] if h["status"] == "up"}
        assert {h["name"] for h in gdoc["hosts"] if h["status"] == "up"} == up and len(up) == 4
        # the refused host: down there too, in the bare words (lastError stays at the site)
        (down,) = [h for h in gdoc["hosts"] if h["name"] not in up]
        assert down["status"] == "error" and down["snapshot"] is None
        assert down["reason"] == "Prometheus's scrape fails (up == 0)"
    finally:
        world.stop()


def test_a_host_killed_mid_run_says_why_and_the_others_stay_up(cluster):
    """Catches a dead host shown with its last numbers as if current, or with zeros."""
    serves, names, prom = cluster.serves, cluster.names, cluster.prom
    serves["killed"].kill()
    killed = f"127.0.0.1:{serves['killed'].port}"
    # a scrape after the kill, not an `up` of 0 left from a scrape before the host's first
    # sample (HTTP 503): its error is what the fleet reads the host's state from
    wait_for(
        lambda: any(
            t["labels"]["instance"] == killed
            and t["health"] == "down"
            and "connection refused" in t["lastError"]
            for t in prom.api("/api/v1/targets")["activeTargets"]
        ),
        30,
        "Prometheus to see the killed host refuse connections",
    )
    r = _fleet("--prometheus", prom.url, "--json")
    assert r.returncode == 0, r.stderr
    hosts = {names[h["name"]]: h for h in json.loads(r.stdout)["hosts"]}
    dead = hosts["killed"]
    assert dead["status"] == HostStatus.UNREACHABLE and dead["snapshot"] is None
    assert "connection refused" in dead["reason"]
    assert [hosts[k]["status"] for k in ("drm", "demo", "replay")] == ["up"] * 3
    text = _fleet("--prometheus", prom.url, "--once").stdout
    line = next(ln for ln in text.splitlines() if ln.startswith(killed))
    assert "unreachable: Prometheus cannot scrape it" in line and "GiB" not in line


def test_record_writes_each_sample_once(cluster, tmp_path):
    names, prom = cluster.names, cluster.prom
    out = tmp_path / "fleet.jsonl"
    r = _fleet("--prometheus", prom.url, "record", str(out), "--count", "3", "--interval", "0.3")
    assert r.returncode == 0, r.stderr
    assert "from Prometheus" in r.stderr
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == 3
    seen: dict[str, int] = {}
    for doc in lines:
        fleetdoc.check_fleet(doc)
        for h in doc["hosts"]:
            seen[h["name"]] = seen.get(h["name"], 0) + (h["snapshot"] is not None)
    # one sample per serve (each sampled once): written in the first line only
    assert sorted(seen.values()) == sorted(
        [1 if names[n] in ("drm", "demo", "replay") else 0 for n in seen]
    )


def test_tls_with_a_client_certificate_against_prometheus_own_web_config(cluster, tmp_path):
    """Catches a client that cannot present its certificate, or one that falls back to
    plain HTTP (the refusal must be one line, not a traceback)."""
    from tls_files import make_pki

    serves, a = cluster.serves, cluster.token
    pki = make_pki(tmp_path)
    web = (
        "tls_server_config:\n"
        f"  cert_file: {pki['server']}\n  key_file: {pki['server_key']}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki['ca']}\n"
    )
    demo = f"127.0.0.1:{serves['demo'].port}"
    tls_prom = Prometheus(tmp_path, [demo], token_file=a, web_config=web).wait_ready()
    try:
        ca = ("--prometheus-ca", str(pki["ca"]))
        cert = ("--prometheus-cert", str(pki["client"]), "--prometheus-key", str(pki["client_key"]))

        def has_demo() -> bool:
            r = _fleet("--prometheus", tls_prom.url, *ca, *cert, "--json")
            return (
                r.returncode == 0
                and json.loads(r.stdout)["hosts"][:1] != []
                and (json.loads(r.stdout)["hosts"][0]["status"] == "up")
            )

        wait_for(has_demo, 30, "the TLS Prometheus to scrape the demo")
        no_cert = _fleet("--prometheus", tls_prom.url, *ca, "--json")
        assert no_cert.returncode == 1 and no_cert.stdout == ""
        assert no_cert.stderr.count("\n") == 1 and "Traceback" not in no_cert.stderr
        rogue = ("--prometheus-cert", str(pki["rogue"]), "--prometheus-key", str(pki["rogue_key"]))
        refused = _fleet("--prometheus", tls_prom.url, *ca, *rogue, "--json")
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    finally:
        tls_prom.stop()
