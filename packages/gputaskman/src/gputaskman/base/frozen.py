"""Fast constructors for frozen, slotted dataclasses: what the snapshot reader builds every
object of every document with (a fleet reads some 200 documents a second, each of a few
hundred objects).

A frozen dataclass's own ``__init__`` writes each field through ``object.__setattr__`` (the
class refuses plain assignment) and then runs ``__post_init__``. `builder(cls)` returns a
function that takes every field, positionally, in the class's order, and makes the same
object at a third (5 fields) to a seventh (17 fields) of the cost: it fills an instance of
an unfrozen twin of `cls` (the same slots in the same order, each stored directly) and then
makes that instance one of `cls` by assigning ``__class__``, which Python allows between
classes of the same layout. The result is an ordinary instance of `cls`, equal to, hashing
and printing as ``cls(...)`` with the same fields. It skips ``__post_init__``: use it only
where the caller has already checked what that checks.

`fields_of(obj)` reads a dataclass's fields by name, in declared order: the one place the
writers that walk a record's fields (report, exporter, diff, summary, the server probe's
merge) read attributes by name. Every name is a field the class declares, so it reflects
over the class's own fields and probes nothing.

This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def fields_of(obj: Any) -> dict[str, Any]:
    """Each field of the dataclass instance `obj` by name, in declared order."""
    # each name is a field the class declares: reflection, not probing
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def builder(cls: type[T]) -> Callable[..., T]:
    """``build(*fields) -> cls``: see the module docstring. `cls` must be a frozen dataclass
    with ``slots=True`` and no base other than `object`; else `TypeError`."""
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} is not a frozen dataclass")
    names = tuple(f.name for f in dataclasses.fields(cls))
    # a class has __slots__ only when declared with them (the language's data model)
    if cls.__bases__ != (object,) or getattr(cls, "__slots__", None) != names:
        raise TypeError(f"{cls.__name__} is not slotted on its fields alone")
    twin = dataclasses.make_dataclass(
        f"_{cls.__name__}Twin", names, slots=True, init=False, repr=False, eq=False
    )
    # one function per class, as dataclasses writes __init__: a loop would cost more than
    # the stores it makes
    stores = "".join(f"    obj.{n} = {n}\n" for n in names)
    source = (
        f"def build({', '.join(names)}):\n"
        f"    obj = new(twin)\n{stores}"
        f"    obj.__class__ = cls\n"
        f"    return obj\n"
    )
    namespace: dict[str, Any] = {"new": object.__new__, "twin": twin, "cls": cls}
    exec(source, namespace)  # the source is made of the class's field names alone
    build = namespace["build"]
    build.__qualname__ = f"builder({cls.__name__})"
    build.__doc__ = f"A {cls.__name__} of these fields, in order (`frozen.builder`)."
    return build  # type: ignore[no-any-return]
