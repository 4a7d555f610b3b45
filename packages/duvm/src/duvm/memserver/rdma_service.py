"""The memserver's RDMA side: an rdma-cm listener beside the TCP one, whose clients read and
write their own namespace's arena slots one-sided, with no memserver CPU per page.

Theory of operation
-------------------
- A client first authenticates over TCP (the page protocol's handshake), then asks RDMA_OPEN
  on that connection: the namespace becomes an RDMA namespace (`PageStore.open_rdma`) and the
  reply carries a one-time ticket (32 random bytes, valid `TICKET_TTL_S`). No key of any memory
  region exists yet.
- The client connects with rdma-cm to this listener (same address and port number: rdma-cm
  ports are their own space) with the ticket as the connect request's private data. A request
  whose ticket is unknown, used, expired, or whose TCP connection has gone is rejected. An
  accepted one becomes a `Session`: its own protection domain and queue pair, and each of its
  namespace's extents registered in that domain only. The NIC itself then refuses any other
  rkey, and any address outside those regions, on that queue pair: one client can never touch
  another's pages, whatever it posts.
- RDMA_MAP on the TCP connection maps a chunk (`PageStore.map_chunk`) and answers its address
  and the rkey of the region holding it, for this connection's session only.
- Regions go before their slots can: a session's regions are deregistered when its TCP
  connection closes, when its queue pair disconnects or fails, and whenever the namespace is
  released (RELEASE, lease expiry), by the page store itself before any slot goes back to the
  arena (`drop_regions` is its release hook). A lease expires only with no connection, hence
  no session, left.
- Fencing: when a FENCE raises a namespace's epoch, the regions of every session whose TCP
  connection has an older epoch are deregistered at once (`fence_stale`, the store's fence
  hook) and its tickets forgotten: a stale generation's queue pair could otherwise still RDMA
  WRITE into the namespace, unseen by the memserver. Such a session is never registered again
  (`sync_regions`), and a connect request from a fenced-off connection is rejected.
- Everything runs on the memserver's event loop: the event channel's fd is an asyncio reader.
- The verbs calls are a parameter (`VerbsApi`: the compiled `duvm.rdma._verbs` in production,
  duvm.testing.fake_verbs in tests), and so is the clock tickets expire by.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from duvm.memserver.pagestore import Namespace, PageStore, Refused
from duvm.rdma.verbs import (
    PROBE_TICKET,
    CmIdApi,
    DomainApi,
    EventChannelApi,
    RegionApi,
    VerbsApi,
)
from duvm.wire import pageproto as pp
from duvm.wire.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)

TICKET_TTL_S = 10.0
SEND_DEPTH = 4  # the memserver posts nothing; its queue pair needs a few entries at most


@dataclass(eq=False, slots=True)
class Session:
    """One accepted RDMA connection of one authenticated TCP connection (`owner`)."""

    cm: CmIdApi
    domain: DomainApi
    owner: object
    ns: Namespace
    regions: dict[int, RegionApi] = field(default_factory=dict)  # extent's first slot -> it
    ready: bool = False


class RdmaService:
    """The rdma-cm listener and the sessions of one memserver's `PageStore`."""

    def __init__(
        self, store: PageStore, verbs: VerbsApi, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`verbs`: the verbs module (or a fake device); `clock`: monotonic seconds."""
        self.store = store
        self.verbs = verbs
        self.clock = clock
        self.port = 0
        self.device: str | None = None
        self._channel: EventChannelApi | None = None
        self._listener: CmIdApi | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arena_address = store.arena.address
        self._tickets: dict[bytes, tuple[object, Namespace, float]] = {}
        self._sessions: dict[object, Session] = {}  # by owner (its TCP connection)
        self.counters = {"rdma_accepted": 0, "rdma_rejected": 0, "rdma_failed": 0, "rdma_probes": 0}
        store.add_release_hook(self.drop_regions)  # until close()
        store.add_fence_hook(self.fence_stale)

    def start(self, host: str, port: int) -> None:
        """Listen on `host`:`port` with rdma-cm. Raises OSError (VerbsError) when it cannot."""
        v = self.verbs
        self._channel = v.EventChannel()
        try:
            self._listener = v.CmId.create(self._channel)
            self._listener.listen(host, port)
        except OSError:
            self.close()
            raise
        self.port = port
        self.device = self._listener.device
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._channel.fd, self._on_events)

    # --- requests on an authenticated TCP connection ---

    def open(self, owner: object, ns: Namespace, chunk_pages: int, req_id: int) -> pp.Reply:
        """RDMA_OPEN: make `ns` an RDMA namespace and hand out a ticket for one connect."""
        self.store.open_rdma(ns, chunk_pages)
        now = self.clock()
        for t, (_, _, until) in list(self._tickets.items()):
            if until < now:
                del self._tickets[t]
        ticket = os.urandom(pp.NONCE_SIZE)
        self._tickets[ticket] = (owner, ns, now + TICKET_TTL_S)
        assert self._listener is not None, "start() first"
        depth = self._listener.max_read_depth()
        return pp.RdmaOpenReply(req_id, self.port, depth, ticket)

    def map(self, owner: object, ns: Namespace, chunk: int, req_id: int) -> pp.Reply:
        """RDMA_MAP: the address and this session's rkey of chunk `chunk` of `ns`."""
        s = self._sessions.get(owner)
        if s is None or not s.ready or s.ns is not ns:
            raise Refused(
                pp.ErrorCode.INVALID,
                "no RDMA connection belongs to this connection: RDMA_OPEN and connect first",
            )
        first = self.store.map_chunk(ns, chunk)  # from extents already registered (RESERVE)
        for start, count in ns.extents:
            if start <= first < start + count:
                region = s.regions[start]
                break
        else:  # map_chunk hands out slots of the namespace's own extents only
            raise AssertionError(f"chunk at slot {first} is in no extent of {ns.client_id!r}")
        address = self._arena_address + first * PAGE_SIZE
        return pp.RdmaMapReply(req_id, address, region.rkey, ns.chunk_pages)

    def sync_regions(self, ns: Namespace) -> None:
        """Register every extent of `ns` (a RESERVE may have added some) in its sessions."""
        for s in self._sessions.values():
            if s.ns is ns and not _stale(s.owner, ns):
                self._register(s)

    def drop_regions(self, ns: Namespace) -> None:
        """Deregister every region over `ns`'s slots (the store's release hook: before they
        go back to the arena): from now on its clients' rkeys are refused."""
        for s in self._sessions.values():
            if s.ns is ns:
                for region in s.regions.values():
                    region.close()
                s.regions.clear()

    def fence_stale(self, ns: Namespace) -> None:
        """`ns.epoch` rose (the store's fence hook): deregister the regions of the sessions
        whose connection has an older epoch, so their rkeys are refused from now on, and
        forget those connections' tickets."""
        for t, (o, tns, _) in list(self._tickets.items()):
            if tns is ns and _stale(o, ns):
                del self._tickets[t]
        for s in self._sessions.values():
            if s.ns is ns and _stale(s.owner, ns) and s.regions:
                for region in s.regions.values():
                    region.close()
                s.regions.clear()
                log.warning(
                    "namespace %r fenced at epoch %d: dropped the RDMA regions of a connection "
                    "of epoch %d",
                    ns.client_id,
                    ns.epoch,
                    _epoch(s.owner),
                )

    def closed(self, owner: object) -> None:
        """`owner`'s TCP connection is gone: its ticket and its session go with it."""
        for t, (o, _, _) in list(self._tickets.items()):
            if o is owner:
                del self._tickets[t]
        s = self._sessions.pop(owner, None)
        if s is not None:
            self._close_session(s)

    def status(self) -> dict:
        return {
            "listening": self._channel is not None,
            "port": self.port,
            "device": self.device,
            "sessions": sum(1 for s in self._sessions.values() if s.ready),
            **self.counters,
        }

    def close(self) -> None:
        self.store.remove_release_hook(self.drop_regions)
        self.store.remove_fence_hook(self.fence_stale)
        for s in list(self._sessions.values()):
            self._close_session(s)
        self._sessions.clear()
        self._tickets.clear()
        if self._loop is not None and self._channel is not None:
            self._loop.remove_reader(self._channel.fd)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # --- rdma-cm events ---

    def _register(self, s: Session) -> None:
        for first, count in s.ns.extents:
            if first not in s.regions:
                s.regions[first] = s.domain.register(
                    self._arena_address + first * PAGE_SIZE, count * PAGE_SIZE, True
                )

    def _on_events(self) -> None:
        v = self.verbs
        while self._channel is not None:
            try:
                ev = self._channel.get_event()
            except OSError as e:
                log.error("rdma-cm events: %s", e)
                return
            if ev is None:
                return
            kind, status, cm, data = ev
            if cm is None:
                continue
            if kind == v.CONNECT_REQUEST:
                self._on_connect_request(cm, data)
            elif kind == v.ESTABLISHED:
                if isinstance(cm.owner, Session):
                    cm.owner.ready = True
                    log.info(
                        "RDMA connection of namespace %r established on %s",
                        cm.owner.ns.client_id,
                        cm.device,
                    )
            elif kind in (
                v.DISCONNECTED,
                v.CONNECT_ERROR,
                v.UNREACHABLE,
                v.REJECTED,
                v.DEVICE_REMOVAL,
            ):
                s = cm.owner
                if isinstance(s, Session):
                    if kind != v.DISCONNECTED:
                        self.counters["rdma_failed"] += 1
                        log.warning(
                            "RDMA connection of namespace %r: %s (status %d)",
                            s.ns.client_id,
                            v.event_name(kind),
                            status,
                        )
                    self._sessions.pop(s.owner, None)
                    self._close_session(s)
                elif cm is not self._listener:
                    cm.close()

    def _on_connect_request(self, cm: CmIdApi, data: bytes) -> None:
        ticket = bytes(data[: pp.NONCE_SIZE])
        if ticket == PROBE_TICKET:  # `duvm doctor` asking whether we listen: no, politely
            self.counters["rdma_probes"] += 1
            cm.reject()
            cm.close()
            return
        found = self._tickets.pop(ticket, None)
        owner, ns, until = found if found is not None else (None, None, 0.0)
        why = ""
        if found is None:
            why = "unknown or used ticket"
        elif until < self.clock():
            why = "expired ticket"
        elif ns.chunk_pages == 0 or self.store.namespaces.get(ns.client_id) is not ns:
            why = "its namespace is gone"
        elif owner in self._sessions:
            why = "its connection already has an RDMA connection"
        elif _stale(owner, ns):
            why = "its connection was fenced off (a newer epoch holds the namespace)"
        if why:
            self.counters["rdma_rejected"] += 1
            log.warning("rejecting an RDMA connect request: %s", why)
            cm.reject()
            cm.close()
            return
        assert ns is not None
        try:
            domain = cm.create_domain(SEND_DEPTH, False)
            s = Session(cm, domain, owner, ns)
            cm.owner = s
            self._register(s)
            cm.accept(cm.max_read_depth())
        except OSError as e:
            self.counters["rdma_failed"] += 1
            log.error("cannot accept the RDMA connection of %r: %s", ns.client_id, e)
            cm.owner = None
            cm.reject()
            cm.close()
            return
        self._sessions[owner] = s
        self.counters["rdma_accepted"] += 1

    def _close_session(self, s: Session) -> None:
        s.ready = False
        s.regions.clear()  # closing the id deregisters them with its domain
        s.cm.owner = None
        s.cm.disconnect()
        s.cm.close()


def _epoch(owner: object) -> int:
    """The FENCE epoch of a session's TCP connection (0: never fenced, or not a connection)."""
    return getattr(owner, "epoch", 0)


def _stale(owner: object, ns: Namespace) -> bool:
    """Whether `owner`'s connection is of an older epoch than its namespace (fenced off)."""
    return _epoch(owner) < ns.epoch
