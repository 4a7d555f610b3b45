"""The fleet read from Prometheus (``fleet --prometheus URL``): every host that Prometheus
scrapes for the job, as the same `HostState`s the direct poller publishes, so the fleet
table, ``--once``, ``--json`` and ``fleet record`` work unchanged.

Theory of operation
-------------------
One thread asks Prometheus once every `interval` seconds, with instant queries:

1. ``up{job=J}`` and ``timestamp(up{job=J})``: every host Prometheus scrapes for the job,
   whether its last scrape worked, and when that was;
2. ``gputaskman_sample_timestamp_seconds{job=J}``: which sample each host's serve last
   exported, one series per host;
3. every ``gputaskman_*`` series of only the hosts whose sample changed since the last round
   (all of them the first time): a refresh costs what changed, not the fleet's size.

Each changed host's series become its snapshot document (`promseries`), read by the same
reader as a polled host's: `seq` moves only when the sample did, so a recorder writes each
sample once.

A host is `up` while its scrape works and Prometheus's last scrape of it is recent. Otherwise
it keeps its last document, as a polled host does, and its status says why, never zeros:

* ``up == 0``: the scrape fails. The reason is Prometheus's own (``lastError`` from
  ``/api/v1/targets``, read at most every `TARGETS_EVERY` seconds, and only when a host is
  down or to learn the scrape intervals); a refused token is `refused`, a refused
  connection `unreachable`, a scrape timeout `slow`, anything else `error`. A server that
  does not serve the targets endpoint (a Thanos or Mimir query front end) gives the bare
  fact: "Prometheus's scrape fails (up == 0)".
* `stale`: the last scrape is older than `STALE_SCRAPES` scrape intervals (the target's, when
  ``/api/v1/targets`` gives it, else `DEFAULT_SCRAPE_INTERVAL`). (A serve's own sample may
  be older than that when it samples less often than it is scraped: that is not stale.)
* `incompatible`: scraped, but it exports no ``gputaskman_*`` series.

When Prometheus itself cannot answer, every host keeps its state and `error` (the
`PromError` text, one line) says why; ``--once`` and ``--json`` print it and exit 1.

`focus(name)` also polls that one host directly (`Poller`), with the token and TLS given: while
its ``/snapshot.json`` answers, the host's state is the live one (drilling into a host in the
TUI); while it does not, the state built from Prometheus's series, which says so in its notes.
"""

from __future__ import annotations

import dataclasses
import re
import ssl
import threading
import time
from collections.abc import Sequence

from gputaskman.core.fleetdoc import HostStatus
from gputaskman.fleet.poller import HostState, Poller
from gputaskman.fleet.promapi import PromClient, PromError, Sample, ScrapeTarget
from gputaskman.fleet.promseries import NOTE, TIMESTAMP, by_instance, host_document, host_snapshot
from gputaskman.fleet.targets import DEFAULT_PORT, Target, TargetError, parse_target

DEFAULT_JOB = "gputaskman"
DEFAULT_SCRAPE_INTERVAL = 60.0  # Prometheus's own default
STALE_SCRAPES = 3
TARGETS_EVERY = 10.0


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _regex_alternatives(names: Sequence[str]) -> str:
    # RE2, anchored by Prometheus: each name matched literally
    return "|".join(re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", n) for n in sorted(names))


def scrape_failure(last_error: str) -> HostStatus:
    """The host status Prometheus's ``lastError`` text stands for."""
    e = last_error.lower()
    if "401" in e or "403" in e or "unauthorized" in e or "forbidden" in e:
        return HostStatus.REFUSED
    if "deadline exceeded" in e or "timeout" in e:
        return HostStatus.SLOW
    if "503" in e:
        return HostStatus.STARTING
    if any(w in e for w in ("connection refused", "no such host", "no route", "unreachable")):
        return HostStatus.UNREACHABLE
    return HostStatus.ERROR


def target_of(instance: str, scrape_url: str = "") -> Target:
    """The host an ``instance`` label names, reachable as its scrape URL says."""
    tls = scrape_url.startswith("https://")
    try:
        t = parse_target(("https://" if tls else "") + instance)
    except TargetError:
        return Target(instance, instance, DEFAULT_PORT, tls)
    return dataclasses.replace(t, name=instance)


class PromFleet:
    """The fleet as Prometheus sees it, refreshed on a background thread (see the module
    docstring). It has the direct poller's reading side: `states`, `version`, `poll_now`,
    `wait_polled`, `interval`, `timeout`, `start` and `stop`."""

    def __init__(
        self,
        client: PromClient,
        *,
        job: str = DEFAULT_JOB,
        interval: float = 1.0,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.client = client
        self.job = job
        self.interval = interval
        self.timeout = client.timeout
        self.token = token  # for `focus`: the hosts' own serve
        self.tls = tls
        self.error: str | None = None  # why Prometheus did not answer the last round
        self.rounds = 0
        self.version = 0
        self._states: dict[str, HostState] = {}
        self._sample_at: dict[str, float] = {}
        self._scrape: dict[str, ScrapeTarget] = {}
        self._targets_read = -TARGETS_EVERY
        self._targets_ok = True
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gtm-fleet-prom", daemon=True)
        self._focus: Poller | None = None
        sel = f"job={_quote(job)}"
        self.selector = sel
        self.note = NOTE.format(url=client.url, query=f"{{{sel}}}")

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(s.target for s in self.states())

    @property
    def origin(self) -> str:
        return f"from Prometheus {self.client.url}, job {self.job}"

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    # -- the reading side (any thread)

    def states(self) -> tuple[HostState, ...]:
        states = tuple(self._states.values())
        focus = self._focus
        if focus is None:
            return states
        live = focus.states()[0]
        if not live.up:
            return states
        name = focus.targets[0].name
        return tuple(
            dataclasses.replace(live, target=s.target) if s.target.name == name else s
            for s in states
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.focus(None)
        self.client.close()

    def poll_now(self) -> None:
        self._wake.set()
        if self._focus is not None:
            self._focus.poll_now()

    def wait_polled(self, timeout: float) -> bool:
        """Wait until Prometheus has answered (or failed) once (True), or `timeout`."""
        with self._changed:
            return self._changed.wait_for(lambda: self.rounds > 0, timeout=timeout)

    def focus(self, name: str | None) -> None:
        """Poll host `name` directly as well (None: stop), see the module docstring."""
        old, self._focus = self._focus, None
        if old is not None:
            old.stop()
        state = self._states.get(name) if name is not None else None
        if state is None:
            return
        poller = Poller(
            [state.target],
            interval=self.interval,
            timeout=self.timeout,
            token=self.token,
            tls=self.tls,
        )
        poller.start()
        self._focus = poller

    # -- the thread

    def _run(self) -> None:
        while not self._stopping:
            started = time.monotonic()
            self.refresh()
            self._wake.wait(max(0.0, self.interval - (time.monotonic() - started)))
            self._wake.clear()

    def refresh(self) -> None:
        """One round (see the module docstring); publishes the new states."""
        try:
            states = self._round()
            error = None
        except PromError as exc:
            states, error = self._failed(str(exc)), str(exc)
        with self._changed:
            self._states = states
            self.error = error
            self.rounds += 1
            self.version += 1
            self._changed.notify_all()

    def _failed(self, why: str) -> dict[str, HostState]:
        return {
            n: dataclasses.replace(
                s, status=HostStatus.ERROR, reason=f"Prometheus: {why}", polls=s.polls + 1
            )
            for n, s in self._states.items()
        }

    def _round(self) -> dict[str, HostState]:
        c, sel = self.client, self.selector
        up = {s.labels.get("instance", ""): s.value for s in c.query(f"up{{{sel}}}").samples}
        up.pop("", None)
        scraped = by_instance(c.query(f"timestamp(up{{{sel}}})").samples)
        stamps = c.query(f"{TIMESTAMP}{{{sel}}}")
        now = stamps.at if stamps.at == stamps.at else time.time()
        sample_at = {k: v[0].value for k, v in by_instance(stamps.samples).items()}
        changed = [i for i in up if i in sample_at and sample_at[i] != self._sample_at.get(i)]
        series: dict[str, list[Sample]] = {}
        if changed:
            names = f'__name__=~"gputaskman_.+",{sel}'
            if len(changed) < len(sample_at):  # else every host that has series
                names += f",instance=~{_quote(_regex_alternatives(changed))}"
            series = by_instance(c.query(f"{{{names}}}").samples)
        if (any(v != 1 for v in up.values()) or not self._scrape) and self._targets_due():
            self._read_targets()
        out: dict[str, HostState] = {}
        for instance in sorted(up):
            out[instance] = self._host(
                instance,
                up[instance],
                scraped.get(instance, [None])[0],
                series.get(instance),
                sample_at.get(instance),
                now,
            )
        return out

    def _targets_due(self) -> bool:
        return self._targets_ok and time.monotonic() - self._targets_read >= TARGETS_EVERY

    def _read_targets(self) -> None:
        self._targets_read = time.monotonic()
        try:
            found = self.client.targets()
        except PromError:
            self._targets_ok = False  # a query front end: the bare facts will do
            return
        self._scrape = {
            t.labels.get("instance", ""): t for t in found if t.labels.get("job") == self.job
        }

    def _host(
        self,
        instance: str,
        up: float,
        scraped: Sample | None,
        series: list[Sample] | None,
        sample_at: float | None,
        now: float,
    ) -> HostState:
        info = self._scrape.get(instance)
        prev = self._states.get(instance) or HostState(
            target_of(instance, info.scrape_url if info else "")
        )
        polls = prev.polls + 1
        last_scrape = None if scraped is None else scraped.value
        if up != 1:
            if info is not None and info.last_error:
                status = scrape_failure(info.last_error)
                why = f"Prometheus cannot scrape it: {info.last_error}"
            else:
                status, why = HostStatus.ERROR, "Prometheus's scrape fails (up == 0)"
            return dataclasses.replace(
                prev, status=status, reason=why, polls=polls, next_poll_in_s=None
            )
        if series is not None:
            doc, body = host_document(host_snapshot(series, note=self.note))
            self._sample_at[instance] = sample_at if sample_at is not None else 0.0
            prev = dataclasses.replace(
                prev, document=doc, body=body, seq=prev.seq + 1, from_series=True
            )
        elif sample_at is None or prev.document is None:
            return dataclasses.replace(
                prev,
                status=HostStatus.INCOMPATIBLE,
                reason="scraped, but it exports no gputaskman series (not gputaskman serve?)",
                polls=polls,
            )
        limit = STALE_SCRAPES * (
            info.interval_s if info and info.interval_s else DEFAULT_SCRAPE_INTERVAL
        )
        if last_scrape is not None and now - last_scrape > limit:
            age = now - last_scrape
            why = f"Prometheus's last scrape of it is {age:.0f} s old (over {limit:g} s)"
            return dataclasses.replace(
                prev, status=HostStatus.STALE, reason=why, polls=polls, answered_at=last_scrape
            )
        return dataclasses.replace(
            prev,
            status=HostStatus.UP,
            reason=None,
            answered_at=last_scrape,
            latency_s=None,
            polls=polls,
            failures=0,
            next_poll_in_s=None,
        )
