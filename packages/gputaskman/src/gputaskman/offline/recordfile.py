"""Reading record files and saved ``--json`` snapshots back, without trusting them.

Theory of operation
-------------------
A record file is JSON Lines: `record.py` appends one compact ``--json`` object per sample,
each ended by a newline and written with one ``write`` call. Readers (`replay`, `summary`)
go through `iter_record`, which classifies every line:

* a complete line (it ends with a newline) holding a snapshot object: an `Entry` with the
  parsed document, its line number and its byte offset (so replay can re-read it later
  instead of keeping every document in memory);
* a complete line that is anything else (bad JSON, bad UTF-8, not an object, another
  schema, a newer schema version, no finite ``taken``, too long): an `Entry` with ``doc``
  None and ``error`` saying why. Callers skip it and report it with its line number;
* the last line when it has no newline: what a writer killed mid-write leaves. It is
  marked ``incomplete`` and skipped quietly, unless it parses as a whole snapshot (only
  the newline was lost), in which case it is used like any other line.

Lines are read as bytes and decoded one at a time, so one bad byte spoils one line, never
the file; a line longer than `MAX_LINE_BYTES` is skipped without being held in memory.
JSON's non-standard ``NaN``/``Infinity`` are rejected: unknown is ``null``, never a
sentinel. Each line's top-level shape is checked here (`reader.check_snapshot`); the rest
is read by `reader.read_document` when a line is used. `load_snapshot_file` reads a single
saved snapshot (``--json`` output, indented or compact) for `diff`; `iter_record` reads one
too, as a record of one sample (an indented document is parsed whole when its first line
is a lone ``{``).

Fleet files. A line of ``gputaskman fleet record`` (or the output of ``fleet --json``) is a
fleet document (`document.fleetdoc`) holding one snapshot per host. Read with ``host=NAME``, each
such line is that host's snapshot: a line where the host has none (it was down, or had no
new answer) is passed over quietly (it is not malformed: the host simply has no sample
there), and a host no line names yields nothing. Read with ``every_host=True``, each host's
snapshot in a line is an `Entry` of its own, with `Entry.host` set (summary's per-host
sections, in one pass). Read with neither, a fleet line is reported as needing a host.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gputaskman.base import schema
from gputaskman.document import fleetdoc
from gputaskman.document.jsonfields import parse_json
from gputaskman.document.reader import SnapshotError, check_snapshot

# A snapshot of a thousand processes with long command lines is a few MB; anything far
# beyond that is not a line record wrote, and must not be loaded whole.
MAX_LINE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a record file. Exactly one of `doc` and `error` is set."""

    lineno: int  # 1-based
    offset: int  # byte offset of the line's first byte
    length: int  # bytes, including the newline when present
    doc: dict[str, Any] | None
    error: str | None = None
    incomplete: bool = False  # the last line, without its newline, and not a whole snapshot
    host: str | None = None  # the host whose snapshot this is, in a fleet file

    @property
    def ok(self) -> bool:
        return self.doc is not None

    @property
    def taken(self) -> float:
        """When the snapshot was taken (`check_snapshot` made sure it is a number)."""
        if self.doc is None:
            raise SnapshotError(f"line {self.lineno} holds no snapshot: {self.error}")
        return float(self.doc["taken"])


def parse_line(raw: bytes, host: str | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(document, None) or (None, why) for one line's bytes (newline stripped or not). With
    `host`, a fleet line gives that host's snapshot, and (None, None) when it holds none."""
    doc, error = _parse_object(raw)
    if doc is None:
        return None, error
    if fleetdoc.is_fleet(doc):
        try:
            fleetdoc.check_fleet(doc)
        except SnapshotError as exc:
            return None, str(exc)
        if host is None:
            names = ", ".join(fleetdoc.host_names(doc)[:8])
            return None, f"a fleet line: name one of its hosts with --host ({names})"
        return host_snapshot(doc, host)
    if host is not None:
        return None, f"not a fleet line, and --host {host} names a host of a fleet record"
    try:
        return check_snapshot(doc), None
    except SnapshotError as exc:
        return None, str(exc)


def _parse_object(raw: bytes) -> tuple[Any, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return None, "empty line"
    try:
        value = parse_json(text)
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON ({exc})"
    if value is None:  # a JSON null: a line that must be reported, not taken for no line
        return None, "not a JSON object but null"
    return value, None


def host_snapshot(fleet: dict[str, Any], host: str) -> tuple[dict[str, Any] | None, str | None]:
    """Host `host`'s snapshot in a checked fleet document: (snapshot, None); (None, None)
    when the host is not listed or has none there; (None, why) when it is not a snapshot."""
    entry = fleetdoc.host_entry(fleet, host)
    if entry is None or entry.get("snapshot") is None:
        return None, None
    try:
        return check_snapshot(entry["snapshot"]), None
    except SnapshotError as exc:
        return None, f"host {host}: {exc}"


def _read_line(f: IO[bytes]) -> tuple[bytes, int, bool]:
    """(bytes kept, total length, too long). A too-long line is consumed, not kept."""
    raw = f.readline(MAX_LINE_BYTES + 1)
    if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
        return raw, len(raw), False
    total = len(raw)
    while raw and not raw.endswith(b"\n"):
        raw = f.readline(1024 * 1024)
        total += len(raw)
    return raw[-1:], total, True  # keep only the newline (if any) to mark completeness


def _whole_snapshot(f: IO[bytes], host: str | None, every_host: bool) -> list[Entry] | None:
    """An indented ``--json`` or ``fleet --json`` document (one over many lines) as its
    entries, or None (the stream is left where it was) when the stream is not that."""
    if not f.seekable():
        return None
    start = f.tell()
    first = f.readline(4096)
    if first.strip() == b"{":  # compact snapshots and record lines are whole on line 1
        whole = first + f.read(MAX_LINE_BYTES + 1 - len(first))
        if len(whole) <= MAX_LINE_BYTES:
            if every_host:
                got = _every_host(whole, 1, start, len(whole), True)
                if any(e.doc is not None for e in got):
                    return got
            else:
                doc, error = parse_line(whole, host)
                if doc is not None:
                    return [Entry(1, start, len(whole), doc)]
                if error is None:  # a fleet document without a snapshot of this host
                    return []
    f.seek(start)
    return None


def iter_record(
    f: IO[bytes], host: str | None = None, *, every_host: bool = False
) -> Iterator[Entry]:
    """Every line of a binary record stream, classified (see the module docstring). A single
    indented snapshot (``gputaskman --json > f``) is read as one entry."""
    single = _whole_snapshot(f, host, every_host)
    if single is not None:
        yield from single
        return
    offset = 0
    lineno = 0
    while True:
        raw, length, too_long = _read_line(f)
        if length == 0:
            return
        lineno += 1
        complete = raw.endswith(b"\n")
        body = raw[:-1] if complete else raw
        if too_long:
            error = f"line longer than {MAX_LINE_BYTES} bytes"
            yield Entry(lineno, offset, length, None, error, incomplete=not complete)
        elif every_host:
            yield from _every_host(body, lineno, offset, length, complete)
        else:
            doc, error = parse_line(body, host)
            if doc is not None or error is not None:
                incomplete = not complete and doc is None
                if incomplete:
                    error = f"incomplete last line ({length} bytes, no newline): {error}"
                yield Entry(lineno, offset, length, doc, error, incomplete)
        offset += length


def _every_host(body: bytes, lineno: int, offset: int, length: int, complete: bool) -> list[Entry]:
    """One line read with ``every_host``: an entry per host snapshot of a fleet line; a plain
    snapshot line or an unreadable line as one entry."""
    doc, error = _parse_object(body)
    if doc is not None and fleetdoc.is_fleet(doc):
        try:
            fleetdoc.check_fleet(doc)
        except SnapshotError as exc:
            doc, error = None, str(exc)
        else:
            out = []
            for name in fleetdoc.host_names(doc):
                snap, why = host_snapshot(doc, name)
                if snap is not None or why is not None:
                    out.append(Entry(lineno, offset, length, snap, why, host=name))
            return out
    elif doc is not None:
        try:
            doc = check_snapshot(doc)
        except SnapshotError as exc:
            doc, error = None, str(exc)
    incomplete = not complete and doc is None
    if incomplete:
        error = f"incomplete last line ({length} bytes, no newline): {error}"
    return [Entry(lineno, offset, length, doc, error, incomplete)]


def read_entry(
    path: str | Path, offset: int, length: int, host: str | None = None
) -> dict[str, Any]:
    """Re-read one line found earlier by `iter_record` (replay keeps offsets, not documents);
    with `host`, that host's snapshot in it. Raises `SnapshotError` when the file changed
    under us."""
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    doc, error = parse_line(raw.rstrip(b"\n"), host)
    if doc is None:
        raise SnapshotError(f"line at byte {offset} changed since it was read: {error}")
    return doc


def describe_lines(linenos: list[int], limit: int = 10) -> str:
    """``"3, 9, 12"`` or ``"3, 9, 12, ... (+40 more)"`` for messages."""
    shown = ", ".join(str(n) for n in linenos[:limit])
    rest = len(linenos) - limit
    return shown + (f", ... (+{rest} more)" if rest > 0 else "")


def load_snapshot_file(path: str | Path, host: str | None = None) -> dict[str, Any]:
    """One saved snapshot (``gputaskman --json`` output; with `host`, that host's in a
    ``fleet --json`` document). Raises `SnapshotError` with a message fit for users when the
    file is unreadable, not JSON, a record file with several snapshots, or not a snapshot."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        doc = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise SnapshotError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except (ValueError, RecursionError) as exc:
        lines = [ln for ln in data.splitlines() if ln.strip()]
        good = sum(_record_line(ln) for ln in lines[:20])
        if len(lines) > 1 and good:
            raise SnapshotError(
                f"{path}: a record file ({len(lines)} lines, one snapshot each); name one as "
                f"{path}@N (N from 1, or -1 for the last), e.g. {path}@1 {path}@-1"
            ) from None
        raise SnapshotError(f"{path}: not JSON ({exc})") from None
    if fleetdoc.is_fleet(doc) or host is not None:
        return _fleet_host(doc, host, str(path))
    try:
        return check_snapshot(doc)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None


def _record_line(raw: bytes) -> bool:
    """Whether a line is a snapshot or fleet line (good or not inside)."""
    obj = _parse_object(raw)[0]
    return isinstance(obj, dict) and obj.get("schema") in (fleetdoc.NAME, schema.NAME)


def _fleet_host(doc: Any, host: str | None, where: str) -> dict[str, Any]:
    """Host `host`'s snapshot in the fleet document `doc`, or `SnapshotError` saying why."""
    if not fleetdoc.is_fleet(doc):
        raise SnapshotError(f"{where}: not a fleet document, and --host {host} names a host of one")
    try:
        fleetdoc.check_fleet(doc)
    except SnapshotError as exc:
        raise SnapshotError(f"{where}: {exc}") from None
    names = ", ".join(fleetdoc.host_names(doc))
    if host is None:
        raise SnapshotError(f"{where}: a fleet document: name a host with --host ({names})")
    entry = fleetdoc.host_entry(doc, host)
    if entry is None:
        raise SnapshotError(f"{where}: no host {host} in it (hosts: {names})")
    snap, why = host_snapshot(doc, host)
    if snap is None:
        raise SnapshotError(
            f"{where}: {why or 'host ' + host + ': ' + fleetdoc.why_no_snapshot(entry)}"
        )
    return snap


def is_fleet_file(path: str | Path) -> bool:
    """Whether `path` starts with a fleet document (a ``fleet record`` line, or ``fleet
    --json`` output). Raises OSError."""
    with open(path, "rb") as f:
        first = f.readline(MAX_LINE_BYTES)
        if first.strip() == b"{":
            first += f.read(MAX_LINE_BYTES)
    return fleetdoc.is_fleet(_parse_object(first)[0])


def fleet_hosts(path: str | Path) -> list[str] | None:
    """The hosts a fleet file names (a ``fleet --json`` document or a ``fleet record`` file),
    in the order first seen; None when it holds no fleet document. Raises OSError."""
    hosts: dict[str, None] = {}
    fleet = False
    with open(path, "rb") as f:
        for e in iter_record(f, every_host=True):
            if e.host is not None:
                fleet = True
                hosts.setdefault(e.host)
    if not fleet:  # a fleet file whose hosts never answered still names them
        try:
            with open(path, "rb") as f:
                first = _parse_object(f.readline(MAX_LINE_BYTES))[0]
        except OSError:
            first = None
        if fleetdoc.is_fleet(first):
            try:
                return fleetdoc.host_names(fleetdoc.check_fleet(first))
            except SnapshotError:
                return None
        return None
    return list(hosts)


def load_snapshot_arg(arg: str, host: str | None = None) -> tuple[dict[str, Any], str]:
    """A snapshot named on the command line: a single saved snapshot (FILE), or the Nth good
    snapshot of a record file (FILE@N; N counts from 1, negative from the end: @-1 is the
    last). With `host`, the file is a fleet file and the snapshots are that host's. Returns
    the snapshot and how to name it to the user. SnapshotError says why not."""
    path, at, n_text = arg.rpartition("@")
    if not at or Path(arg).exists() or not n_text.lstrip("-").isdigit():
        return load_snapshot_file(arg, host), arg
    n = int(n_text)
    if n == 0:
        raise SnapshotError(f"{arg}: snapshots count from 1 (@1 is the first, @-1 the last)")
    # An hours-long recording is not held in memory: only the snapshot asked for (@N) or the
    # last |N| of them (@-N) are kept while the file is read.
    kept: deque[dict[str, Any]] = deque(maxlen=1 if n > 0 else -n)
    count = 0
    try:
        with open(path, "rb") as f:
            for e in iter_record(f, host):
                if e.doc is None:
                    continue
                count += 1
                if n < 0 or count == n:
                    kept.append(e.doc)
                if count == n:
                    break
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not count:
        if host is not None:
            raise SnapshotError(f"{path}: no snapshot of host {host} in it")
        raise SnapshotError(f"{path}: no snapshot in it (not a gputaskman record file?)")
    if count < abs(n):
        raise SnapshotError(f"{arg}: {path} holds {count} snapshot(s)")
    doc = kept[0]
    try:
        return check_snapshot(doc), f"{path}@{n}"
    except SnapshotError as exc:
        raise SnapshotError(f"{arg}: {exc}") from None
