"""The typed reader's system section: the host's memory and CPU numbers, its swap and swap
devices, and the duvm pool (``system.duvm``) into `doctypes.SystemDoc` and
`duvmpool.PoolInfo` (`reader` calls `system` once per document).

A duvm number a file does not hold is unknown (``unavailable``, "not recorded"), never 0; a
swap device's number a file does not hold is absent (None). Early files' system numbers with
their reasons in a ``reasons`` object read as measured readings (that key is never a number).
"""

from __future__ import annotations

from msgspec import UNSET, UnsetType

from gputaskman.base.frozen import builder
from gputaskman.base.readings import Kind, Reading, Reason
from gputaskman.document.docshape import PoolShape, ReadingShape, SwapShape, SystemShape
from gputaskman.document.doctypes import (
    RECORDED_SOURCE,
    SwapDeviceDoc,
    SwapDoc,
    SystemDoc,
    value_of,
)
from gputaskman.document.docvalues import maybe, num, reading, text_or, texts
from gputaskman.sampling import duvmpool


def _runtime(s: ReadingShape | None) -> Reading:
    """A duvm number; one a file does not hold is unknown, never 0."""
    if s is None:
        return Reading.missing(Reason.UNAVAILABLE, RECORDED_SOURCE, "not recorded", Kind.RUNTIME)
    return reading(s)


def _pool(s: PoolShape | None) -> duvmpool.PoolInfo | None:
    if s is None:
        return None
    daemons = tuple(
        _DaemonPool(
            d.socket,
            num(d.pid),
            _runtime(d.size_bytes),
            _runtime(d.replicas),
            _runtime(d.pages_written),
            _runtime(d.degraded_slabs),
            _runtime(d.pages_lost),
            text_or(d.health, "unknown"),
            texts(d.reasons),
            tuple(
                _PeerPages(
                    text_or(p.peer, "?"),
                    p.connected,
                    _runtime(p.pages),
                    _runtime(p.reserved_pages),
                    _runtime(p.slabs),
                )
                for p in d.peers or ()
            ),
            d.swap_device,
        )
        for d in s.daemons
    )
    lending = tuple(
        _Lending(
            m.socket,
            _runtime(m.capacity_bytes),
            _runtime(m.used_bytes),
            _runtime(m.reserved_bytes),
            tuple(
                _Borrower(
                    text_or(b.client_id, "?"),
                    _runtime(b.stored_bytes),
                    _runtime(b.reserved_bytes),
                    value_of(maybe(b.connections)),
                )
                for b in m.borrowers or ()
            ),
            value_of(maybe(m.borrowers_listed_of)),  # borrowers_total
        )
        for m in s.lending
    )
    errors = s.errors
    return _PoolInfo(
        daemons,
        lending,
        {} if errors is None else {k: text_or(v, "") for k, v in errors.items()},
        text_or(s.looked, duvmpool.DEFAULT_GLOB),
    )


def _host_numbers(m: dict[str, ReadingShape] | None) -> dict[str, Reading]:
    # "reasons" names an early file's object of reasons, never a number
    return {} if m is None else {k: reading(v) for k, v in m.items() if k != "reasons"}


def _set(s: ReadingShape | UnsetType) -> Reading | None:
    return None if s is UNSET else reading(s)  # type: ignore[arg-type]


def _swap(s: SwapShape | None) -> SwapDoc | None:
    if s is None:
        return None
    devices = None
    if s.devices is not None:
        devices = tuple(
            _SwapDeviceDoc(
                d.filename,
                d.type,
                _set(d.size_bytes),
                _set(d.used_bytes),
                _set(d.priority),
                bool(d.deleted),
            )
            for d in s.devices
        )
    devices_reason = s.devices_reason
    if devices_reason is None and s.reasons is not None:
        devices_reason = s.reasons.get("devices")
    return _SwapDoc(
        _set(s.total_bytes),
        _set(s.free_bytes),
        _set(s.used_bytes),
        devices,
        devices_reason,
        texts(s.problems),
    )


def system(s: SystemShape) -> SystemDoc:
    return _SystemDoc(
        num(s.taken),
        _host_numbers(s.memory),
        _swap(s.swap),
        _host_numbers(s.cpu),
        s.processes_reason,
        _pool(s.duvm),
    )


_DaemonPool = builder(duvmpool.DaemonPool)
_PeerPages = builder(duvmpool.PeerPages)
_Lending = builder(duvmpool.Lending)
_Borrower = builder(duvmpool.Borrower)
_PoolInfo = builder(duvmpool.PoolInfo)
_SwapDeviceDoc = builder(SwapDeviceDoc)
_SwapDoc = builder(SwapDoc)
_SystemDoc = builder(SystemDoc)
