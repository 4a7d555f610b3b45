"""The fleet document: what ``gputaskman fleet --json`` prints and each line of
``gputaskman fleet record`` holds; the names of a host's states, the envelope's writer, and
the reading of the envelope back (the snapshots inside are read by `reader.read_document`).

Shape (``schema_version`` 1; new keys are additive)::

    {
      "schema": "gputaskman.fleet", "schema_version": 1,
      "tool": {"name": "gputaskman", "version": "..."},
      "taken": 1796000000.0, "taken_iso": "2026-...Z",     # when this round was written
      "interval_s": 1.0, "timeout_s": 2.0,                 # how the hosts were polled
      "summary": {...},                                    # derived (fleet.view); not read back
      "hosts": [
        {
          "name": "gpu1",                  # as the user named it (unique in the document)
          "address": "gpu1:9835",
          "url": "http://gpu1:9835/snapshot.json",
          "status": "up",                  # one of STATUSES
          "reason": null,                  # why not up, in words (null when up)
          "latency_s": 0.004,              # of the last answer (null: none yet)
          "answered": 1796000000.1,        # when the last answer arrived (null: none yet)
          "snapshot": {...} | null         # a gputaskman.snapshot document, or null
        }
      ]
    }

``snapshot`` holds a host's document exactly as its ``serve`` answered it (it passed
`read_document`). In ``--json`` it is the last answer (null when the host never answered);
in a record line it is an answer not written in an earlier line, so each snapshot is in the
file once and per-host tools (``summary``, ``diff``, ``replay`` with ``--host``) see a host's
samples, never the same one twice. A host that was down in a round has a null snapshot and
its status says why: never zeros.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from gputaskman import __version__
from gputaskman.document.jsonfields import SnapshotError, is_number

NAME = "gputaskman.fleet"
VERSION = 1


class HostStatus(StrEnum):
    UP = "up"  # its last poll read a document
    WAITING = "waiting"  # not polled yet
    STARTING = "starting"  # its serve has no sample yet (HTTP 503)
    UNREACHABLE = "unreachable"  # no connection (refused, no route, no name, timed out)
    SLOW = "slow"  # connected, but no whole answer within the timeout
    REFUSED = "refused"  # the token or the TLS certificate was not accepted
    INCOMPATIBLE = "incompatible"  # not a snapshot this version reads (schema, version, size)
    ERROR = "error"  # any other failed answer (an HTTP error status, a broken answer)
    STALE = "stale"  # read from Prometheus, whose last sample of it is too old


STATUSES = frozenset(s.value for s in HostStatus)


def utc_iso(t: float) -> str | None:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    except (OverflowError, OSError, ValueError):
        return None


def host_json(
    *,
    name: str,
    address: str,
    url: str,
    status: HostStatus,
    reason: str | None,
    latency_s: float | None,
    answered: float | None,
    snapshot: Mapping[str, Any] | None,
) -> dict[str, Any]:
    return {
        "name": name,
        "address": address,
        "url": url,
        "status": str(status),
        "reason": reason,
        "latency_s": latency_s,
        "answered": answered,
        "snapshot": snapshot,
    }


def fleet_json(
    hosts: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    *,
    taken: float,
    interval_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """The fleet document (see the module docstring); `hosts` from `host_json`."""
    return {
        "schema": NAME,
        "schema_version": VERSION,
        "tool": {"name": "gputaskman", "version": __version__},
        "taken": taken,
        "taken_iso": utc_iso(taken),
        "interval_s": interval_s,
        "timeout_s": timeout_s,
        "summary": dict(summary),
        "hosts": list(hosts),
    }


def is_fleet(doc: object) -> bool:
    """Whether `doc` claims to be a fleet document (`check_fleet` says whether it is one)."""
    return isinstance(doc, dict) and doc.get("schema") == NAME


def check_fleet(doc: object) -> dict[str, Any]:
    """The document when its envelope is a schema-1 fleet document, else `SnapshotError`
    naming what is wrong. The snapshots inside are not read here."""
    if not isinstance(doc, dict) or doc.get("schema") != NAME:
        raise SnapshotError(f"not a {NAME} object")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SnapshotError(f"schema_version {version!r} is not an integer")
    if version != VERSION:
        raise SnapshotError(
            f"fleet schema_version {version} is not supported (this gputaskman reads {VERSION})"
        )
    if not is_number(doc.get("taken")):
        raise SnapshotError(f"taken {doc.get('taken')!r} is not a finite number")
    hosts = doc.get("hosts")
    if not isinstance(hosts, list):
        raise SnapshotError("hosts is missing or not a list")
    seen = set()
    for i, h in enumerate(hosts):
        if not isinstance(h, dict):
            raise SnapshotError(f"hosts[{i}]: not an object")
        name = h.get("name")
        if not isinstance(name, str) or not name:
            raise SnapshotError(f"hosts[{i}].name: not a non-empty string")
        if name in seen:
            raise SnapshotError(f"hosts[{i}].name: {name!r} is listed twice")
        seen.add(name)
        if h.get("status") not in STATUSES:
            raise SnapshotError(f"hosts[{i}].status: {h.get('status')!r} is not a host status")
        for key in ("reason", "address", "url"):
            if h.get(key) is not None and not isinstance(h[key], str):
                raise SnapshotError(f"hosts[{i}].{key}: not a string or null")
        for key in ("latency_s", "answered"):
            if h.get(key) is not None and not is_number(h[key]):
                raise SnapshotError(f"hosts[{i}].{key}: not a finite number or null")
        if h.get("snapshot") is not None and not isinstance(h["snapshot"], dict):
            raise SnapshotError(f"hosts[{i}].snapshot: not an object or null")
    return doc


def host_names(doc: Mapping[str, Any]) -> list[str]:
    """The hosts of a checked fleet document, in its order."""
    return [h["name"] for h in doc["hosts"]]


def host_entry(doc: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """Host `name`'s entry of a checked fleet document (None: not listed)."""
    return next((h for h in doc["hosts"] if h["name"] == name), None)


def why_no_snapshot(entry: Mapping[str, Any]) -> str:
    """A host entry without a snapshot, in words: its status and reason."""
    reason = entry.get("reason")
    if entry.get("status") == HostStatus.UP:
        return "up, no new answer in this round"
    return f"{entry.get('status')}" + (f" ({reason})" if reason else "")
