"""Reading the fleet from Prometheus's HTTP API when the server misbehaves, and the hosts'
states built from recorded answers.

A loopback HTTP server (`prom_helpers.FakePrometheus`) plays the server: recorded answers of
a real Prometheus 2.42 (tests/recordings/prometheus_answers.json: four ``gputaskman serve``
hosts on loopback scraped every second, a demo, a DRM recording, one whose token Prometheus
did not have, one not running; their addresses renamed gpu-node-0N), garbage, an error
status, a huge body, a stall. The real server's own tests are in test_fleet_prometheus.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fleet.promapi import (
    PromClient,
    PromError,
    decode_vector,
    exposure_refusal,
    parse_duration,
    parse_url,
)
from gputaskman.fleet.promfleet import PromFleet, scrape_failure
from gputaskman.fleet.view import fleet_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from prom_helpers import answer, fake_prometheus, recorded

HERE = Path(__file__).parent
ANSWERS = json.loads((HERE / "recordings" / "prometheus_answers.json").read_text())
UP = 'up{job="gputaskman"}'


def _fleet(url: str, job: str = "gputaskman", **kw) -> PromFleet:
    return PromFleet(PromClient(url, timeout=kw.pop("timeout", 2.0), **kw), job=job, interval=60.0)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_recorded_answers_give_each_host_its_state_and_prometheus_reason():
    """Catches a host whose scrape fails shown as up (or with zeros), a refused token not
    told apart from a dead host, or Prometheus's own reason lost."""
    with fake_prometheus(recorded(ANSWERS)) as fake:
        fleet = _fleet(fake.url)
        fleet.refresh()
    states = {s.target.name: s for s in fleet.states()}
    assert fleet.error is None and list(states) == [f"gpu-node-0{i}:9835" for i in (1, 2, 3, 4)]
    assert [states[n].status for n in states] == [
        HostStatus.UP,
        HostStatus.UP,
        HostStatus.REFUSED,
        HostStatus.UNREACHABLE,
    ]
    assert "401 Unauthorized" in states["gpu-node-03:9835"].reason
    assert "connection refused" in states["gpu-node-04:9835"].reason
    for name in ("gpu-node-03:9835", "gpu-node-04:9835"):
        assert states[name].document is None and states[name].body is None
    up = states["gpu-node-01:9835"]
    assert up.from_series and up.seq == 1 and up.document is not None
    assert any("built from Prometheus's series" in n for n in up.document.notes)
    rows = [r for r in fleet_rows(fleet.states()) if r.host == "gpu-node-01:9835"]
    assert [r.memory_used.value for r in rows] == [12 * 2**30, 2 * 2**30]
    assert "qwen2.5-7b-q4_k_m [mapped?]" in rows[0].models
    # the mechanism: one query per question, every series of the changed hosts once
    queries = [p["query"][0] for path, p, _ in fake.requests if path == "/api/v1/query"]
    assert queries[0] == UP and len(queries) == 4
    assert queries[3].startswith('{__name__=~"gputaskman_.+",job="gputaskman"')


def test_a_host_whose_sample_did_not_change_is_not_read_again():
    """Catches a refresh that fetches every host's series every second (the cost would
    grow with the fleet, not with what changed), one that counts the same sample twice, or
    one that replaces unchanged states (the views would rebuild every host's rows)."""
    with fake_prometheus(recorded(ANSWERS)) as fake:
        fleet = _fleet(fake.url)
        fleet.refresh()
        first = fleet.states()
        before = len(fake.requests)
        fleet.refresh()
        again = [p["query"][0] for _, p, _ in fake.requests[before:] if "query" in p]
    assert again == [UP, 'gputaskman_sample_timestamp_seconds{job="gputaskman"}']
    assert [s.seq for s in fleet.states()] == [1, 1, 0, 0]
    assert all(a is b for a, b in zip(first, fleet.states(), strict=True))


def test_values_prometheus_writes_as_words_are_read():
    """Catches an answer with an infinite value ("+Inf", which msgspec's lax floats do not
    take) refused whole, or a value that is no number accepted."""
    inf = (
        b'{"status":"success","data":{"resultType":"vector","result":['
        b'{"metric":{"__name__":"a"},"value":[1.5,"+Inf"]},'
        b'{"metric":{"__name__":"b"},"value":[1.5,"NaN"]},'
        b'{"metric":{"__name__":"c"},"value":[1.5,"42"]}]}}'
    )
    with fake_prometheus(_broken(200, inf)) as fake:
        v = PromClient(fake.url).query("x")
    assert v.at == 1.5 and [s.labels["__name__"] for s in v.samples] == ["a", "b", "c"]
    assert v.samples[0].number == float("inf") and v.samples[2].number == 42.0
    assert v.samples[1].number != v.samples[1].number  # NaN
    with (
        fake_prometheus(_broken(200, inf.replace(b"42", b"many"))) as fake,
        pytest.raises(PromError, match="'many' is not a number"),
    ):
        PromClient(fake.url).query("x")


def _broken(status: int, body: bytes, ctype: str = "application/json"):
    return lambda h, path, params: answer(h, status, body, ctype)


@pytest.mark.parametrize(
    ("handler", "says"),
    [
        (_broken(200, b"<html>hello</html>", "text/html"), "not its JSON"),
        (
            _broken(200, b'{"status":"success","data":{"resultType":"vector","result":[1]}}'),
            "not its JSON",
        ),
        (
            _broken(200, b'{"status":"success","data":{"resultType":"matrix","result":[]}}'),
            "expected an instant vector",
        ),
        (
            _broken(
                400, b'{"status":"error","errorType":"bad_data","error":"parse error at char 3"}'
            ),
            "HTTP 400: parse error at char 3",
        ),
        (_broken(503, b"Service Unavailable", "text/plain"), "HTTP 503"),
        (_broken(401, b"Unauthorized", "text/plain"), "refused the credentials"),
    ],
    ids=["html", "wrong-shape", "matrix", "bad-data", "503", "401"],
)
def test_a_broken_answer_is_one_line_error_never_a_traceback(handler, says):
    """Catches a garbage answer or an error status that crashes the fleet, or whose reason
    is lost."""
    with fake_prometheus(handler) as fake:
        fleet = _fleet(fake.url)
        fleet.refresh()
        assert fleet.error is not None and says in fleet.error and "\n" not in fleet.error
        r = _cli("--prometheus", fake.url, "--json", "--timeout", "2")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr


_EMPTY = b'{"status":"success","data":{"resultType":"vector","result":[]}}'


@pytest.mark.parametrize(
    ("labels", "says"),
    [
        (
            (200, b'{"status":"success","data":["node","gputaskman"]}'),
            'Prometheus scrapes no target of job "nope" (--job); its jobs: "gputaskman", "node"',
        ),
        ((200, b'{"status":"success","data":[]}'), 'of job "nope", nor of any other job'),
        ((404, b"404 page not found"), 'Prometheus scrapes no target of job "nope"'),
        ((200, b"<html>"), 'Prometheus scrapes no target of job "nope"'),
    ],
    ids=["jobs", "none", "not-served", "garbage"],
)
def test_a_job_with_no_target_is_an_error_that_names_the_jobs_there_are(labels, says):
    """Catches a mistyped --job read as an empty fleet ("hosts 0/0 up", exit 0), and a
    server that cannot list its jobs (a query front end) crashing the error instead of
    giving the bare fact."""

    def handle(h, path: str, params) -> None:
        if path == "/api/v1/label/job/values":
            return answer(h, *labels)
        answer(h, 200, _EMPTY)

    with fake_prometheus(handle) as fake:
        fleet = _fleet(fake.url, job="nope")
        fleet.refresh()
        assert fleet.error is not None and says in fleet.error and not fleet.states()
        r = _cli("--prometheus", fake.url, "--job", "nope", "--once")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr


def test_a_stalled_server_costs_one_timeout():
    """Catches a request without a deadline (a server that sends its headers a byte at a
    time would hold the fleet forever)."""

    done = threading.Event()

    def trickle(h, path, params):
        h.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(90):  # 27 s of headers (under http.client's 100): past the bound below
            h.wfile.write(b"X-Slow: 1\r\n")
            h.wfile.flush()
            if done.wait(0.3):
                return

    with fake_prometheus(trickle) as fake:
        client = PromClient(fake.url, timeout=0.5)
        t0 = time.monotonic()
        try:
            with pytest.raises(PromError, match=r"no whole answer within 0\.5 s"):
                client.query("up")
            # generous for a loaded machine; without a whole-answer deadline it takes 27 s
            assert time.monotonic() - t0 < 10
        finally:
            done.set()


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "streamed"])
def test_a_huge_answer_is_refused_in_bounded_memory(length):
    """Catches an answer read whole before its size is checked."""
    big = 5 << 20

    def huge(h, path, params):
        h.send_response(200)
        if length:
            h.send_header("Content-Length", str(big))
        else:
            h.send_header("Connection", "close")
        h.end_headers()
        try:
            for _ in range(big >> 16):
                h.wfile.write(b"x" * 65536)
        except OSError:
            pass  # the client hung up, as it should

    with fake_prometheus(huge) as fake:
        client = PromClient(fake.url, timeout=5, max_bytes=1 << 20)
        with pytest.raises(PromError, match="over the 1048576-byte limit"):
            client.query("up")


def test_the_bearer_token_goes_with_every_request_and_long_queries_are_posted():
    with fake_prometheus(recorded(ANSWERS)) as fake:
        client = PromClient(fake.url, token="s3cret-token-0123456789")
        client.query("up")
        client.query('up{instance=~"' + "|".join(f"h{i}" for i in range(400)) + '"}')
        client.targets()
    assert [a for _, _, a in fake.requests] == ["Bearer s3cret-token-0123456789"] * 3
    assert fake.requests[1][1]["query"][0].startswith("up{instance=~")
    assert fake.methods == ["GET", "POST", "GET"]  # the long one as a form


def test_off_loopback_plain_http_without_credentials_is_refused():
    """Catches a fleet that reads process names from an unprotected remote Prometheus, as
    `serve` refuses to expose them."""
    assert exposure_refusal(parse_url("http://127.0.0.1:9090"), False, False) is None
    assert exposure_refusal(parse_url("http://[::1]"), False, False) is None
    remote = parse_url("http://prometheus.example:9090")
    assert "off loopback without authentication" in exposure_refusal(remote, False, False)
    assert exposure_refusal(remote, True, False) is None
    assert exposure_refusal(parse_url("https://prometheus.example"), False, True) is None
    r = _cli("--prometheus", "http://192.0.2.1:9090", "--once")
    assert r.returncode == 2 and "off loopback without authentication" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prometheus:9090", "give Prometheus's URL"),
        ("ftp://x", "give Prometheus's URL"),
        ("http://", "no host"),
        ("http://h:99999", "not a URL"),
        ("http://h/?q=1", "no query"),
    ],
)
def test_a_bad_url_is_a_usage_error(text, says):
    with pytest.raises(PromError, match=says):
        parse_url(text)
    r = _cli("--prometheus", text, "--once")
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_an_empty_job_is_a_usage_error():
    """Catches ``--job ""`` selecting the series without a job label (none: an empty fleet
    and exit 0)."""
    r = _cli("--prometheus", "http://127.0.0.1:9", "--job", "", "--once")
    assert r.returncode == 2 and "--job names the scrape job" in r.stderr


def test_urls_durations_and_scrape_errors_are_read_as_prometheus_writes_them():
    ep = parse_url("https://mon.example/prometheus/")
    assert (ep.tls, ep.host, ep.port, ep.path) == (True, "mon.example", 9090, "/prometheus")
    assert parse_duration("15s") == 15 and parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5 and parse_duration("") is None
    assert parse_duration("5x") is None and parse_duration("10") is None
    assert scrape_failure("server returned HTTP status 401 Unauthorized") is HostStatus.REFUSED
    assert scrape_failure("context deadline exceeded") is HostStatus.SLOW
    assert scrape_failure('Get "http://h/metrics": dial tcp: connect: connection refused') is (
        HostStatus.UNREACHABLE
    )
    assert scrape_failure("server returned HTTP status 500") is HostStatus.ERROR


def test_naming_hosts_with_prometheus_is_a_usage_error():
    r = _cli("--prometheus", "http://127.0.0.1:9", "gpu1", "--once")
    assert r.returncode == 2 and "name no HOST" in r.stderr


def test_the_table_reads_only_its_series_and_an_open_host_reads_all_of_its_own():
    """Catches a table-only refresh that reads every series (the fleet view's cost), rows
    that differ from the whole documents', or an open host whose view lacks what its serve
    exported."""
    # the hosts renamed to closed loopback ports: opening one polls it directly, and that
    # must reach nobody
    answers = json.loads(re.sub(r"gpu-node-0(\d):9835", r"127.0.0.1:\1", json.dumps(ANSWERS)))
    with fake_prometheus(recorded(answers)) as fake:
        whole = _fleet(fake.url)
        whole.refresh()
        before = len(fake.requests)
        table = PromFleet(PromClient(fake.url), interval=60.0, table_only=True)
        table.refresh()
        asked = [p["query"][0] for _, p, _ in fake.requests[before:] if "query" in p]
        name = table.states()[0].target.name
        table.focus(name)
        table.refresh()
        opened = [p["query"][0] for _, p, _ in fake.requests[before:] if "query" in p]
        opened = opened[len(asked) :]
        table.stop()
    key = [
        (r.key, r.gpu, r.memory_used, r.memory_total, r.util, r.processes, r.models)
        for r in fleet_rows(whole.states())
    ]
    first = [
        (r.key, r.gpu, r.memory_used, r.memory_total, r.util, r.processes, r.models)
        for r in fleet_rows(table.states()[1:])
    ]
    assert first == key[len(key) - len(first) :]
    series_query = next(q for q in asked if q.startswith("{"))
    assert "gputaskman_gpu_info|" in series_query and "gputaskman_.+" not in series_query
    assert [q for q in opened if q.startswith("{")] == [
        f'{{__name__=~"gputaskman_.+",job="gputaskman",instance="{name}"}}'
    ]
    doc = table.states()[0].document
    assert any("Prometheus's series" in n for n in doc.notes)
    assert doc.adapters[0].metrics.temperature_c.value is not None
    other = table.states()[1].document
    assert any("fleet table's series" in n for n in other.notes)
    assert other.adapters[0].metrics.temperature_c.value is None


_GOOD = (
    b'{"status":"success","data":{"resultType":"vector","result":['
    b'{"metric":{"__name__":"up","instance":"h:1"},"value":[1.5,"1"]},'
    b'{"metric":{"__name__":"up","instance":"h:2"},"value":[1.5,"+Inf"]}]},"warnings":["w"]}'
)


@given(
    st.binary(max_size=300)
    | st.builds(
        lambda i, b: _GOOD[:i] + b + _GOOD[i + len(b) :],
        st.integers(0, len(_GOOD)),
        st.binary(max_size=8),
    )
)
@settings(max_examples=500, deadline=None)
def test_any_answer_is_a_vector_or_one_line_error(body):
    """Catches an answer that raises anything but `PromError` (a traceback in the fleet),
    or an error message that spans lines."""
    try:
        v = decode_vector(body, "http://p:9090")
    except PromError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(isinstance(s.number, float) for s in v.samples)


def test_a_host_prometheus_has_not_scraped_lately_is_stale_with_its_last_numbers_apart():
    """Catches a host whose last scrape is minutes old shown as up (Prometheus keeps
    answering with its last samples for five minutes), or one whose age is not said."""
    answers = json.loads(json.dumps(ANSWERS))
    scraped = answers["queries"]['timestamp(up{job="gputaskman"})']["data"]["result"]
    for r in scraped:
        if r["metric"]["instance"] == "gpu-node-01:9835":
            r["value"][1] = str(float(r["value"][1]) - 120)  # two minutes before the others
    with fake_prometheus(recorded(answers)) as fake:
        fleet = _fleet(fake.url)
        fleet.refresh()
    states = {s.target.name: s for s in fleet.states()}
    old = states["gpu-node-01:9835"]
    assert old.status is HostStatus.STALE and not old.up
    assert "last scrape of it is 12" in old.reason and "over 3 s" in old.reason
    assert states["gpu-node-02:9835"].status is HostStatus.UP
    rows = [r for r in fleet_rows(fleet.states()) if r.host == "gpu-node-01:9835"]
    assert len(rows) == 1 and rows[0].memory_used is None and "stale" in rows[0].gpu


def test_an_up_host_turns_stale_in_a_later_round_when_prometheus_stops_scraping_it():
    """Catches a refresh that keeps an unchanged host's state without asking whether its
    last scrape has grown too old (a Prometheus that stopped scraping would show its hosts
    up, with numbers minutes old)."""
    answers = json.loads(json.dumps(ANSWERS))
    with fake_prometheus(recorded(answers)) as fake:
        fleet = _fleet(fake.url)
        fleet.refresh()
        assert [s.status for s in fleet.states()][:2] == [HostStatus.UP, HostStatus.UP]
        # two minutes later by Prometheus's clock, and no scrape since
        stamps = answers["queries"]['gputaskman_sample_timestamp_seconds{job="gputaskman"}']
        for r in stamps["data"]["result"]:
            r["value"][0] += 120
        fleet.refresh()
    assert [s.status for s in fleet.states()][:2] == [HostStatus.STALE, HostStatus.STALE]
    assert all("s old (over 3 s)" in s.reason for s in fleet.states()[:2])
