"""The fleet written out: the fleet document of the poller's states (``fleet --json``) and
``fleet record FILE``, one fleet document per round appended to a JSON Lines file; and such
a document read back as host states (`states_of`), to show a saved fleet.

Theory of operation
-------------------
`fleet_document` is `document.fleetdoc.fleet_json` of the states: every host with its status,
reason, latency and last answer time, the fleet totals (`view.totals_json`), and each
host's snapshot as its serve answered it (`HostState.body`, parsed again: ``--json`` runs
once). There it is the host's current document (null when it is not up).

`fleet_line` is the same document as one record line, written every round: each snapshot is
the validated bytes spliced in, not parsed and encoded again (a raw CR or LF byte in valid
JSON is only whitespace, so it becomes a space and the line stays one line; a body with
non-ASCII bytes, which no serve writes, is encoded again to keep record lines ASCII). A
record line holds only answers that no earlier line holds (`FleetRecorder` keeps, per host,
the `HostState.seq` it last wrote), so a host's snapshot is in the file once, and a round in
which a host was down or had no new answer says so in its status, with a null snapshot,
never a repeated or zeroed one: an answer that arrived between two rounds from a host that is
down at the second is not written (a line's snapshots are of the hosts up in it, the ones its
summary counts), unless the host is up with it again at a later round.

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

from gputaskman.document import fleetdoc
from gputaskman.document.fleetdoc import HostStatus, fleet_json, host_json
from gputaskman.document.jsonfields import parse_json
from gputaskman.document.reader import SnapshotError, read_document
from gputaskman.fleet.poller import HostState
from gputaskman.fleet.source import FleetSource
from gputaskman.fleet.targets import TargetError, parse_target
from gputaskman.fleet.view import fleet_totals, totals_json
from gputaskman.offline.record import (
    RecordResult,
    encode_line,
    paced,
    stops_held,
    write_line,
)


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
        body = None if raw is None else encode_line(raw).rstrip(b"\n")
        status = HostStatus(h["status"])
        out.append(
            HostState(
                target,
                status,
                h.get("reason"),
                document,
                body,
                h.get("answered"),
                h.get("latency_s"),
                seq=int(raw is not None),
                polls=int(status is not HostStatus.WAITING),
            )
        )
    return tuple(out)


def fleet_document(
    states: Sequence[HostState], *, interval: float, timeout: float, taken: float | None = None
) -> dict[str, Any]:
    """The fleet document of `states`, each up host's snapshot parsed from its `body`."""
    snaps = [parse_json(s.body) if s.up and s.body is not None else None for s in states]
    return _document(states, snaps, interval, timeout, taken)


def fleet_line(
    states: Sequence[HostState],
    *,
    interval: float,
    timeout: float,
    written: Mapping[str, int],
    taken: float | None = None,
) -> bytes:
    """The fleet document of `states` as one record line (see the module docstring): a
    host's snapshot only when it is up and its `seq` is newer than `written` (host -> the
    `seq` already in the file), its bytes spliced in."""
    doc = _document(states, [None] * len(states), interval, timeout, taken)
    hosts = doc.pop("hosts")
    doc["hosts"] = []  # last, so its entries go just before the closing "]}"
    parts = [encode_line(doc)[: -len(b"]}\n")]]
    for i, (s, h) in enumerate(zip(states, hosts, strict=True)):
        h.pop("snapshot")
        h["snapshot"] = None  # last: its null is the last bytes before the closing "}"
        entry = encode_line(h)[: -len(b"null}\n")]
        snap = b"null"
        if s.up and s.body is not None and s.seq > written.get(s.target.name, 0):
            snap = _line_safe(s.body)
        parts += [b"," if i else b"", entry, snap, b"}"]
    parts.append(b"]}\n")
    return b"".join(parts)


def _line_safe(body: bytes) -> bytes:
    """A validated JSON body as bytes fit for one ASCII record line."""
    if not body.isascii():
        return encode_line(parse_json(body)).rstrip(b"\n")
    if b"\n" in body or b"\r" in body:
        return body.replace(b"\n", b" ").replace(b"\r", b" ")  # only whitespace in JSON
    return body


def _document(
    states: Sequence[HostState],
    snapshots: Sequence[Mapping[str, Any] | None],
    interval: float,
    timeout: float,
    taken: float | None,
) -> dict[str, Any]:
    hosts = [
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
        for s, snap in zip(states, snapshots, strict=True)
    ]
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
        poller: FleetSource,
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
        line = fleet_line(
            states, interval=self.interval, timeout=self.poller.timeout, written=self.written
        )
        with stops_held():  # a stop between the write and its bookkeeping would lose it
            write_line(self.fd, line)
            for s in states:
                if s.up:  # a down host's newer answer is written if it is up with it again
                    self.written[s.target.name] = s.seq
            self.result.samples += 1
        if self.on_line:
            self.on_line(self.result)

    def run(self) -> RecordResult:
        try:
            self.poller.wait_polled(self.poller.timeout + self.interval)
        except KeyboardInterrupt:
            self.result.stopped_by = "interrupt"
            return self.result
        # the rounds count from the first line, not from the wait
        return paced(
            self.write_round,
            self.result,
            interval=self.interval,
            count=self.count,
            duration=self.duration,
            clock=self.clock,
            sleep=self.sleep,
        )
