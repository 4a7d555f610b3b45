"""The fleet reader: one host's HTTP answer read as its snapshot, or as the reason it is not
one. Every document the fleet receives goes through `read_body`, and through it through
`reader.read_document`, the one reader of the snapshot document, given the body's bytes
(it decodes them straight into the document's declared shape, `document/docshape.py`).

Theory of operation
-------------------
A host's answer is not trusted. `read_answer` maps the HTTP status first: 401/403 is a
refused token (`refused`), 304 the document the poller has (it asked with the ETag of that
one: nothing to read), 404 no snapshot endpoint (`incompatible`: not `gputaskman serve`,
or one older than this view), 503 a serve with no sample yet (`starting`), any other
non-200 an `error`. A 200's body is then read by `read_body`, in bounded memory and time:

* its size is capped before it is read (`httpwire.ResponseReader`, `MAX_DOCUMENT_BYTES`);
* the JSON containers are counted before parsing (``{`` and ``[`` bytes, an upper bound; a
  body of at most `MAX_CONTAINERS` bytes cannot hold more), so a small body cannot expand
  into millions of objects (`MAX_CONTAINERS`); nesting deeper than
  Python's recursion limit is refused by the JSON decoders themselves; NaN and Infinity are
  refused (unknown is null);
* `read_document` reads the body into typed objects (a poller that shows only the fleet
  table asks `read_table_document` for the table's part, and the whole document only of the
  host that is open): another schema or version is
  `incompatible`, named (`reader.NotASnapshot`); a wrong type anywhere is `incompatible`
  with the place it was found; JSON that does not parse is `incompatible` with the parser's
  words.

The result is an `Answer`: `up` with the `Document` and the body it was read from (the
validated bytes, written out again by ``fleet --json`` and ``fleet record``), or a status and
a reason, never zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

from gputaskman.document.fleetdoc import HostStatus
from gputaskman.document.reader import (
    Document,
    NotASnapshot,
    SnapshotError,
    read_document,
    read_table_document,
)
from gputaskman.fleet.httpwire import HttpResponse

MAX_DOCUMENT_BYTES = 8 * 1024 * 1024  # a host with a thousand processes writes a few MB
MAX_CONTAINERS = 400_000  # objects and lists: a real document has about one per 100 bytes


@dataclass(frozen=True, slots=True)
class Answer:
    status: HostStatus
    reason: str | None = None
    document: Document | None = None
    body: bytes | None = None  # the bytes `document` was read from (valid JSON)
    unchanged: bool = False  # up, with the document the poller already has (HTTP 304)
    whole: bool = True  # False: only the fleet table's part was read (`read_table_document`)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_body(body: bytes, whole: bool = True) -> Answer:
    """A 200's body read as a snapshot document (see the module docstring), or only the part
    the fleet table shows (not `whole`). Never raises."""
    # every container takes a byte: a body no longer than the cap needs no counting
    containers = 0 if len(body) <= MAX_CONTAINERS else body.count(b"{") + body.count(b"[")
    if containers > MAX_CONTAINERS:
        return Answer(
            HostStatus.INCOMPATIBLE,
            f"not a snapshot: {containers} JSON objects and lists, over {MAX_CONTAINERS}",
        )
    try:
        doc = read_document(body) if whole else read_table_document(body)
    except RecursionError:
        return Answer(HostStatus.INCOMPATIBLE, "not a snapshot: JSON nested too deep")
    except NotASnapshot as exc:  # another schema or version, or not an object
        return Answer(HostStatus.INCOMPATIBLE, _shorten(str(exc)))
    except SnapshotError as exc:
        return Answer(HostStatus.INCOMPATIBLE, _shorten(f"unreadable snapshot: {exc}"))
    except ValueError as exc:  # bad JSON, bad UTF-8, NaN (SnapshotError is caught above)
        return Answer(HostStatus.INCOMPATIBLE, _shorten(f"not JSON: {exc}"))
    return Answer(HostStatus.UP, None, doc, body, whole=whole)


def read_answer(resp: HttpResponse, token_sent: bool, whole: bool = True) -> Answer:
    """A host's whole HTTP answer to ``GET /snapshot.json`` (see the module docstring)."""
    code = resp.status
    if code == 304:
        return Answer(HostStatus.UP, unchanged=True)
    if code in (401, 403):
        if token_sent:
            return Answer(HostStatus.REFUSED, f"the host did not accept the token (HTTP {code})")
        return Answer(HostStatus.REFUSED, f"the host wants a token (HTTP {code}): --token-file")
    if code == 404:
        return Answer(
            HostStatus.INCOMPATIBLE,
            "no /snapshot.json (HTTP 404): not gputaskman serve, or one older than this view",
        )
    if code == 503:
        return Answer(HostStatus.STARTING, "the host has no sample yet (HTTP 503)")
    if code != 200:
        return Answer(HostStatus.ERROR, f"HTTP {code}")
    return read_body(resp.body, whole)
