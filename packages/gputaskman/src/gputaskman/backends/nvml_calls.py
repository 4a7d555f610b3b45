"""What every NVML module shares: the one error map (`reason_for`), one call (`call`: a value,
or a missing reading with the reason; a lost GPU raises `Lost`), and NVML's values made
readings (`number`, with the NOT_AVAILABLE sentinels) or text (`text_of`).

`pynvml` (the ``nvidia-ml-py`` package) names its error classes ``NVMLError_<CamelCase>``;
the map reads those names along the exception's classes, so a mocked library raising the
real classes, or a binding's subclass, maps the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from gputaskman.base.readings import Reading, Reason

NOT_AVAILABLE_ULL = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE as unsigned long long
NOT_AVAILABLE_UINT = 2**32 - 1

# NVML error class name (pynvml generates NVMLError_<CamelCase>) -> reason.
_REASONS: dict[str, Reason] = {
    "NVMLError_LibraryNotFound": Reason.NO_LIBRARY,
    "NVMLError_DriverNotLoaded": Reason.NO_DRIVER,
    "NVMLError_NoPermission": Reason.DENIED,
    "NVMLError_NotSupported": Reason.NOT_SUPPORTED,
    "NVMLError_FunctionNotFound": Reason.NOT_SUPPORTED,
    "NVMLError_GpuIsLost": Reason.GPU_LOST,
    "NVMLError_GpuNotFound": Reason.GPU_LOST,
    "NVMLError_NoData": Reason.UNAVAILABLE,
    "NVMLError_NotFound": Reason.UNAVAILABLE,
    "NVMLError_NotReady": Reason.UNAVAILABLE,
}

T = TypeVar("T")


def reason_for(exc: BaseException) -> Reason:
    """The one place an NVML (or binding) error becomes a Reason."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _REASONS:
            return _REASONS[cls.__name__]
    return Reason.QUERY_FAILED


def is_error(exc: BaseException, name: str) -> bool:
    """Whether `exc` is pynvml's ``NVMLError_<name>`` (``Timeout``, ``FunctionNotFound``)."""
    return any(cls.__name__ == f"NVMLError_{name}" for cls in type(exc).__mro__)


def detail_of(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ can itself call into NVML
        text = ""
    return text or type(exc).__name__


def text_of(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace").strip("\x00").strip()
    return str(v).strip()


def normalise_bus_id(bus: str) -> str:
    """``00000000:01:00.0`` in lower case: the pairing key across probes."""
    return bus.strip().lower()


class Lost(Exception):
    """Raised inside one adapter's sampling once NVML said the GPU is lost."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def missing_for(exc: BaseException, api: str) -> Reading:
    """The missing reading an NVML error on `api` stands for."""
    return Reading.missing(reason_for(exc), f"nvml:{api}", detail_of(exc))


def call(fn: Callable[[], T], source: str) -> tuple[T | None, Reading | None]:
    """Run one NVML call: (value, None) or (None, missing reading with the reason).
    A lost GPU aborts the adapter (raises `Lost`)."""
    try:
        return fn(), None
    except Exception as exc:
        if reason_for(exc) is Reason.GPU_LOST:
            raise Lost(detail_of(exc)) from exc
        return None, missing_for(exc, source)


def number(v: Any, api: str, scale: float = 1.0) -> Reading:
    """A measured NVML number; the NOT_AVAILABLE sentinels become a missing reading."""
    if v is None or v in (NOT_AVAILABLE_ULL, NOT_AVAILABLE_UINT):
        return Reading.missing(Reason.UNAVAILABLE, f"nvml:{api}", "NVML_VALUE_NOT_AVAILABLE")
    value: int | float = int(v) if scale == 1.0 else round(float(v) * scale, 3)
    return Reading.measured(value, f"nvml:{api}")


def used_memory(info: Any, api: str) -> Reading:
    """A listed process's ``usedGpuMemory``: measured, or hidden by the driver (pynvml's
    None for NVML_VALUE_NOT_AVAILABLE, or the raw sentinel), never 0."""
    used = info.usedGpuMemory
    if used is None or used in (NOT_AVAILABLE_ULL, NOT_AVAILABLE_UINT):
        return Reading.missing(
            Reason.HIDDEN,
            f"nvml:{api}",
            "NVML lists the process but withholds usedGpuMemory "
            "(container PID namespace or permissions)",
        )
    return Reading.measured(int(used), f"nvml:{api}")
