"""`duvm memserver`: serve this node's spare RAM to the pool as a page store.

Theory of operation:

- State (`PageStore`) is plain Python: one `Arena` of preallocated 4 KiB slots and one
  `Namespace` per client id, mapping the client's page numbers to slots. Reservations are
  promises: the sum of all namespaces' reservations never exceeds the arena, and a namespace
  never stores more pages than it reserved, so a STORE within a reservation always finds a free
  slot and receiving a page never allocates page memory. Each request method is synchronous
  (every request is served from RAM) and refuses by raising `Refused`, having changed nothing.
- The network driver (`_Conn`) is an asyncio BufferedProtocol around `pagedecode.Decoder`: the
  kernel copies received bytes straight into the decoder's preallocated buffer, STORE data is
  copied from there into arena slots, and every reply produced while handling one read is sent
  with a single `writelines` (one writev), so a pipelined burst costs one syscall each way.
- Every connection authenticates before anything else (docs/protocol.md, duvm.wire.auth): HELLO,
  the server's CHALLENGE with its proof, the client's AUTH proof, then WELCOME. Until then the
  connection decodes with a 512-byte buffer (not a 4 MiB frame buffer), must finish within
  `handshake_timeout`, and is one of at most `max_handshakes`; when that many are pending the
  oldest is dropped, so a flood of idle or slow connections delays a real client by at most
  one handshake slot instead of locking it out. Authenticated connections are capped at
  `max_connections`. A namespace belongs to the token of the client that created it: a HELLO
  naming someone else's client id with another token is DENIED, so one client can never reach
  another's pages, whatever ids it sends (keys only ever index the connection's namespace).
- A namespace outlives its connections for a lease (default 60 s): a client that reconnects
  with the same client id within the lease finds its pages and reservation; when the lease runs
  out both are freed. A frame that breaks the protocol closes that one connection with a logged
  reason; other connections and namespaces are untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import ssl
import sys
import time
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, TypeVar

from duvm.base.sockets import tune_socket
from duvm.base.units import is_loopback, parse_listen, parse_size
from duvm.memserver.arena import PAGE_SIZE, Arena
from duvm.wire import auth
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import HANDSHAKE_FRAME, NEED_DATA, Decoder, decode_frame, parse_batch
from duvm.wire.pageencode import encode, frame_header

log = logging.getLogger(__name__)
T = TypeVar("T")

_header = frame_header
_STORE, _LOAD, _FREE = int(pp.MsgType.STORE), int(pp.MsgType.LOAD), int(pp.MsgType.FREE)
_STORE_REPLY, _LOAD_REPLY = _STORE | pp.REPLY_BIT, _LOAD | pp.REPLY_BIT
_FREE_REPLY = _FREE | pp.REPLY_BIT
_FREE_BODY = pp.FREE_REPLY_BODY.pack

DEFAULT_LEASE_S = 60.0
DEFAULT_MAX_CONNECTIONS = 256  # authenticated; each holds a ~4.3 MiB receive buffer
DEFAULT_MAX_HANDSHAKES = 64  # unauthenticated; each holds ~0.5 KiB
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
SUPPORTED_VERSIONS = (pp.MIN_VERSION, pp.PROTOCOL_VERSION)


@dataclass(slots=True, eq=False)
class Namespace:
    """One attached device of one node: its pages (key -> arena slot) and its reservation."""

    client_id: str
    owner: bytes = b""  # digest of the creating client's namespace token
    reserved: int = 0
    pages: dict[int, int] = field(default_factory=dict)
    connections: int = 0
    expires_at: float | None = None  # monotonic time; set while no connection holds it
    timer: asyncio.TimerHandle | None = None


class MetricsError(Exception):
    """--metrics cannot be served (port taken, bad address); the message says which."""


class Refused(Exception):
    """A request the server declines (the reply carries `code`); it changed nothing."""

    def __init__(self, code: pp.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _no_room(new: int, ns: Namespace) -> Refused:
    return Refused(
        pp.ErrorCode.NO_SPACE,
        f"STORE of {new} new pages exceeds the reservation "
        f"({len(ns.pages)} of {ns.reserved} pages used)",
    )


class PageStore:
    """Arena, namespaces, reservations and the requests on them. No I/O."""

    def __init__(
        self, capacity_pages: int, *, lease_s: float = DEFAULT_LEASE_S, lock: bool = True
    ) -> None:
        self.arena = Arena(capacity_pages, lock=lock)
        self.lease_s = lease_s
        self.namespaces: dict[str, Namespace] = {}
        self.reserved_total = 0
        self.connections = 0
        self.started = time.monotonic()
        self.extra_status: Any = None  # callable adding the server's fields to STATUS
        # requests and pages served, by kind (STATUS reports them)
        self.counters = {
            "store_requests": 0,
            "load_requests": 0,
            "free_requests": 0,
            "pages_stored": 0,
            "pages_loaded": 0,
            "pages_freed": 0,
            "refused": 0,
        }

    @property
    def capacity_pages(self) -> int:
        return self.arena.slots

    def attach(self, client_id: str, owner: bytes = b"") -> tuple[Namespace, bool]:
        """An authenticated connection joins its namespace: found (resumed=True) or created.
        Refused (DENIED) when it exists and belongs to another token."""
        ns = self.namespaces.get(client_id)
        resumed = ns is not None
        if ns is not None and not auth.verify(ns.owner, owner):
            raise Refused(
                pp.ErrorCode.DENIED,
                f"namespace {client_id!r} belongs to another client (namespace token differs)",
            )
        if ns is None:
            ns = self.namespaces[client_id] = Namespace(client_id, owner)
        if ns.timer is not None:
            ns.timer.cancel()
            ns.timer = None
        ns.expires_at = None
        ns.connections += 1
        return ns, resumed

    def detach(self, ns: Namespace, loop: asyncio.AbstractEventLoop) -> None:
        """A connection of `ns` ended: start the lease when it was the last one."""
        ns.connections -= 1
        if ns.connections > 0 or self.namespaces.get(ns.client_id) is not ns:
            return
        if not ns.pages and not ns.reserved:
            del self.namespaces[ns.client_id]
            return
        ns.expires_at = time.monotonic() + self.lease_s
        ns.timer = loop.call_later(self.lease_s, self._expire, ns)

    def _expire(self, ns: Namespace) -> None:
        if ns.connections or self.namespaces.get(ns.client_id) is not ns:
            return
        freed = self._release(ns)
        del self.namespaces[ns.client_id]
        log.info("lease of %r expired: freed %d pages", ns.client_id, freed)

    def _release(self, ns: Namespace) -> int:
        free = self.arena.free
        for slot in sorted(ns.pages.values(), reverse=True):  # reused in ascending order
            free(slot)
        n = len(ns.pages)
        ns.pages.clear()
        self.reserved_total -= ns.reserved
        ns.reserved = 0
        return n

    # --- requests (hot ones first). Refusals raise Refused; nothing changes then. ---

    def store(self, ns: Namespace, keys: tuple[int, ...], data: memoryview) -> None:
        pages, mem, c = ns.pages, self.arena.memory, self.counters
        c["store_requests"] += 1
        c["pages_stored"] += len(keys)
        if len(keys) == 1:  # the swap path's common case, kept short
            k = keys[0]
            slot = pages.get(k)
            if slot is None:
                if len(pages) >= ns.reserved:
                    raise _no_room(1, ns)
                slot = pages[k] = self.arena.alloc()
            off = slot * PAGE_SIZE
            mem[off : off + PAGE_SIZE] = data
            return
        # The per-page work below runs in C (map, list methods) where it can: a STORE of
        # 64 or 128 pages is the swap-out path's common request.
        slots = list(map(pages.get, keys))
        new = slots.count(None)
        if new and len(pages) + new > ns.reserved:
            new = len(set(keys).difference(pages))  # exact count (duplicate keys in the batch)
            if len(pages) + new > ns.reserved:
                raise _no_room(new, ns)
        if new == len(keys) and len(set(keys)) == new:  # all new, no key twice
            slots = self.arena.alloc_many(new)
            pages.update(zip(keys, slots, strict=True))
        elif new:
            alloc = self.arena.alloc
            for i, k in enumerate(keys):
                if slots[i] is None:
                    slot = pages.get(k)  # a key repeated in the batch keeps its first slot
                    if slot is None:
                        slot = pages[k] = alloc()
                    slots[i] = slot
        first = slots[0]
        if slots[-1] - first == len(slots) - 1 and slots == list(
            range(first, first + len(slots))
        ):  # consecutive slots: one copy
            mem[first * PAGE_SIZE : (first + len(slots)) * PAGE_SIZE] = data
            return
        src = 0
        for slot in slots:
            off = slot * PAGE_SIZE
            mem[off : off + PAGE_SIZE] = data[src : src + PAGE_SIZE]
            src += PAGE_SIZE

    def load_views(self, ns: Namespace, keys: tuple[int, ...]) -> list[memoryview]:
        """The pages as views of the arena (one per run of consecutive slots), not copied:
        only for a reply written out before anything else runs (see `_Conn._send`)."""
        pages, mem, c = ns.pages, self.arena.memory, self.counters
        c["load_requests"] += 1
        c["pages_loaded"] += len(keys)
        try:
            if len(keys) == 1:
                off = pages[keys[0]] * PAGE_SIZE
                return [mem[off : off + PAGE_SIZE]]
            slots = [pages[k] for k in keys]
        except KeyError as e:
            missing = sum(1 for k in keys if k not in pages)
            raise Refused(
                pp.ErrorCode.NOT_FOUND,
                f"{missing} of {len(keys)} pages not stored, first: {e.args[0]}",
            ) from None
        views, start, prev = [], slots[0], slots[0]
        for slot in itertools.islice(slots, 1, None):
            if slot != prev + 1:
                views.append(mem[start * PAGE_SIZE : (prev + 1) * PAGE_SIZE])
                start = slot
            prev = slot
        views.append(mem[start * PAGE_SIZE : (prev + 1) * PAGE_SIZE])
        return views

    def load(self, ns: Namespace, keys: tuple[int, ...]) -> bytes:
        """The pages, copied: a view of the arena could change under a reply the transport
        still buffers (the slot freed and reused, even by another namespace)."""
        views = self.load_views(ns, keys)
        return views[0].tobytes() if len(views) == 1 else b"".join(views)

    def free(self, ns: Namespace, keys: tuple[int, ...]) -> int:
        pages, freed = ns.pages, []
        for k in keys:
            slot = pages.pop(k, None)
            if slot is not None:
                freed.append(slot)
        # Pushed in reverse, so the next batch of new pages pops them in ascending order and
        # a sequential batch again gets consecutive slots (one copy instead of one per page).
        free = self.arena.free
        for slot in reversed(freed):
            free(slot)
        n = len(freed)
        self.counters["free_requests"] += 1
        self.counters["pages_freed"] += n
        return n

    def reserve(self, ns: Namespace, want: int) -> int:
        stored = len(ns.pages)
        if want < stored:
            raise Refused(
                pp.ErrorCode.BUSY,
                f"cannot reserve {want} pages: {stored} are stored; FREE them first",
            )
        available = self.capacity_pages - self.reserved_total + ns.reserved
        if want > available:
            raise Refused(
                pp.ErrorCode.NO_SPACE,
                f"cannot reserve {want} pages "
                f"({want * PAGE_SIZE >> 20} MiB): {available} available of "
                f"{self.capacity_pages}",
            )
        self.reserved_total += want - ns.reserved
        ns.reserved = want
        return stored

    def release(self, ns: Namespace) -> int:
        return self._release(ns)

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "version": pp.PROTOCOL_VERSION,
            "page_size": PAGE_SIZE,
            "capacity_pages": self.capacity_pages,
            "used_pages": self.arena.used_slots,
            "reserved_pages": self.reserved_total,
            "free_pages": self.arena.free_slots,
            "unreserved_pages": self.capacity_pages - self.reserved_total,
            "locked": self.arena.locked,
            "lock_error": self.arena.lock_error,
            "lease_seconds": self.lease_s,
            "connections": self.connections,
            "uptime_seconds": round(now - self.started, 3),
            "counters": dict(self.counters),
            "namespaces": [
                {
                    "client_id": ns.client_id,
                    "reserved_pages": ns.reserved,
                    "stored_pages": len(ns.pages),
                    "connections": ns.connections,
                    "lease_expires_in": None
                    if ns.expires_at is None
                    else round(max(0.0, ns.expires_at - now), 3),
                }
                for ns in list(self.namespaces.values())[:1000]
            ],
            "namespaces_total": len(self.namespaces),
            **({"security": self.extra_status()} if self.extra_status else {}),
        }

    def close(self) -> None:
        for ns in self.namespaces.values():
            if ns.timer is not None:
                ns.timer.cancel()
        self.arena.close()


_IOV_MAX = 1024  # buffers per writev (Linux UIO_MAXIOV)


def _skip(bufs: list, n: int) -> list:
    """`bufs` without its first `n` bytes."""
    for i, b in enumerate(bufs):
        size = len(b)
        if n < size:
            return [b[n:], *bufs[i + 1 :]] if n else bufs[i:]
        n -= size
    return []


def _own(bufs: list) -> list:
    """Copies of the arena views in `bufs` (a queued reply must not see a slot reused)."""
    return [b.tobytes() if type(b) is memoryview else b for b in bufs]


class _Conn(asyncio.BufferedProtocol):
    """One client connection: authenticate, then decode requests, handle them, batch replies."""

    def __init__(self, server: MemServer) -> None:
        self.server = server
        self.store = server.store
        # Small until authenticated: an unauthenticated peer costs HANDSHAKE_FRAME bytes.
        self.decoder = Decoder("server", HANDSHAKE_FRAME, slack=0)
        self.transport: asyncio.Transport | None = None
        self.fd: int | None = None  # the plain socket's fd (None under TLS)
        self.ns: Namespace | None = None
        self.peer = "?"
        self.closing = False
        self.authed = False
        self.tls_verified = False  # the peer presented a certificate our CA signed
        self.last_active = 0.0
        self._hello: pp.Hello | None = None
        self._nonce_s = b""
        self._secret: bytes | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # uvloop: not a subclass
        self.transport = transport  # type: ignore[assignment]
        self.peer = str(transport.get_extra_info("peername"))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)
            if (
                transport.get_extra_info("sslcontext") is None
                and transport.get_extra_info("ssl_object") is None
            ):
                self.fd = sock.fileno()  # plain socket: replies may go out by writev
        self.tls_verified = transport.get_extra_info("peercert") is not None
        self.store.connections += 1
        self.server.conns.add(self)
        self.last_active = time.monotonic()
        self.server._pending_add(self)
        self._deadline = asyncio.get_running_loop().call_later(
            self.server.handshake_timeout, self._handshake_expired
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.store.connections -= 1
        self.server.conns.discard(self)
        self.server.pending.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
        if self.ns is not None:
            self.store.detach(self.ns, asyncio.get_running_loop())
            self.ns = None

    def _handshake_expired(self) -> None:
        if not self.authed and not self.closing:
            log.warning(
                "closing connection from %s: no authentication within %gs",
                self.peer,
                self.server.handshake_timeout,
            )
            self.server.counters["handshake_timeouts"] += 1
            self.closing = True
            self.transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        dec, out, store = self.decoder, [], self.store
        arena_views = False
        lat = self.server.latency
        dec.buffer_updated(nbytes)
        if self.server.idle_timeout is not None:
            self.last_active = time.monotonic()
        try:
            while not self.closing:
                frame = dec.next_frame()
                if frame is NEED_DATA:
                    break
                mtype, req_id, _, body = frame
                ns = self.ns
                t0 = perf_counter_ns() if lat is not None else 0
                try:
                    # The hot requests are served straight from the frame, no message objects.
                    if arena_views and mtype != _LOAD:
                        # a LOAD answered above must carry the bytes as they were when it
                        # was handled, not what a later request puts in (or frees from) a slot
                        out = _own(out)
                        arena_views = False
                    if mtype == _STORE and ns is not None:
                        keys, data = parse_batch(mtype, body)
                        store.store(ns, keys, data)
                        out.append(_header(_STORE_REPLY, req_id, 0))
                    elif mtype == _LOAD and ns is not None:
                        keys = parse_batch(mtype, body)[0]
                        if self.fd is None:
                            data = store.load(ns, keys)
                            out.append(_header(_LOAD_REPLY, req_id, len(data)))
                            out.append(data)
                        else:  # arena views, written before this call returns (_send)
                            views = store.load_views(ns, keys)
                            out.append(_header(_LOAD_REPLY, req_id, len(keys) * PAGE_SIZE))
                            out += views
                            arena_views = True
                    elif mtype == _FREE and ns is not None:
                        n = store.free(ns, parse_batch(mtype, body)[0])
                        out.append(_header(_FREE_REPLY, req_id, 8) + _FREE_BODY(n, 0))
                    else:
                        out += encode(self._dispatch(decode_frame(*frame)))
                        if self.authed and dec.max_frame == HANDSHAKE_FRAME:
                            dec = self._grow_decoder()
                except Refused as e:
                    store.counters["refused"] += 1
                    out += encode(pp.ErrorReply(req_id, pp.MsgType(mtype), e.code, str(e)))
                if lat is not None:
                    lat.observe_ns(mtype, perf_counter_ns() - t0)
        except pp.RemoteProtocolError as e:
            self._abort(str(e), _own(out) if arena_views else out)
            return
        except Exception:
            log.exception("closing connection from %s: internal error", self.peer)
            self._abort("internal error", _own(out) if arena_views else out)
            return
        if out:
            if arena_views:
                self._send(out)
            else:
                self.transport.writelines(out)
        if self.closing:
            self.transport.close()

    def _send(self, out: list) -> None:
        """Write replies that hold arena views: straight to the socket (one writev, no copy
        of the pages), since nothing can change the arena before it returns; whatever the
        socket does not take, or everything when the transport still has data queued (order),
        goes to the transport as copies, because slots may be reused before it is sent."""
        t = self.transport
        sent = 0
        if not t.get_write_buffer_size():
            try:
                for i in range(0, len(out), _IOV_MAX):
                    chunk = out[i : i + _IOV_MAX] if len(out) > _IOV_MAX else out
                    n = os.writev(self.fd, chunk)  # type: ignore[arg-type]
                    sent += n
                    if n < sum(map(len, chunk)):
                        break
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pass  # a broken connection: the transport sees it and reports it
            if sent == sum(map(len, out)):
                return
        if sent:
            out = _skip(out, sent)
        if out:
            t.writelines(_own(out))

    def _grow_decoder(self) -> Decoder:
        """Authenticated: switch to a full-size decoder, keeping bytes already received."""
        rest = self.decoder.take_pending()
        self.decoder = Decoder("server")
        if rest:
            self.decoder.receive_data(rest)
        return self.decoder

    def eof_received(self) -> bool:
        if self.decoder.buffered:
            log.warning(
                "closing connection from %s: closed inside a frame (%d bytes pending)",
                self.peer,
                self.decoder.buffered,
            )
        return False

    def _abort(self, reason: str, out: list) -> None:
        log.warning("closing connection from %s: %s", self.peer, reason)
        if out:
            self.transport.writelines(out)
        self.closing = True
        self.transport.close()

    def _dispatch(self, msg: pp.Message) -> pp.Reply:
        """The requests off the hot path (and hot ones arriving before authentication)."""
        ns, store = self.ns, self.store
        if isinstance(msg, pp.Status):
            if not self.authed and self.server.auth_required:
                # STATUS names the namespaces and their sizes: only for authenticated peers.
                return self._refuse(
                    msg.req_id,
                    pp.MsgType.STATUS,
                    pp.ErrorCode.AUTH,
                    "authentication required before STATUS",
                )
            body = json.dumps(store.status(), separators=(",", ":")).encode()
            return pp.StatusReply(msg.req_id, body)
        if isinstance(msg, pp.Hello):
            if self._hello is not None:
                raise pp.RemoteProtocolError("second HELLO on one connection")
            return self._on_hello(msg)
        if isinstance(msg, pp.Auth):
            if self._hello is None or self.authed:
                raise pp.RemoteProtocolError("AUTH without a pending HELLO")
            return self._on_auth(msg)
        if ns is None:
            self.server.counters["unauthenticated_requests"] += 1
            raise pp.RemoteProtocolError(f"{type(msg).__name__} before authentication")
        if isinstance(msg, pp.Reserve):
            stored = store.reserve(ns, msg.pages)
            return pp.ReserveReply(msg.req_id, msg.pages, stored)
        if isinstance(msg, pp.Release):
            return pp.ReleaseReply(msg.req_id, store.release(ns))
        raise AssertionError(f"unhandled request {msg!r}")

    def _refuse(
        self, req_id: int, mtype: pp.MsgType, code: pp.ErrorCode, why: str, detail: str = ""
    ) -> pp.ErrorReply:
        """Reply, log (never a secret: only ids and reasons) and close after the reply."""
        self.closing = True
        log.warning("refusing %s: %s%s", self.peer, why, detail)
        return pp.ErrorReply(req_id, mtype, code, why)

    def _on_hello(self, msg: pp.Hello) -> pp.Reply:
        lo, hi = SUPPORTED_VERSIONS
        version = min(hi, msg.max_version)
        if version < max(lo, msg.min_version) or not msg.nonce:
            return self._refuse(
                msg.req_id,
                pp.MsgType.HELLO,
                pp.ErrorCode.VERSION,
                "no common protocol version: client speaks "
                f"{msg.min_version}..{msg.max_version}, server {lo}..{hi}",
            )
        self._hello = msg
        self._nonce_s = auth.new_nonce()
        kr = self.server.keyring
        if kr is None:
            return pp.Challenge(
                msg.req_id, version, False, self._nonce_s, auth.NO_KEY, bytes(pp.PROOF_SIZE)
            )
        secret = kr.lookup(msg.key_id)
        if secret is None:
            self.server.counters["auth_failures"] += 1
            why = (
                "authentication required: no secret offered"
                if msg.key_id == auth.NO_KEY
                else "authentication failed: unknown key id"
            )
            return self._refuse(
                msg.req_id,
                pp.MsgType.HELLO,
                pp.ErrorCode.AUTH,
                why,
                f" (client id {msg.client_id!r}, key id {msg.key_id.hex()})",
            )
        self._secret = secret
        proof = auth.proof(secret, "server", msg.nonce, self._nonce_s, msg.client_id, msg.token)
        return pp.Challenge(msg.req_id, version, True, self._nonce_s, auth.key_id(secret), proof)

    def _on_auth(self, msg: pp.Auth) -> pp.Reply:
        hello, server = self._hello, self.server
        assert hello is not None
        if self._secret is not None:
            want = auth.proof(
                self._secret, "client", hello.nonce, self._nonce_s, hello.client_id, hello.token
            )
            if not auth.verify(want, msg.proof):
                server.counters["auth_failures"] += 1
                return self._refuse(
                    msg.req_id,
                    pp.MsgType.AUTH,
                    pp.ErrorCode.AUTH,
                    "authentication failed: wrong proof",
                    f" (client id {hello.client_id!r})",
                )
        elif server.tls_client_auth and not self.tls_verified:
            return self._refuse(
                msg.req_id,
                pp.MsgType.AUTH,
                pp.ErrorCode.AUTH,
                "authentication failed: no client certificate",
            )
        if sum(1 for c in server.conns if c.authed) >= server.max_connections:
            return self._refuse(
                msg.req_id,
                pp.MsgType.AUTH,
                pp.ErrorCode.BUSY,
                f"too many connections (limit {server.max_connections})",
            )
        ns, resumed = self.store.attach(hello.client_id, auth.token_digest(hello.token))
        self.ns, self.authed = ns, True
        self._secret = None
        server.pending.pop(self, None)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if resumed:
            log.info("%s resumed namespace %r (%d pages)", self.peer, ns.client_id, len(ns.pages))
        version = min(SUPPORTED_VERSIONS[1], hello.max_version)
        return pp.HelloReply(
            msg.req_id,
            version,
            resumed,
            int(self.store.lease_s * 1000),
            pp.MAX_FRAME,
            pp.MAX_BATCH,
            self.store.capacity_pages,
            ns.reserved,
            len(ns.pages),
        )


class MemServer:
    """A memserver listening on TCP. `await start()` binds and returns (host, port).

    `keyring`: cluster secrets; every connection must prove one (None: no secret check).
    `tls`: a server SSL context (auth.server_tls_context); when it requires client
    certificates, a verified certificate authenticates a client that has no secret.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        lock: bool = True,
        keyring: auth.Keyring | None = None,
        tls: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        idle_timeout: float | None = None,
    ) -> None:
        if capacity_bytes < PAGE_SIZE:
            raise ValueError(f"capacity must be at least one page ({PAGE_SIZE} bytes)")
        if max_connections < 1 or max_handshakes < 1 or handshake_timeout <= 0:
            raise ValueError("connection limits and the handshake timeout must be positive")
        self.store = PageStore(capacity_bytes // PAGE_SIZE, lease_s=lease_s, lock=lock)
        self.keyring = keyring
        self.tls = tls
        self.tls_client_auth = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.conns: set[_Conn] = set()
        self.pending: OrderedDict[_Conn, None] = OrderedDict()  # unauthenticated, oldest first
        self.counters = {
            "auth_failures": 0,
            "handshake_timeouts": 0,
            "handshakes_evicted": 0,
            "unauthenticated_requests": 0,
            "idle_closed": 0,
        }
        self.store.extra_status = self._security_status
        # duvm.wire.metrics.LatencyByKind when serving --metrics, else None (no cost per frame)
        self.latency: Any = None
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def auth_required(self) -> bool:
        return self.keyring is not None or self.tls_client_auth

    def _security_status(self) -> dict:
        return {
            "auth": "secret" if self.keyring else "tls" if self.tls_client_auth else "none",
            "tls": self.tls is not None,
            "max_connections": self.max_connections,
            "pending_handshakes": len(self.pending),
            **self.counters,
        }

    def set_keyring(self, keyring: auth.Keyring | None) -> None:
        """Swap the accepted secrets (SIGHUP after a rotation step); live connections stay."""
        self.keyring = keyring

    def _pending_add(self, conn: _Conn) -> None:
        """A new unauthenticated connection; when the slots are full, drop the oldest one."""
        while len(self.pending) >= self.max_handshakes:
            old, _ = self.pending.popitem(last=False)
            self.counters["handshakes_evicted"] += 1
            log.warning(
                "dropping unauthenticated connection from %s: %d handshakes pending",
                old.peer,
                self.max_handshakes,
            )
            old.closing = True
            if old.transport is not None:
                old.transport.abort()
        self.pending[conn] = None

    def _sweep(self) -> None:
        """Close authenticated connections idle longer than idle_timeout (when set)."""
        assert self.idle_timeout is not None
        cutoff = time.monotonic() - self.idle_timeout
        for c in list(self.conns):
            if c.authed and c.last_active < cutoff and c.transport is not None:
                log.info("closing idle connection from %s", c.peer)
                self.counters["idle_closed"] += 1
                c.transport.close()
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(max(0.05, self.idle_timeout / 4), self._sweep)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Conn(self),
            host,
            port,
            reuse_address=True,
            backlog=128,
            ssl=self.tls,
            ssl_handshake_timeout=self.handshake_timeout if self.tls else None,
        )
        if self.idle_timeout is not None:
            self._sweeper = loop.call_later(max(0.05, self.idle_timeout / 4), self._sweep)
        addr = self._server.sockets[0].getsockname()
        return addr[0], addr[1]

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self.conns):
                if conn.transport is not None:
                    conn.transport.abort()
            await self._server.wait_closed()
            self._server = None
        await asyncio.sleep(0)  # let connection_lost callbacks run before the arena goes
        self.store.close()


# --- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="address to listen on (port 0 picks a free port)",
    )
    parser.add_argument(
        "--capacity",
        required=True,
        metavar="SIZE",
        help="RAM to serve, e.g. 512M or 4G (preallocated at start)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="SECONDS",
        help=f"how long a disconnected client's pages are kept (default {DEFAULT_LEASE_S:g})",
    )
    parser.add_argument("--no-mlock", action="store_true", help="do not lock the arena in RAM")
    sec = parser.add_argument_group("security (see README: Security)")
    sec.add_argument(
        "--secret-file",
        metavar="PATH",
        help="cluster secret(s), one per line, mode 0600 (`duvm secret generate`); "
        "every client must prove one. SIGHUP re-reads it (rotation)",
    )
    sec.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate")
    sec.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    sec.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="cluster CA: clients must present a certificate it signed (mutual "
        "TLS; authenticates clients without --secret-file)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving a non-loopback address without any authentication",
    )
    sec.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"authenticated connections (default {DEFAULT_MAX_CONNECTIONS})",
    )
    sec.add_argument(
        "--max-handshakes",
        type=int,
        default=DEFAULT_MAX_HANDSHAKES,
        metavar="N",
        help="unauthenticated connections; the oldest is dropped beyond this "
        f"(default {DEFAULT_MAX_HANDSHAKES})",
    )
    sec.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time to authenticate (default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
    )
    sec.add_argument(
        "--idle-timeout",
        type=float,
        metavar="SECONDS",
        help="close authenticated connections idle this long (default: never; a "
        "swap device may rightly be idle for hours)",
    )
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 picks "
        "one; see duvm.wire.metrics)",
    )
    parser.add_argument(
        "--control-socket",
        metavar="PATH",
        help='local status socket, owner-only (JSON lines, `{"cmd": '
        '"status"}`): what this node lends and to whom, e.g. for gputaskman '
        "(e.g. /run/duvm/memserver.ctl)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every connection")


def security_from_args(
    args: argparse.Namespace, host: str
) -> tuple[auth.Keyring | None, ssl.SSLContext | None]:
    """Keyring and TLS context from the flags; ValueError/SecretError/OSError with a reason.
    Refuses to serve a network address with no authentication unless --insecure."""
    keyring = auth.Keyring.from_file(args.secret_file) if args.secret_file else None
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = auth.server_tls_context(args.tls_cert, args.tls_key, args.tls_ca)
    elif args.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    if keyring is None and not args.tls_ca and not is_loopback(host) and not args.insecure:
        raise ValueError(
            f"refusing to serve {host} without authentication: pass --secret-file "
            "(or --tls-cert/--tls-key/--tls-ca), or --insecure to accept any peer"
        )
    return keyring, tls


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


async def _serve(
    server: MemServer,
    host: str,
    port: int,
    secret_file: str | None = None,
    metrics: str | None = None,
    control: str | None = None,
) -> None:
    if metrics:  # Prometheus exposition; request latencies observed from here on
        from duvm.wire import metrics as m

        try:
            server.latency, mb = m.start_for_loop(
                m.MemserverCollector, server, m.MEMSERVER_KINDS, metrics
            )
        except OSError as e:
            raise MetricsError(f"cannot serve metrics on {metrics}: {e.strerror or e}") from None
        print(f"duvm memserver metrics on http://{mb[0]}:{mb[1]}/metrics", flush=True)
    ctl = None
    if control:  # what this node lends, to whom: for local readers such as gputaskman
        from duvm.wire import control_socket

        ctl = await control_socket.start(
            control, lambda: {"role": "memserver", **server.store.status()}
        )
    bound = await server.start(host, port)
    st = server.store
    print(
        f"duvm memserver listening on {bound[0]}:{bound[1]} "
        f"capacity {st.capacity_pages} pages ({st.capacity_pages * PAGE_SIZE >> 20} MiB) "
        f"locked {'yes' if st.arena.locked else 'no'} lease {st.lease_s:g}s "
        f"auth {server._security_status()['auth']} tls {'yes' if server.tls else 'no'}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if secret_file:
        loop.add_signal_handler(signal.SIGHUP, _reload_secrets, server, secret_file)
    try:
        await stop.wait()
    finally:
        if ctl is not None:
            ctl.close()
            with contextlib.suppress(OSError):
                os.unlink(control)  # type: ignore[arg-type]
        await server.close()


def _reload_secrets(server: MemServer, path: str) -> None:
    try:
        keyring = auth.Keyring.from_file(path)
    except auth.SecretError as e:
        log.error("SIGHUP: keeping the old secrets: %s", e)
        return
    server.set_keyring(keyring)
    log.warning("SIGHUP: re-read %s: %d secret(s) accepted", path, len(keyring.secrets))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="duvm memserver: %(levelname)s %(message)s",
    )
    try:
        host, port = parse_listen(args.listen)
        capacity = parse_size(args.capacity)
        if capacity < PAGE_SIZE:
            raise ValueError(f"capacity {args.capacity!r} is less than one page ({PAGE_SIZE} B)")
        if args.lease <= 0:
            raise ValueError("--lease must be positive")
        keyring, tls = security_from_args(args, host)
    except (ValueError, auth.SecretError) as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 2
    except (OSError, ssl.SSLError) as e:
        print(f"duvm memserver: cannot load TLS files: {e}", file=sys.stderr)
        return 2
    available = mem_available()
    if available is not None and capacity > available:
        # Populating more than the free RAM would push this node into swap or the OOM killer.
        print(
            f"duvm memserver: --capacity {args.capacity} ({capacity >> 20} MiB) exceeds this "
            f"node's available memory ({available >> 20} MiB)",
            file=sys.stderr,
        )
        return 1
    try:
        server = MemServer(
            capacity,
            lease_s=args.lease,
            lock=not args.no_mlock,
            keyring=keyring,
            tls=tls,
            max_connections=args.max_connections,
            max_handshakes=args.max_handshakes,
            handshake_timeout=args.handshake_timeout,
            idle_timeout=args.idle_timeout,
        )
    except (MemoryError, ValueError) as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 1
    if not args.no_mlock and server.store.arena.locked:
        # Every node of a symmetric cluster swaps too: a memserver whose own pages went out to
        # this node's duvm device would wait on other nodes' memservers to serve its peers,
        # which may be waiting on it. Locked (and an I/O flusher), it never waits on swap.
        # Not realtime: it is not on this node's swap path, and a busy memserver would then
        # take CPU from the node's own programs (duvm.base.pressure).
        from duvm.base import pressure

        if why := pressure.lock_in_memory():
            log.warning("cannot lock the memserver in RAM (%s): it may be swapped out", why)
        pressure.become_io_flusher()
    try:
        run_loop(
            _serve(
                server,
                host,
                port,
                args.secret_file,
                metrics=args.metrics,
                control=args.control_socket,
            )
        )
    except MetricsError as e:
        print(f"duvm memserver: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"duvm memserver: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
