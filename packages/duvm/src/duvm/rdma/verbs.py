"""Whether the RDMA transport can run here: its compiled verbs module, and the devices.

`load()` returns `duvm.rdma._verbs` when it is built from the current source and loads, else
None; `state()` says "compiled" or why not (for doctor and the logs). There is no pure-Python
twin: without the module every peer uses TCP.
"""

from __future__ import annotations

import importlib
import select
import time
from types import ModuleType

from duvm.base import accel

MODULE = "duvm.rdma._verbs"
BUILD_FIX = (
    "install the verbs headers (Debian: apt install libibverbs-dev librdmacm-dev), then "
    "rebuild duvm (uv sync --reinstall-package duvm)"
)
ACTIVE = 4  # IBV_PORT_ACTIVE
PROBE_TICKET = bytes(32)  # a connect request with this ticket asks only "do you listen?"
REJECT_CONSUMER = 28  # IB_CM_REJ_CONSUMER_DEFINED: the listener itself said no


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


def probe(host: str, port: int, timeout: float = 3.0) -> tuple[bool, str]:
    """Whether a memserver's rdma-cm listener answers at `host`:`port`: address and route
    resolution, then a connect request with `PROBE_TICKET`, which a duvm memserver rejects
    itself (no region key exists for it). (True, the device) or (False, why not)."""
    mod = load()
    if mod is None:
        return False, f"the verbs module is {state()}"
    deadline = time.monotonic() + timeout
    try:
        channel = mod.EventChannel()
    except OSError as e:
        return False, f"no rdma-cm here ({e.strerror or e})"
    cm = None
    try:
        cm = mod.CmId.create(channel)

        def wait(want: int, step: str) -> tuple[int, int]:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([channel.fd], [], [], left)[0]:
                    raise TimeoutError(f"{step}: no answer within {timeout:g} s")
                ev = channel.get_event()
                if ev is not None:
                    if ev[0] != want and step != "connect":
                        raise OSError(f"{step}: {mod.event_name(ev[0])} (status {ev[1]})")
                    return ev[0], ev[1]

        ms = max(1, int(timeout * 1000))
        cm.resolve_addr(host, port, ms)
        wait(mod.ADDR_RESOLVED, "address resolution")
        cm.resolve_route(ms)
        wait(mod.ROUTE_RESOLVED, "route resolution")
        device = cm.device
        cm.create_domain(1, False)
        cm.connect(PROBE_TICKET, 1)
        kind, status = wait(mod.REJECTED, "connect")
        if kind == mod.REJECTED and status == REJECT_CONSUMER:
            return True, f"rdma-cm answers on {device}"
        if kind == mod.REJECTED:
            return False, f"no RDMA listener on port {port} (rejected, status {status})"
        return False, f"connect: {mod.event_name(kind)} (status {status})"
    except (OSError, TimeoutError) as e:
        return False, str(e)
    finally:
        if cm is not None:
            cm.close()
        channel.close()
