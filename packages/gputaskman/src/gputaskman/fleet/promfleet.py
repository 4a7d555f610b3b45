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
`PromError` text, one line) says why; ``--once`` and ``--json`` print it and exit 1. So does
a job Prometheus scrapes no target of (a mistyped ``--job``): the error names the jobs it has
(``/api/v1/label/job/values``).

`focus(name)` also polls that one host directly (`Poller`), with the token and TLS given: while
its ``/snapshot.json`` answers, the host's state is the live one (drilling into a host in the
TUI); while it does not, the state built from Prometheus's series, which says so in its notes,
and whose `reason` says what the host's own serve answered instead (``refused`` for a token
it did not take, ``unreachable``, ``waiting`` until the first poll).
"""

from __future__ import annotations

import dataclasses
import math
import re
import ssl
import threading
import time
from collections.abc import Sequence

from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fleet.poller import HostState, Poller
from gputaskman.fleet.promapi import PromClient, PromError, Sample, ScrapeTarget
from gputaskman.fleet.promdoc import host_document, snapshot_document
from gputaskman.fleet.promseries import (
    NOTE,
    TABLE_NOTE,
    TABLE_REGEX,
    TIMESTAMP,
    by_instance,
    host_sample,
)
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
        table_only: bool = False,
    ) -> None:
        self.client = client
        self.table_only = table_only  # read only the table's series (but the open host's all)
        self.job = job
        self.interval = interval
        self.timeout = client.timeout
        self.token = token  # for `focus`: the hosts' own serve
        self.tls = tls
        self.error: str | None = None  # why Prometheus did not answer the last round
        self.version = 0
        self._states: dict[str, HostState] = {}
        self._sample_at: dict[str, float] = {}
        self._scrape: dict[str, ScrapeTarget] = {}
        self._targets_read = -TARGETS_EVERY
        self._scraped: dict[str, float] = {}  # instance -> Prometheus's last scrape of it
        self._scraped_read = -TARGETS_EVERY
        self._scraped_every = 0.0  # seconds between reads of them (set with the targets)
        self._fresh_until: dict[str, float] = {}  # instance -> when an up host turns stale
        self._targets_ok = True
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gtm-fleet-prom", daemon=True)
        self._focus: Poller | None = None
        self._focus_name: str | None = None
        self._full_of: tuple[str, float | None] | None = None  # (host, sample) read whole
        sel = f"job={_quote(job)}"
        self.selector = sel
        self.note = NOTE.format(url=client.url, query=f"{{{sel}}}")
        self.table_note = TABLE_NOTE.format(url=client.url, query=f"{{{sel}}}")

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
        name = focus.targets[0].name
        if not live.up:  # the view stays the one built from series: say why
            why = f"its own /snapshot.json: {live.status}" + (
                f" ({live.reason})" if live.reason else ""
            )
            return tuple(
                dataclasses.replace(s, reason=why)
                if s.target.name == name and s.up and s.from_series
                else s
                for s in states
            )
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
            return self._changed.wait_for(lambda: self.version > 0, timeout=timeout)

    def focus(self, name: str | None) -> None:
        """Poll host `name` directly as well, and read all its series (None: stop), see the
        module docstring."""
        self._focus_name = name
        self._wake.set()
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
        up = {s.metric.get("instance", ""): s.value[1] for s in c.query(f"up{{{sel}}}").samples}
        up.pop("", None)
        if not up:
            raise PromError(self._no_targets())
        stamps = c.query(f"{TIMESTAMP}{{{sel}}}")
        now = stamps.at if stamps.at == stamps.at else time.time()
        if time.monotonic() - self._scraped_read >= self._scraped_every or any(
            i not in self._scraped for i in up
        ):
            self._scraped_read = time.monotonic()
            self._scraped = {
                s.labels.get("instance", ""): s.number
                for s in c.query(f"timestamp(up{{{sel}}})").samples
            }
        sample_at = {s.metric.get("instance", ""): s.value[1] for s in stamps.samples}
        changed = [i for i in up if i in sample_at and sample_at[i] != self._sample_at.get(i)]
        series: dict[str, list[Sample]] = {}
        everything = f'__name__=~"gputaskman_.+",{sel}'
        if changed:
            names = f"__name__=~{_quote(TABLE_REGEX)},{sel}" if self.table_only else everything
            if len(changed) < len(sample_at):  # else every host that has series
                names += f",instance=~{_quote(_regex_alternatives(changed))}"
            series = by_instance(c.query(f"{{{names}}}").samples)
        full: set[str] = set() if self.table_only else set(changed)
        name = self._focus_name
        if (
            self.table_only
            and name in sample_at
            and (name in changed or self._full_of != (name, sample_at[name]))
        ):
            series[name] = list(c.query(f"{{{everything},instance={_quote(name)}}}").samples)
            self._full_of = (name, sample_at[name])
            full.add(name)
        if (any(v != 1 for v in up.values()) or not self._scrape) and self._targets_due():
            self._read_targets()
        out: dict[str, HostState] = {}
        states, fresh_until = self._states, self._fresh_until
        for i in sorted(up):
            prev = states.get(i)
            if (
                prev is not None
                and up[i] == 1
                and i not in series
                and prev.status is HostStatus.UP
                and now <= fresh_until.get(i, -math.inf)
            ):
                out[i] = prev  # nothing about it changed: most hosts, most rounds
            else:
                out[i] = self._host(i, up[i], series.get(i), i in full, sample_at.get(i), now)
        return out

    def _no_targets(self) -> str:
        """Why the job has no host: the jobs Prometheus has, so a mistyped --job shows."""
        why = f"Prometheus scrapes no target of job {_quote(self.job)}"
        try:
            jobs = self.client.label_values("job")
        except PromError:  # a query front end may not serve it: the bare fact will do
            return why
        if not jobs:
            return f"{why}, nor of any other job"
        shown = ", ".join(_quote(j) for j in jobs[:20]) + (", ..." if len(jobs) > 20 else "")
        return f"{why} (--job); its jobs: {shown}"

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
        # the hosts' last scrape times are read again often enough that one read late never
        # makes a host look stale: a third of the shortest stale limit
        shortest = min(
            (t.interval_s or DEFAULT_SCRAPE_INTERVAL for t in self._scrape.values()), default=0.0
        )
        self._scraped_every = min(TARGETS_EVERY, STALE_SCRAPES * shortest / 3)

    def _host(
        self,
        instance: str,
        up: float,
        series: list[Sample] | None,
        whole: bool,
        sample_at: float | None,
        now: float,
    ) -> HostState:
        """The host's new state; the same object when nothing about it changed, so that
        views can keep what they built from it."""
        info = self._scrape.get(instance)
        prev = self._states.get(instance) or HostState(
            target_of(instance, info.scrape_url if info else "")
        )
        new = prev
        if up == 1 and series is not None:
            note = self.note if whole else self.table_note
            snap, system = host_sample(series, note=note)
            # the table's series are not the host sample's: only a host read whole has one
            host = system if whole else None
            # the table needs the typed document only; --json and record write the bytes
            if self.table_only:
                doc, body = snapshot_document(snap, host), None
            else:
                doc, body = host_document(snap, host)
            self._sample_at[instance] = sample_at if sample_at is not None else 0.0
            new = dataclasses.replace(
                prev,
                document=doc,
                body=body,
                seq=prev.seq + 1,
                from_series=True,
                whole=whole,
                answered_at=sample_at,
            )
        status, why = self._status(instance, up, info, new, now)
        if (status, why) == (prev.status, prev.reason) and new is prev:
            return prev
        return dataclasses.replace(
            new, status=status, reason=why, polls=prev.polls + 1, next_poll_in_s=None
        )

    def _status(
        self, instance: str, up: float, info: ScrapeTarget | None, s: HostState, now: float
    ) -> tuple[HostStatus, str | None]:
        if up != 1:
            if info is not None and info.last_error:
                why = f"Prometheus cannot scrape it: {info.last_error}"
                return scrape_failure(info.last_error), why
            return HostStatus.ERROR, "Prometheus's scrape fails (up == 0)"
        if s.document is None:
            return (
                HostStatus.INCOMPATIBLE,
                "scraped, but it exports no gputaskman series (not gputaskman serve?)",
            )
        limit = STALE_SCRAPES * (
            info.interval_s if info and info.interval_s else DEFAULT_SCRAPE_INTERVAL
        )
        last = self._scraped.get(instance)
        if last is not None and now - last > limit:
            return (
                HostStatus.STALE,
                f"Prometheus's last scrape of it is {now - last:.0f} s old (over {limit:g} s)",
            )
        # up until then at least, unless a round brings it something new
        self._fresh_until[instance] = math.inf if last is None else last + limit
        return HostStatus.UP, None
