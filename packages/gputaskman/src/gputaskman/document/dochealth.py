"""The typed reader's part of an adapter that concerns its health and MIG instances, and of a
process row its MIG instance: ``health`` into readings by key, ``mig`` into a
`readings.MigState` and a row's ``mig`` into its (GPU instance, compute instance) pair
(`reader` calls these; the reference reader, `docfields`, reads the same keys to the same
objects). ``health_state`` and a MIG instance's sums are derived by the writer, never read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputaskman.base.frozen import builder
from gputaskman.base.readings import MigInstance, MigState, Reading
from gputaskman.document.docshape import AdapterShape, MigRefShape, ReadingShape

_MigInstance = builder(MigInstance)
_MigState = builder(MigState)

Read = Callable[[ReadingShape], Reading]  # a reading's shape to a checked `Reading`
Num = Callable[[Any], Any]  # a recorded number a float holds, else refused


def adapter_parts(
    s: AdapterShape, read: Read, num: Num
) -> tuple[dict[str, Reading], MigState | None]:
    """The adapter's health readings ({} when it has none) and MIG state (None: not read)."""
    health = {} if s.health is None else {k: read(v) for k, v in s.health.items()}
    m = s.mig
    if m is None:
        return health, None
    instances = tuple(
        _MigInstance(
            num(i.gpu_instance_id),
            num(i.compute_instance_id),
            i.uuid,
            read(i.memory_total_bytes),
            read(i.memory_used_bytes),
        )
        for i in m.instances or ()
    )
    return health, _MigState(read(m.mode), instances)


def mig_ref_of(s: MigRefShape | None, num: Num) -> tuple[int, int] | None:
    """A process row's MIG instance, None when it has none."""
    return None if s is None else (num(s.gpu_instance_id), num(s.compute_instance_id))
