"""Typed access to a parsed JSON object, for the snapshot document's reader (`reader`).

`Fields` wraps one object with its place in the document (``processes[3].model``): each
accessor checks the value's type and returns it, None for an optional key that is absent
or null, and raises `SnapshotError` naming the place otherwise, so the reader says exactly
what it cannot read instead of guessing. The place is spelled out only when there is an
error to report: a day of record lines holds millions of readings, read on the fast path
of `Fields.reading` (a well-formed reading object) without building a string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn, TypeGuard

from gputaskman.base.readings import Kind, Problem, Reading, Reason, checked_reading

KINDS = {k.value: k for k in Kind}
REASONS = {r.value: r for r in Reason}
_INFINITIES = (math.inf, -math.inf)
_LONG = 2**63  # an integer within ±_LONG is finite as a float
_STR = {str}


class SnapshotError(ValueError):
    """A document that is not a gputaskman snapshot this version can read."""


class NotASnapshot(SnapshotError):
    """A document whose top level is not a schema-1 snapshot (another schema or version,
    not an object): the fleet calls such a host incompatible by name, not unreadable."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (unknown is null)")


def parse_json(text: str | bytes) -> Any:
    """`json.loads` that refuses NaN and Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


def is_number(v: object) -> TypeGuard[int | float]:
    """A real JSON number (bool is not one) that a float holds, finite: a 400-digit integer
    is valid JSON but no count this document holds, and would break the arithmetic on it."""
    t = type(v)  # what json.loads makes, decided without a call (the reader's hot path)
    if t is float:
        return v == v and v not in _INFINITIES
    if t is int and -_LONG <= v < _LONG:
        return True
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _type_name(v: object) -> str:
    return "null" if v is None else type(v).__name__


Key = str | tuple[str, int]  # a key, or a key and an index into the list it holds


def place(up: Fields | None, key: Key) -> str:
    """``processes[3].model``: where `key` of the object `up` sits in the document."""
    base = "" if up is None else up.at
    name = key if isinstance(key, str) else f"{key[0]}[{key[1]}]"
    return f"{base}.{name}" if base and name else base or name


class Fields:
    """A JSON object being read, and where it sits in the document (`at`, for messages)."""

    __slots__ = ("_key", "_up", "m")

    def __init__(self, value: object, up: Fields | None = None, key: Key = "") -> None:
        if type(value) is not dict and not isinstance(value, Mapping):
            raise SnapshotError(f"{place(up, key)}: expected an object, got {_type_name(value)}")
        self.m: Mapping[str, Any] = value
        self._up = up
        self._key = key

    @property
    def at(self) -> str:
        return place(self._up, self._key)

    def where(self, key: str) -> str:
        return place(self, key)

    def _wrong(self, key: str, what: str, required: bool) -> NoReturn:
        if required and key not in self.m:
            raise SnapshotError(f"{self.where(key)}: missing")
        got = _type_name(self.m.get(key))
        null = "" if required else " or null"
        raise SnapshotError(f"{self.where(key)}: expected {what}{null}, got {got}")

    def text(self, key: str) -> str | None:
        v = self.m.get(key)
        if v is None or isinstance(v, str):
            return v
        self._wrong(key, "a string", False)

    def text_or(self, key: str, default: str) -> str:
        """The text at `key`, `default` when it is absent or null (an empty string is text)."""
        v = self.text(key)
        return default if v is None else v

    def need_text(self, key: str) -> str:
        v = self.m.get(key)
        if isinstance(v, str):
            return v
        self._wrong(key, "a string", True)

    def integer(self, key: str) -> int | None:
        v = self.m.get(key)
        if v is None or (isinstance(v, int) and is_number(v)):
            return v
        self._wrong(key, "an integer", False)

    def need_integer(self, key: str) -> int:
        v = self.m.get(key)
        if isinstance(v, int) and is_number(v):
            return v
        self._wrong(key, "an integer", True)

    def number(self, key: str) -> float | None:
        v = self.m.get(key)
        if v is None or is_number(v):
            return v
        self._wrong(key, "a finite number", False)

    def flag(self, key: str) -> bool | None:
        v = self.m.get(key)
        if v is None or isinstance(v, bool):
            return v
        self._wrong(key, "true or false", False)

    def texts(self, key: str) -> tuple[str, ...]:
        v = self.m.get(key)
        if v is None:
            return ()
        if type(v) is list and set(map(type, v)) <= _STR:  # no Python frame per item
            return tuple(v)
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return tuple(v)
        self._wrong(key, "a list of strings", False)

    def obj(self, key: str) -> Fields | None:
        v = self.m.get(key)
        return None if v is None else Fields(v, self, key)

    def need_obj(self, key: str) -> Fields:
        v = self.m.get(key)
        if v is None:
            self._wrong(key, "an object", True)
        return Fields(v, self, key)

    def objs(self, key: str, *, required: bool = False) -> list[Fields]:
        v = self.m.get(key)
        if v is None and not required:
            return []
        if not isinstance(v, list):
            self._wrong(key, "a list", required)
        return [Fields(x, self, (key, i)) for i, x in enumerate(v)]

    def reading(self, key: str) -> Reading | None:
        """The reading object at `key`; None when it is absent or null."""
        v = self.m.get(key)
        return None if v is None else _read(v, self, key)

    def need_reading(self, key: str) -> Reading:
        v = self.m.get(key)
        if v is None:
            self._wrong(key, "a reading", True)
        return _read(v, self, key)

    def readings(self, key: str) -> dict[str, Reading]:
        """An object of named readings (``engines``, ``extra_metrics``); {} when absent."""
        o = self.obj(key)
        if o is None:
            return {}
        out = {}
        for k, v in o.m.items():
            if v is None:
                o._wrong(k, "a reading", True)
            out[k] = _read(v, o, k)
        return out

    def readings_in(self, key: str) -> tuple[Reading, ...]:
        """A list of readings (a breakdown part's ``alternatives``); () when absent."""
        v = self.m.get(key)
        if v is None:
            return ()
        if not isinstance(v, list) or None in v:
            self._wrong(key, "a list of readings", False)
        return tuple(_read(x, self, (key, i)) for i, x in enumerate(v))


def _read(v: Any, up: Fields, key: Key) -> Reading:
    """The reading object `v` (not None) found at `key` of `up`."""
    try:  # the fast path: a well-formed reading object, as the writer wrote it
        kind, source, detail = KINDS[v["kind"]], v["source"], v["detail"]
        value, why = v["value"], v["reason"]
    except (KeyError, TypeError, IndexError):
        pass
    else:
        # what Reading checks, checked here: it is built without checking again; anything
        # else takes the slow path, which decides
        if type(source) is str and (detail is None or type(detail) is str):
            if why is None:
                if is_number(value):
                    return checked_reading(value, kind, source, None, detail)
            elif value is None and type(why) is str and why in REASONS:
                return checked_reading(None, kind, source, REASONS[why], detail)
    return _reading(Fields(v, up, key))


def _kind(v: object) -> Kind | None:
    return KINDS.get(v) if isinstance(v, str) else None


def reason_from_json(text: object, where: str) -> tuple[Reason, str | None]:
    """A recorded reason; one this version does not know is kept as words in the detail."""
    if not isinstance(text, str):
        raise SnapshotError(f"{where}: reason {text!r} is not a string")
    reason = REASONS.get(text)
    if reason is None:
        return Reason.UNAVAILABLE, f"recorded reason: {text}"
    return reason, None


def _with(detail: str | None, extra: str | None) -> str | None:
    if extra is None:
        return detail
    return extra if detail is None else f"{detail} ({extra})"


def _reading(o: Fields) -> Reading:
    """A reading object off the fast path: a reason this version does not know (kept in
    words), or something that is not a reading (`SnapshotError` saying what)."""
    value = o.m.get("value")
    if value is not None and not is_number(value):
        raise SnapshotError(f"{o.where('value')}: {value!r} is not a number")
    kind = _kind(o.m.get("kind"))
    if kind is None:
        raise SnapshotError(f"{o.where('kind')}: {o.m.get('kind')!r} is not a kind")
    source, detail = o.need_text("source"), o.text("detail")
    why = o.m.get("reason")
    reason, extra = (None, None) if why is None else reason_from_json(why, o.where("reason"))
    try:
        return Reading(value, kind, source, reason, _with(detail, extra))
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{o.at}: {exc}") from None


def problem_from_json(o: Fields) -> Problem:
    reason, extra = reason_from_json(o.m.get("reason"), o.where("reason"))
    return Problem(o.need_text("where"), reason, _with(o.text("detail"), extra), o.text("adapter"))
