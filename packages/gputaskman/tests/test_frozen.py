"""`frozen.builder`, the snapshot reader's constructor for frozen, slotted dataclasses: the
object it builds is the one the class builds, for every class the reader builds with it; and
`frozen.fields_of`, the writers' read of a record's fields by name."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from gputaskman.base import readings
from gputaskman.base.frozen import builder, fields_of
from gputaskman.document import doctypes
from gputaskman.intel.apps import AppModel
from gputaskman.intel.llm import LlmView, ViewPart
from gputaskman.sampling import duvmpool

# every class `reader` builds with a builder
CLASSES = [
    readings.Reading,
    readings.Problem,
    readings.ModelRef,
    readings.ProcDetail,
    readings.ProcGpu,
    readings.DeviceMetrics,
    ViewPart,
    LlmView,
    AppModel,
    duvmpool.DaemonPool,
    duvmpool.PeerPages,
    duvmpool.Lending,
    duvmpool.Borrower,
    duvmpool.PoolInfo,
    doctypes.AdapterDoc,
    doctypes.ProcessDoc,
    doctypes.SwapDeviceDoc,
    doctypes.SwapDoc,
    doctypes.SystemDoc,
    doctypes.Document,
]


def _values(cls: type) -> list[object]:
    """A distinct, hashable value per field (builder and class must not mix them up)."""
    counter = itertools.count()
    return [f"{f.name}-{next(counter)}" for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_built_object_is_the_one_the_class_builds(cls: type) -> None:
    """Catches a builder that stores a field under another's name (planted: its parameters
    sorted by name), or that leaves the object an instance of its unfrozen twin (planted: the
    ``__class__`` assignment dropped): exact type, fields, equality, hash and repr of
    ``cls(...)``, and frozen like it."""
    values = _values(cls)
    got = builder(cls)(*values)
    if hasattr(cls, "__post_init__"):  # Reading: its checks refuse these values
        want = object.__new__(cls)
        for f, v in zip(dataclasses.fields(cls), values, strict=True):
            object.__setattr__(want, f.name, v)
    else:
        want = cls(*values)
    assert type(got) is cls
    assert [getattr(got, f.name) for f in dataclasses.fields(cls)] == values
    assert got == want and repr(got) == repr(want)
    if cls.__hash__ is not None:
        assert hash(got) == hash(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.__setattr__(dataclasses.fields(cls)[0].name, 0)


def test_a_reading_built_so_is_the_reading_the_class_builds() -> None:
    """Catches `checked_reading` differing from ``Reading(...)`` where the class's checks
    pass (planted: the builder's parameters sorted by name)."""
    r = readings.Reading
    args = (5, readings.Kind.MEASURED, "nvml", None, "d")
    assert readings.checked_reading(*args) == r(*args)
    assert repr(readings.checked_reading(*args)) == repr(r(*args))


@dataclasses.dataclass(slots=True)
class _Mutable:
    a: int


@dataclasses.dataclass(frozen=True)
class _NoSlots:
    a: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Base:
    a: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Derived(_Base):
    b: int


@pytest.mark.parametrize("cls", [_Mutable, _NoSlots, _Derived, int])
def test_a_class_the_twin_cannot_stand_for_is_refused(cls: type) -> None:
    """Catches a builder made for a class whose layout its twin does not share (no slots,
    slots split over a base) or that is not frozen, which would fail or differ at the first
    document instead of at import (planted: the slots check removed)."""
    with pytest.raises(TypeError):
        builder(cls)


def test_fields_of_gives_every_declared_field_in_order() -> None:
    m = readings.DeviceMetrics.partial(
        "test", "not published", temperature_c=readings.Reading.measured(61, "test")
    )
    got = fields_of(m)
    assert list(got) == [f.name for f in dataclasses.fields(readings.DeviceMetrics)]
    assert got["temperature_c"] is m.temperature_c and got["power_w"] is m.power_w
