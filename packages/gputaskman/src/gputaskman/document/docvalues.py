"""The typed reader's values: a recorded number, reading, reason or problem, checked as it is
built (`reader` and `docsystem` call these for every value of a document).

What the Structs' types allow but a reading does not (no value and no reason, both, a number
beyond a float's range) raises `Refused`: the document then goes to the reference reader
(`docfields.read_parsed`), which reads it or words the refusal. A reason this version does
not know reads as ``unavailable`` with the recorded word in the detail.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from gputaskman.base.frozen import builder
from gputaskman.base.readings import Problem, Reading, Reason, checked_reading
from gputaskman.document.docshape import ProblemShape, ReadingShape
from gputaskman.document.jsonfields import REASONS, is_number


class Refused(Exception):
    """Something the Structs' types allow but a reading does not: the reference reader
    decides (and words the refusal)."""


# what sends a document to the reference reader: msgspec's refusals, `Refused`, and the
# ValueError msgspec raises on a lone surrogate in a str (UnicodeEncodeError)
OFF_PATH = (msgspec.MsgspecError, RecursionError, Refused, ValueError)
_LONG = 2**63  # an int within ±_LONG is one a float holds
_FLOAT_MAX = sys.float_info.max
_Problem = builder(Problem)


def num(v: Any) -> Any:
    """A recorded number (or None) that a float holds; else the reference reader decides."""
    if v is None or is_number(v):
        return v
    raise Refused


def _recorded(detail: str | None, why: str) -> str:
    """The detail of a reason this version does not know: the recorded words kept."""
    extra = f"recorded reason: {why}"
    return extra if detail is None else f"{detail} ({extra})"


def reading(s: ReadingShape) -> Reading:
    """The `Reading` a reading object records."""
    v, why = s.value, s.reason
    if why is None:
        t = type(v)
        # `is_number`'s two common cases inline (run for every reading): an int within
        # ±2**63, a finite float (NaN and infinities fail both comparisons)
        if (t is int and -_LONG <= v < _LONG) or (t is float and -_FLOAT_MAX <= v <= _FLOAT_MAX):
            return checked_reading(v, s.kind, s.source, None, s.detail)
        if v is not None and is_number(v):
            return checked_reading(v, s.kind, s.source, None, s.detail)
    elif v is None:
        reason = REASONS.get(why)
        if reason is not None:
            return checked_reading(None, s.kind, s.source, reason, s.detail)
        return checked_reading(None, s.kind, s.source, Reason.UNAVAILABLE, _recorded(s.detail, why))
    raise Refused  # no value and no reason, both, or a number beyond a float


def maybe(s: ReadingShape | None) -> Reading | None:
    return None if s is None else reading(s)


def texts(v: list[str] | None) -> tuple[str, ...]:
    return () if v is None else tuple(v)


def text_or(v: str | None, default: str) -> str:
    return default if v is None else v


def problem(s: ProblemShape) -> Problem:
    reason = REASONS.get(s.reason)
    if reason is not None:
        return _Problem(s.where, reason, s.detail, s.adapter)
    return _Problem(s.where, Reason.UNAVAILABLE, _recorded(s.detail, s.reason), s.adapter)
