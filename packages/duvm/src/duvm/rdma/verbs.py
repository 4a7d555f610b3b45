"""Whether the RDMA transport can run here: its compiled verbs module, and the devices.

`load()` returns `duvm.rdma._verbs` when it is built from the current source and loads, else
None; `state()` says "compiled" or why not (for doctor and the logs). There is no pure-Python
twin: without the module every peer uses TCP.

`VerbsApi` and the protocols beside it declare the part of that module the memserver's RDMA
service uses (rdma-cm events, connection ids, protection domains, memory regions): the seam
through which tests give it a fake device (duvm.testing.fake_verbs) that enforces what a NIC
enforces, since no RDMA device is there to run the real one.
"""

from __future__ import annotations

import importlib
import select
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from duvm.base import accel

MODULE = "duvm.rdma._verbs"
BUILD_FIX = (
    "install the verbs headers (Debian: apt install libibverbs-dev librdmacm-dev), then "
    "rebuild duvm (uv sync --reinstall-package duvm)"
)
ACTIVE = 4  # IBV_PORT_ACTIVE
PROBE_TICKET = bytes(32)  # a connect request with this ticket asks only "do you listen?"
REJECT_CONSUMER = 28  # IB_CM_REJ_CONSUMER_DEFINED: the listener itself said no


class RegionApi(Protocol):
    """A registered memory region (`_verbs.Region`); `close` deregisters it: from then on the
    NIC refuses its rkey."""

    @property
    def rkey(self) -> int: ...

    def close(self) -> None: ...


class DomainApi(Protocol):
    """A protection domain with its connection's queue pair (`_verbs.Domain`)."""

    def register(self, addr: int, length: int, remote: bool) -> RegionApi: ...


class CmIdApi(Protocol):
    """One rdma-cm identifier (`_verbs.CmId`): a listener or a connection request."""

    owner: Any

    @property
    def device(self) -> str | None: ...

    def listen(self, host: str, port: int, backlog: int = 64) -> None: ...

    def max_read_depth(self) -> int: ...

    def create_domain(self, depth: int, events: bool) -> DomainApi: ...

    def accept(self, read_depth: int) -> None: ...

    def reject(self) -> None: ...

    def disconnect(self) -> None: ...

    def close(self) -> None: ...


class EventChannelApi(Protocol):
    """An rdma-cm event channel (`_verbs.EventChannel`): `fd` is readable while events wait;
    `get_event` gives one as (event, status, CmId or None, private data), or None."""

    @property
    def fd(self) -> int: ...

    def get_event(self) -> tuple[int, int, CmIdApi | None, bytes] | None: ...

    def close(self) -> None: ...


class CmIdFactory(Protocol):
    """`_verbs.CmId` as a maker of identifiers."""

    def create(self, channel: Any) -> CmIdApi: ...


class VerbsApi(Protocol):
    """What the memserver's RDMA service uses of the verbs module (`duvm.rdma._verbs`)."""

    CONNECT_REQUEST: int
    ESTABLISHED: int
    DISCONNECTED: int
    CONNECT_ERROR: int
    UNREACHABLE: int
    REJECTED: int
    DEVICE_REMOVAL: int

    @property
    def EventChannel(self) -> Callable[[], EventChannelApi]: ...

    @property
    def CmId(self) -> CmIdFactory: ...

    def event_name(self, event: int) -> str: ...


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
