"""Whether the RDMA transport can run here: its compiled verbs module, and the devices.

`load()` returns `duvm.rdma._verbs` when it is built from the current source and loads, else
None; `state()` says "compiled" or why not (for doctor and the logs). There is no pure-Python
twin: without the module every peer uses TCP.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from duvm.base import accel

MODULE = "duvm.rdma._verbs"
BUILD_FIX = (
    "install the verbs headers (Debian: apt install libibverbs-dev librdmacm-dev), then "
    "rebuild duvm (uv sync --reinstall-package duvm)"
)
ACTIVE = 4  # IBV_PORT_ACTIVE


def state() -> str:
    """ "compiled" when the verbs module is built, current and loads, else why not."""
    return accel.state(MODULE)


def load() -> ModuleType | None:
    return importlib.import_module(MODULE) if state() == "compiled" else None


def usable_devices() -> tuple[list[str], str]:
    """Names of the verbs devices with an active port, and, when there are none, why."""
    mod = load()
    if mod is None:
        return [], f"the verbs module is {state()}; {BUILD_FIX}"
    try:
        found = mod.devices()
    except OSError as e:
        return [], f"no verbs devices ({e.strerror or e})"
    if not found:
        return [], "no verbs devices (no RDMA NIC, and no Soft-RoCE link: rdma link add)"
    active = [name for name, ports, _ in found if ports and ACTIVE in ports]
    if not active:
        return [], "no verbs device has an active port: " + ", ".join(n for n, _, _ in found)
    return active, ""
