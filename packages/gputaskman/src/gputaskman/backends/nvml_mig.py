"""A GPU's MIG (Multi-Instance GPU) state through NVML: its mode, each MIG device's memory, and
the processes of each instance, attributed to that instance and never to the parent GPU twice.

Theory of operation
-------------------
``nvmlDeviceGetMigMode`` gives the current mode (a reading: 1 enabled, 0 disabled; missing
with the reason on a GPU without MIG, which is not asked again: `NvmlMig` remembers it).
With MIG enabled, ``nvmlDeviceGetMaxMigDeviceCount`` bounds the indices and
``nvmlDeviceGetMigDeviceHandleByIndex`` gives each MIG device (an index without one answers
NOT_FOUND and is skipped); of each, ``nvmlDeviceGetGpuInstanceId`` and
``nvmlDeviceGetComputeInstanceId`` name it, ``nvmlDeviceGetUUID`` and
``nvmlDeviceGetMemoryInfo`` give its UUID and memory slice, and
``nvmlDeviceGetComputeRunningProcesses`` on its handle lists its processes (MIG has no
graphics contexts), with per-process engine use where NVML gives it.

Attribution: on a GPU in MIG mode the parent's own process lists are not asked (NVML returns
there an aggregate of the instances, for privileged callers only): every process row comes
from one instance and says which (`GpuProcess.mig`), so the GPU's attributed sum is the sum
of its instances' and no byte is counted twice. A failed list on an instance is a
process-list problem (``processes.mig.<gi>.<ci>``), so both the instance's and the GPU's sums
are lower bounds. A process listed on two instances of one GPU (CUDA enumerates one MIG
device per process, so this should not happen) is one row whose measured bytes are the sum,
attributed to no instance, and each instance says so (``mig.<gi>.<ci>``, reason ``shared``).

Look, don't touch: the mode is read, never set (no ``nvmlDeviceSetMigMode``, no instance
created or destroyed). Not validated on hardware (no MIG-capable GPU was lent): the paths are
exercised through a mocked NVML (tests/test_nvml_mig.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputaskman.backends.nvml_calls import call, text_of, used_memory
from gputaskman.base.gpuhealth import instance_where
from gputaskman.base.gpusource import GpuProcess
from gputaskman.base.readings import Kind, MigInstance, MigState, Problem, Reading, Reason

MODE_API = "nvmlDeviceGetMigMode"
PROCS_API = "nvmlDeviceGetComputeRunningProcesses"
MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE

# engines(handle, key, pids): per-process engine readings on a handle (`NvmlBackend._engines`)
Engines = Callable[[Any, str, set[int]], dict[int, dict[str, Reading]]]


class NvmlMig:
    """The MIG state of an `NvmlBackend`'s GPUs; `lib` is its pynvml (or a mock)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._no_mig: dict[str, Reading] = {}  # bus -> "not supported", asked once

    def read(
        self, h: Any, bus: str, problems: list[Problem], engines: Engines
    ) -> tuple[MigState, list[GpuProcess] | None]:
        """GPU `h`'s MIG state and, when MIG is enabled, its instances' processes (None when
        it is not: the caller lists the parent's own). A lost GPU raises `Lost`."""
        lib = self._lib
        known = self._no_mig.get(bus)
        if known is not None:
            return MigState(known), None
        mode, missing = call(lambda: lib.nvmlDeviceGetMigMode(h), MODE_API)
        if missing is not None:
            if missing.reason is Reason.NOT_SUPPORTED:
                self._no_mig[bus] = missing
            return MigState(missing), None
        current = int(mode[0])  # [current, pending]
        state = MigState(Reading.measured(current, f"nvml:{MODE_API}"))
        if current != MIG_ENABLED:
            return state, None
        api = "nvmlDeviceGetMaxMigDeviceCount"
        count, missing = call(lambda: lib.nvmlDeviceGetMaxMigDeviceCount(h), api)
        if missing is not None:
            why = f"the MIG devices could not be counted: {missing.detail}"
            problems.append(Problem("processes.mig", missing.reason, why, bus))  # type: ignore[arg-type]
            return state, []
        instances: list[MigInstance] = []
        rows: dict[int, list[tuple[MigInstance, GpuProcess]]] = {}
        for i in range(int(count)):
            api = "nvmlDeviceGetMigDeviceHandleByIndex"
            mh, missing = call(lambda i=i: lib.nvmlDeviceGetMigDeviceHandleByIndex(h, i), api)
            if missing is not None:
                if missing.reason is not Reason.UNAVAILABLE:  # NOT_FOUND: no device there
                    why = f"MIG device {i}: {missing.detail}"
                    problems.append(Problem("processes.mig", missing.reason, why, bus))  # type: ignore[arg-type]
                continue
            inst = self._instance(mh, i, bus, problems)
            if inst is None:
                continue
            instances.append(inst)
            for p in self._processes(mh, inst, bus, problems, engines):
                rows.setdefault(p.pid, []).append((inst, p))
        procs = [_one_row(pid, on, bus, problems) for pid, on in sorted(rows.items())]
        return MigState(state.mode, tuple(instances)), procs

    def _instance(self, mh: Any, i: int, bus: str, problems: list[Problem]) -> MigInstance | None:
        lib = self._lib
        gi, m1 = call(lambda: lib.nvmlDeviceGetGpuInstanceId(mh), "nvmlDeviceGetGpuInstanceId")
        ci, m2 = call(
            lambda: lib.nvmlDeviceGetComputeInstanceId(mh), "nvmlDeviceGetComputeInstanceId"
        )
        if gi is None or ci is None:
            m = m1 or m2
            assert m is not None and m.reason is not None
            why = f"MIG device {i}: its instance ids could not be read: {m.detail}"
            problems.append(Problem("processes.mig", m.reason, why, bus))
            return None
        try:
            uuid = text_of(lib.nvmlDeviceGetUUID(mh))
        except Exception:  # a UUID we cannot read is shown as n/a
            uuid = None
        api = "nvmlDeviceGetMemoryInfo"
        mem, missing = call(lambda: lib.nvmlDeviceGetMemoryInfo(mh), api)
        src = f"nvml:{api}"
        total = missing or _bytes(mem.total, src)
        used = missing or _bytes(mem.used, src)
        return MigInstance(int(gi), int(ci), uuid, total, used)

    def _processes(
        self, mh: Any, inst: MigInstance, bus: str, problems: list[Problem], engines: Engines
    ) -> list[GpuProcess]:
        listed, missing = call(
            lambda: self._lib.nvmlDeviceGetComputeRunningProcesses(mh), PROCS_API
        )
        if missing is not None:
            where = instance_where(inst)
            problems.append(Problem(where, missing.reason, missing.detail, bus))  # type: ignore[arg-type]
            return []
        ids = (inst.gpu_instance_id, inst.compute_instance_id)
        memory = {int(info.pid): used_memory(info, PROCS_API) for info in listed or ()}
        key = f"{bus}/mig{ids[0]}.{ids[1]}"  # its own "since" for engine samples
        used = engines(mh, key, set(memory))
        return [
            GpuProcess(pid, bus, ("compute",), r, used.get(pid) or {}, mig=ids)
            for pid, r in sorted(memory.items())
        ]


def _bytes(v: Any, src: str) -> Reading:
    if v is None or int(v) >= 2**64 - 1:
        return Reading.missing(Reason.UNAVAILABLE, src, "NVML_VALUE_NOT_AVAILABLE")
    return Reading.measured(int(v), src)


def _one_row(
    pid: int, on: list[tuple[MigInstance, GpuProcess]], bus: str, problems: list[Problem]
) -> GpuProcess:
    """A process's row on this GPU: its instance's, or, when listed on several, one row with
    the measured bytes summed (unknown when any is hidden) attributed to no instance."""
    if len(on) == 1:
        return on[0][1]
    for inst, _p in on:
        why = f"PID {pid} is listed on several MIG instances: its bytes are credited to none"
        where = instance_where(inst).removeprefix("processes.")
        problems.append(Problem(where, Reason.SHARED, why, bus))
    readings = [p.dedicated for _i, p in on]
    names = ", ".join(f"{i.gpu_instance_id}/{i.compute_instance_id}" for i, _p in on)
    src = f"nvml:{PROCS_API} (sum over MIG instances {names})"
    hidden = next((r for r in readings if r.value is None), None)
    if hidden is not None:
        dedicated = Reading.missing(hidden.reason or Reason.HIDDEN, src, hidden.detail)
    else:
        dedicated = Reading(sum(int(r.value or 0) for r in readings), Kind.MEASURED, src)
    return GpuProcess(pid, bus, ("compute",), dedicated, on[0][1].engines)
