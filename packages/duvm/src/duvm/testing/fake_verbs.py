"""A fake verbs device for tests: rdma-cm events, protection domains and memory regions with
the checks a NIC makes, so the memserver's RDMA service runs its real code on a real event
loop where no RDMA device is (this machine, CI).

Theory of operation
-------------------
- `FakeVerbs` has the names of `duvm.rdma._verbs` the memserver uses
  (`duvm.rdma.verbs.VerbsApi`: `EventChannel`, `CmId.create`, the event numbers of librdmacm,
  `event_name`), and is passed where that module goes (`RdmaService(store, verbs)`,
  `MemServer.start_rdma(..., load_verbs=...)`). A test checks its names and signatures
  against the compiled module's where that is built.
- An `EventChannel`'s fd is the read end of a non-blocking pipe holding one byte per queued
  event, so the service's asyncio reader wakes as it does on the real channel; an event of an
  id closed since it was queued comes out with no id, as the real channel's does.
- The test plays the client: `connect(ticket)` queues CONNECT_REQUEST on the listener's
  channel with the ticket as private data and returns a `FakeClient`, the client's end of the
  queue pair. The service's `accept` queues ESTABLISHED; `FakeClient.disconnect` queues
  DISCONNECTED; the service's `disconnect` or `close` ends the connection.
- `FakeClient.read`/`write` are one-sided RDMA READ and WRITE on that queue pair. The NIC does
  one only while the connection is up and when the whole range lies inside one live region,
  registered for remote access in the server side's protection domain, whose rkey the request
  carries; it then really copies the memory at that address (ctypes). Anything else raises
  `RemoteAccessError` (IBV_WC_REM_ACCESS_ERR on a real NIC) having touched nothing.
- `on_deregister(region)` is called as each region is deregistered (its `close`, or its id's),
  so a test can check what else holds at that moment.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# librdmacm's enum rdma_cm_event_type, in order (the values duvm.rdma._verbs exports)
_EVENTS = (
    "ADDR_RESOLVED",
    "ADDR_ERROR",
    "ROUTE_RESOLVED",
    "ROUTE_ERROR",
    "CONNECT_REQUEST",
    "CONNECT_RESPONSE",
    "CONNECT_ERROR",
    "UNREACHABLE",
    "REJECTED",
    "ESTABLISHED",
    "DISCONNECTED",
    "DEVICE_REMOVAL",
    "MULTICAST_JOIN",
    "MULTICAST_ERROR",
    "ADDR_CHANGE",
    "TIMEWAIT_EXIT",
)
ADDR_RESOLVED, ADDR_ERROR, ROUTE_RESOLVED, ROUTE_ERROR = 0, 1, 2, 3
CONNECT_REQUEST, CONNECT_ERROR, UNREACHABLE, REJECTED = 4, 6, 7, 8
ESTABLISHED, DISCONNECTED, DEVICE_REMOVAL, TIMEWAIT_EXIT = 9, 10, 11, 15


class VerbsError(OSError):
    """A verbs call the fake refuses (as `_verbs.VerbsError`)."""


class RemoteAccessError(OSError):
    """The NIC refused a one-sided READ or WRITE (a real one completes it with
    IBV_WC_REM_ACCESS_ERR and moves the queue pair to error)."""


class Region:
    """A registered memory region (`_verbs.Region`)."""

    def __init__(
        self, device: FakeVerbs, domain: Domain, addr: int, length: int, remote: bool
    ) -> None:
        self._device, self._domain = device, domain
        self.addr, self.length, self.remote = addr, length, remote
        self._key = next(device._keys)
        self.registered = True

    @property
    def lkey(self) -> int:
        return self._key if self.registered else 0

    @property
    def rkey(self) -> int:
        return self._key if self.registered else 0

    def close(self) -> None:
        """Deregister: from now on the NIC refuses this region's key."""
        if self.registered:
            self.registered = False
            self._domain.regions.remove(self)
            if self._device.on_deregister is not None:
                self._device.on_deregister(self)

    def covers(self, rkey: int, addr: int, length: int) -> bool:
        """Whether the NIC lets a remote request with `rkey` reach [addr, addr + length)."""
        return (
            self.registered
            and self.remote
            and rkey == self._key
            and self.addr <= addr
            and addr + length <= self.addr + self.length
        )


class Domain:
    """A protection domain with its connection's queue pair (`_verbs.Domain`)."""

    def __init__(self, device: FakeVerbs, depth: int) -> None:
        self._device = device
        self.depth = depth
        self.regions: list[Region] = []
        self.fd = -1

    def register(self, addr: int, length: int, remote: bool) -> Region:
        if addr <= 0 or length <= 0:
            raise VerbsError(22, f"ibv_reg_mr of {length} bytes: Invalid argument")
        region = Region(self._device, self, addr, length, remote)
        self.regions.append(region)
        return region

    def _close(self) -> None:
        for region in list(self.regions):
            region.close()


@dataclass(eq=False)
class FakeClient:
    """The client's end of one connection: its state, and its one-sided READ and WRITE."""

    device: FakeVerbs
    cm: CmId  # the server side's id of this connection
    state: str = "requested"  # accepted, rejected, disconnected

    def _check(self, rkey: int, addr: int, length: int) -> None:
        if self.state != "accepted" or self.cm.domain is None or self.cm.closed:
            raise RemoteAccessError(f"queue pair not connected ({self.state})")
        if length <= 0 or not any(r.covers(rkey, addr, length) for r in self.cm.domain.regions):
            raise RemoteAccessError(
                f"remote access error: rkey {rkey:#x}, {length} bytes at {addr:#x}"
            )

    def read(self, addr: int, length: int, rkey: int) -> bytes:
        """RDMA READ of `length` bytes at the server's `addr` with `rkey`."""
        self._check(rkey, addr, length)
        return ctypes.string_at(addr, length)

    def write(self, addr: int, data: bytes, rkey: int) -> None:
        """RDMA WRITE of `data` to the server's `addr` with `rkey`."""
        self._check(rkey, addr, len(data))
        ctypes.memmove(addr, data, len(data))

    def disconnect(self) -> None:
        """The client disconnects: DISCONNECTED reaches the server's channel."""
        if self.state == "accepted":
            self.state = "disconnected"
            self.cm.channel._queue(DISCONNECTED, 0, self.cm, b"")


class EventChannel:
    """An rdma-cm event channel (`_verbs.EventChannel`)."""

    def __init__(self, device: FakeVerbs) -> None:
        self._device = device
        self._events: deque[tuple[int, int, CmId, bytes]] = deque()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self.ids: set[CmId] = set()

    @property
    def fd(self) -> int:
        return self._r

    def _queue(self, kind: int, status: int, cm: CmId, data: bytes) -> None:
        if self._r < 0:
            return
        self._events.append((kind, status, cm, data))
        os.write(self._w, b"\0")

    def get_event(self) -> tuple[int, int, CmId | None, bytes] | None:
        if self._r < 0:
            return None
        try:
            os.read(self._r, 1)
        except BlockingIOError:
            return None
        kind, status, cm, data = self._events.popleft()
        return kind, status, (None if cm.closed else cm), data

    def close(self) -> None:
        """Closed once no id is left on it (as the real channel)."""
        if self._r >= 0 and not self.ids:
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1


class CmId:
    """One rdma-cm identifier (`_verbs.CmId`): a listener, or a connection request."""

    def __init__(self, channel: EventChannel, listener: CmId | None = None) -> None:
        self.channel = channel
        self.listener = listener
        self.owner: Any = None
        self.domain: Domain | None = None
        self.client: FakeClient | None = None
        self.closed = False
        self._bound = listener is not None
        channel.ids.add(self)

    @staticmethod
    def create(channel: EventChannel) -> CmId:
        return CmId(channel)

    @property
    def device(self) -> str | None:
        return self.channel._device.name if self._bound else None

    def listen(self, host: str, port: int, backlog: int = 64) -> None:
        device = self.channel._device
        if device.listener is not None:
            raise VerbsError(98, f"rdma_bind_addr({host}:{port}): Address already in use")
        self._bound = True
        device.listener = self

    def resolve_addr(self, host: str, port: int, timeout_ms: int = 2000) -> None:
        raise VerbsError(95, "the fake device has only a listening side")

    def resolve_route(self, timeout_ms: int = 2000) -> None:
        raise VerbsError(95, "the fake device has only a listening side")

    def connect(self, private_data: bytes, read_depth: int) -> None:
        raise VerbsError(95, "the fake device has only a listening side")

    def max_read_depth(self) -> int:
        return self.channel._device.read_depth if self._bound else 1

    def create_domain(self, depth: int, events: bool) -> Domain:
        if not self._bound:
            raise VerbsError(22, "no device: resolve the address first")
        self.domain = Domain(self.channel._device, depth)
        return self.domain

    def accept(self, read_depth: int) -> None:
        if self.client is None or self.domain is None or self.client.state != "requested":
            raise VerbsError(22, "rdma_accept: Invalid argument")
        self.client.state = "accepted"
        self.channel._queue(ESTABLISHED, 0, self, b"")

    def reject(self) -> None:
        if self.client is not None and self.client.state == "requested":
            self.client.state = "rejected"

    def disconnect(self) -> None:
        if self.client is not None and self.client.state == "accepted":
            self.client.state = "disconnected"
            self.channel._queue(DISCONNECTED, 0, self, b"")

    def close(self) -> None:
        """Destroy the queue pair, the domain's regions and the id itself."""
        if self.closed:
            return
        if self.client is not None and self.client.state in ("requested", "accepted"):
            self.client.state = "disconnected"
        if self.domain is not None:
            self.domain._close()
            self.domain = None
        self.closed = True
        self.channel.ids.discard(self)
        if self.channel._device.listener is self:
            self.channel._device.listener = None


class FakeVerbs:
    """One fake verbs device and its rdma-cm: pass it where `duvm.rdma._verbs` goes."""

    ADDR_RESOLVED = ADDR_RESOLVED
    ADDR_ERROR = ADDR_ERROR
    ROUTE_RESOLVED = ROUTE_RESOLVED
    ROUTE_ERROR = ROUTE_ERROR
    CONNECT_REQUEST = CONNECT_REQUEST
    CONNECT_ERROR = CONNECT_ERROR
    UNREACHABLE = UNREACHABLE
    REJECTED = REJECTED
    ESTABLISHED = ESTABLISHED
    DISCONNECTED = DISCONNECTED
    DEVICE_REMOVAL = DEVICE_REMOVAL
    TIMEWAIT_EXIT = TIMEWAIT_EXIT
    CmId = CmId
    VerbsError = VerbsError

    def __init__(
        self,
        name: str = "fake0",
        read_depth: int = 16,
        on_deregister: Callable[[Region], None] | None = None,
    ) -> None:
        self.name = name
        self.read_depth = read_depth
        self.on_deregister = on_deregister
        self.listener: CmId | None = None
        self._keys = itertools.count(0x1000, 0x101)

    def EventChannel(self) -> EventChannel:
        return EventChannel(self)

    @staticmethod
    def event_name(event: int) -> str:
        known = 0 <= event < len(_EVENTS)
        return f"RDMA_CM_EVENT_{_EVENTS[event]}" if known else "UNKNOWN EVENT"

    def connect(self, private_data: bytes) -> FakeClient:
        """A client's connect request to the listener, with `private_data` (the ticket)."""
        if self.listener is None:
            raise ConnectionRefusedError("no rdma-cm listener on the fake device")
        cm = CmId(self.listener.channel, self.listener)
        client = cm.client = FakeClient(self, cm)
        cm.channel._queue(CONNECT_REQUEST, 0, cm, bytes(private_data))
        return client
