"""The fleet written out: the fleet document of the poller's states (``fleet --json``) and
``fleet record FILE``, one fleet document per round appended to a JSON Lines file; and such
a document read back as host states (`states_of`), to show a saved fleet.

Theory of operation
-------------------
`fleet_document` is `core.fleetdoc.fleet_json` of the states: every host with its status,
reason, latency and last answer time, the fleet totals (`view.totals_json`), and each
host's snapshot exactly as its serve answered it. For ``--json`` that is the host's current
document (null when it is not up). For a record line it is an answer that no earlier line
holds (`FleetRecorder` keeps, per host, the `HostState.seq` it last wrote), so a host's
snapshot is in the file once, and a round in which a host was down or had no new answer
says so in its status, with a null snapshot, never a repeated or zeroed one.

`FleetRecorder` writes a line once every host has been polled (or the poll timeout has
passed), then one line every `interval`, with the single-host recorder's guarantees
(`offline.record`): each line is written whole or not at all, Ctrl+C / SIGTERM / SIGHUP stop
between lines, a torn last line from a killed recorder is ended before appending, and a
file that is not a fleet record is never appended to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gputaskman.core import fleetdoc
from gputaskman.core.document import SnapshotError, read_document
from gputaskman.core.fleetdoc import HostStatus, fleet_json, host_json
from gputaskman.fleet.poller import HostState, Poller
from gputaskman.fleet.targets import TargetError, parse_target
from gputaskman.fleet.view import fleet_totals, totals_json
from gputaskman.offline.record import RecordError, RecordResult, encode_line, write_line


def states_of(doc: Mapping[str, Any]) -> tuple[HostState, ...]:
    """The host states a fleet document holds, each snapshot read by `read_document` (to
    show a saved fleet: screenshots, tests). `SnapshotError` when it is not one."""
    fleetdoc.check_fleet(doc)
    out = []
    for i, h in enumerate(doc["hosts"]):
        try:
            target = dataclasses.replace(
                parse_target(h.get("address") or h["name"]), name=h["name"]
            )
        except TargetError as exc:
            raise SnapshotError(f"hosts[{i}].address: {exc}") from None
        raw = h["snapshot"]
        document = None if raw is None else read_document(raw)
        status = HostStatus(h["status"])
        out.append(
            HostState(
                target,
                status,
                h.get("reason"),
                document,
                raw,
                h.get("answered"),
                h.get("latency_s"),
                seq=int(raw is not None),
                polls=int(status is not HostStatus.WAITING),
            )
        )
    return tuple(out)


def fleet_document(
    states: Sequence[HostState],
    *,
    interval: float,
    timeout: float,
    written: Mapping[str, int] | None = None,
    taken: float | None = None,
) -> dict[str, Any]:
    """The fleet document of `states`. With `written` (host -> the `seq` already in the
    file), a host's snapshot is included only when it is newer than that."""
    hosts = []
    for s in states:
        if written is None:
            snap = s.raw if s.up else None
        else:
            snap = s.raw if s.raw is not None and s.seq > written.get(s.target.name, 0) else None
        hosts.append(
            host_json(
                name=s.target.name,
                address=s.target.address,
                url=s.target.url,
                status=s.status,
                reason=s.reason,
                latency_s=s.latency_s,
                answered=s.answered_at,
                snapshot=snap,
            )
        )
    return fleet_json(
        hosts,
        totals_json(fleet_totals(states)),
        taken=time.time() if taken is None else taken,
        interval_s=interval,
        timeout_s=timeout,
    )


class FleetRecorder:
    """Appends one fleet line per round to `fd` (see the module docstring). Stops after
    `count` lines, once `duration` seconds have passed, or on KeyboardInterrupt."""

    def __init__(
        self,
        fd: int,
        poller: Poller,
        *,
        interval: float,
        count: int | None = None,
        duration: float | None = None,
        on_line: Callable[[RecordResult], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.fd = fd
        self.poller = poller
        self.interval = interval
        self.count = count
        self.duration = duration
        self.on_line = on_line
        self.clock = clock
        self.sleep = sleep
        self.written: dict[str, int] = {}
        self.result = RecordResult()

    def write_round(self) -> None:
        states = self.poller.states()
        doc = fleet_document(
            states, interval=self.interval, timeout=self.poller.timeout, written=self.written
        )
        write_line(self.fd, encode_line(doc))
        for s in states:
            self.written[s.target.name] = s.seq
        self.result.samples += 1
        if self.on_line:
            self.on_line(self.result)

    def run(self) -> RecordResult:
        try:
            self.poller.wait_polled(self.poller.timeout + self.interval)
            start = self.clock()  # the rounds count from the first line, not from the wait
            tick = 0
            while True:
                self.write_round()
                if self.count is not None and self.result.samples >= self.count:
                    self.result.stopped_by = "count"
                    break
                tick += 1
                next_at = start + tick * self.interval
                if self.duration is not None and next_at - start >= self.duration:
                    self.result.stopped_by = "duration"
                    break
                wait = next_at - self.clock()
                if wait > 0:
                    self.sleep(wait)
        except KeyboardInterrupt:
            self.result.stopped_by = "interrupt"
        except RecordError as exc:
            self.result.stopped_by = "error"
            self.result.errors.append(str(exc))
        return self.result
