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
sentinel. Each line's top-level shape is checked here (`document.check_snapshot`); the rest
is read by `document.read_document` when a line is used. `load_snapshot_file` reads a single
saved snapshot (``--json`` output, indented or compact) for `diff`; `iter_record` reads one
too, as a record of one sample (an indented document is parsed whole when its first line
is a lone ``{``).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from gputaskman.core.document import SnapshotError, check_snapshot

# A snapshot of a thousand processes with long command lines is a few MB; anything far
# beyond that is not a line record wrote, and must not be loaded whole.
MAX_LINE_BYTES = 64 * 1024 * 1024


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (unknown is null)")


def parse_json(text: str | bytes) -> Any:
    """`json.loads` that refuses NaN and Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a record file. Exactly one of `doc` and `error` is set."""

    lineno: int  # 1-based
    offset: int  # byte offset of the line's first byte
    length: int  # bytes, including the newline when present
    doc: dict[str, Any] | None
    error: str | None = None
    incomplete: bool = False  # the last line, without its newline, and not a whole snapshot

    @property
    def ok(self) -> bool:
        return self.doc is not None

    @property
    def taken(self) -> float:
        """When the snapshot was taken (`check_snapshot` made sure it is a number)."""
        if self.doc is None:
            raise SnapshotError(f"line {self.lineno} holds no snapshot: {self.error}")
        return float(self.doc["taken"])


def parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(document, None) or (None, why) for one line's bytes (newline stripped or not)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return None, "empty line"
    try:
        doc = parse_json(text)
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON ({exc})"
    try:
        return check_snapshot(doc), None
    except SnapshotError as exc:
        return None, str(exc)


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


def _whole_snapshot(f: IO[bytes]) -> Entry | None:
    """An indented ``--json`` snapshot (one document over many lines) as one `Entry`, or
    None (the stream is left where it was) when the stream is not that."""
    if not f.seekable():
        return None
    start = f.tell()
    first = f.readline(4096)
    if first.strip() == b"{":  # compact snapshots and record lines are whole on line 1
        whole = first + f.read(MAX_LINE_BYTES + 1 - len(first))
        if len(whole) <= MAX_LINE_BYTES:
            doc, _ = parse_line(whole)
            if doc is not None:
                return Entry(1, start, len(whole), doc)
    f.seek(start)
    return None


def iter_record(f: IO[bytes]) -> Iterator[Entry]:
    """Every line of a binary record stream, classified (see the module docstring). A single
    indented snapshot (``gputaskman --json > f``) is read as one entry."""
    single = _whole_snapshot(f)
    if single is not None:
        yield single
        return
    offset = 0
    lineno = 0
    while True:
        raw, length, too_long = _read_line(f)
        if length == 0:
            return
        lineno += 1
        complete = raw.endswith(b"\n")
        if too_long:
            entry = Entry(lineno, offset, length, None, f"line longer than {MAX_LINE_BYTES} bytes")
            if not complete:
                entry = Entry(lineno, offset, length, None, entry.error, incomplete=True)
        else:
            doc, error = parse_line(raw[:-1] if complete else raw)
            incomplete = not complete and doc is None
            if incomplete:
                error = f"incomplete last line ({length} bytes, no newline): {error}"
            entry = Entry(lineno, offset, length, doc, error, incomplete)
        yield entry
        offset += length


def read_entry(path: str | Path, offset: int, length: int) -> dict[str, Any]:
    """Re-read one line found earlier by `iter_record` (replay keeps offsets, not documents).
    Raises `SnapshotError` when the file changed under us."""
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    doc, error = parse_line(raw.rstrip(b"\n"))
    if doc is None:
        raise SnapshotError(f"line at byte {offset} changed since it was read: {error}")
    return doc


def describe_lines(linenos: list[int], limit: int = 10) -> str:
    """``"3, 9, 12"`` or ``"3, 9, 12, ... (+40 more)"`` for messages."""
    shown = ", ".join(str(n) for n in linenos[:limit])
    rest = len(linenos) - limit
    return shown + (f", ... (+{rest} more)" if rest > 0 else "")


def load_snapshot_file(path: str | Path) -> dict[str, Any]:
    """One saved snapshot (``gputaskman --json`` output). Raises `SnapshotError` with a
    message fit for users when the file is unreadable, not JSON, a record file with
    several snapshots, or not a snapshot."""
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
        good = sum(parse_line(ln)[0] is not None for ln in lines[:20])
        if len(lines) > 1 and good:
            raise SnapshotError(
                f"{path}: a record file ({len(lines)} lines, one snapshot each); name one as "
                f"{path}@N (N from 1, or -1 for the last), e.g. {path}@1 {path}@-1"
            ) from None
        raise SnapshotError(f"{path}: not JSON ({exc})") from None
    try:
        return check_snapshot(doc)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None


def load_snapshot_arg(arg: str) -> tuple[dict[str, Any], str]:
    """A snapshot named on the command line: a single saved snapshot (FILE), or the Nth good
    snapshot of a record file (FILE@N; N counts from 1, negative from the end: @-1 is the
    last). Returns the snapshot and how to name it to the user. SnapshotError says why not."""
    path, at, n_text = arg.rpartition("@")
    if not at or Path(arg).exists() or not n_text.lstrip("-").isdigit():
        return load_snapshot_file(arg), arg
    n = int(n_text)
    if n == 0:
        raise SnapshotError(f"{arg}: snapshots count from 1 (@1 is the first, @-1 the last)")
    # An hours-long recording is not held in memory: only the snapshot asked for (@N) or the
    # last |N| of them (@-N) are kept while the file is read.
    kept: deque[dict[str, Any]] = deque(maxlen=1 if n > 0 else -n)
    count = 0
    try:
        with open(path, "rb") as f:
            for e in iter_record(f):
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
        raise SnapshotError(f"{path}: no snapshot in it (not a gputaskman record file?)")
    if count < abs(n):
        raise SnapshotError(f"{arg}: {path} holds {count} snapshot(s)")
    doc = kept[0]
    try:
        return check_snapshot(doc), f"{path}@{n}"
    except SnapshotError as exc:
        raise SnapshotError(f"{arg}: {exc}") from None
