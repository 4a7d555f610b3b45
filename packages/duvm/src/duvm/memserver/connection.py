"""One memserver client connection: authenticate, then decode requests, serve them from the
page store and batch the replies.

- `Connection` is an asyncio BufferedProtocol around `pagedecode.Decoder`: the kernel copies
  received bytes straight into the decoder's preallocated buffer, STORE data is copied from
  there into arena slots, and every reply produced while handling one read is sent with a
  single `writelines` (one writev), so a pipelined burst costs one syscall each way. LOAD
  replies on a plain socket go out as views of the arena, written before anything else runs
  (`Connection._send`).
- It authenticates before anything else (docs/protocol.md, duvm.wire.auth): HELLO, the
  server's CHALLENGE with its proof, the client's AUTH proof, then WELCOME. Until then it
  decodes with a 512-byte buffer (not a 4 MiB frame buffer). A HELLO naming someone else's
  client id with another token is DENIED, so one client can never reach another's pages,
  whatever ids it sends (keys only ever index the connection's namespace).
- A frame that breaks the protocol closes this one connection with a logged reason; other
  connections and namespaces are untouched. A well-framed FENCE with bad fields
  (`pp.InvalidRequest`) is answered INVALID instead, and the connection stays.
- Fencing (FENCE, docs/protocol.md): each connection has the `epoch` it last fenced with (0:
  never). Every request that changes its namespace or gives write access to it (STORE, FREE,
  RESERVE, RELEASE, RDMA_OPEN, RDMA_MAP) is refused FENCED when the namespace's epoch is
  higher, on both loops: the compiled one is told whether this connection may write and leaves
  a STORE or FREE it may not to this loop, which refuses it. LOAD and STATUS stay allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from time import perf_counter_ns
from types import ModuleType
from typing import TYPE_CHECKING

from duvm.base import accel
from duvm.base.sockets import tune_socket
from duvm.memserver.pagestore import Namespace, Refused
from duvm.wire import auth
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import HANDSHAKE_FRAME, NEED_DATA, Decoder, decode_frame, parse_batch
from duvm.wire.pageencode import encode, frame_header
from duvm.wire.pageproto import PAGE_SIZE

if TYPE_CHECKING:
    from duvm.memserver.server import MemServer

log = logging.getLogger(__name__)

_header = frame_header
_STORE, _LOAD, _FREE = int(pp.MsgType.STORE), int(pp.MsgType.LOAD), int(pp.MsgType.FREE)
_STORE_REPLY, _LOAD_REPLY = _STORE | pp.REPLY_BIT, _LOAD | pp.REPLY_BIT
_FREE_REPLY = _FREE | pp.REPLY_BIT
_FREE_BODY = pp.FREE_REPLY_BODY.pack

SUPPORTED_VERSIONS = (pp.MIN_VERSION, pp.PROTOCOL_VERSION)

# the requests off the hot path that change a namespace or give write access to it (STORE
# and FREE are checked on the hot path): refused from a connection fenced off (FENCED)
_MUTATING = {
    pp.Reserve: pp.MsgType.RESERVE,
    pp.Release: pp.MsgType.RELEASE,
    pp.RdmaOpen: pp.MsgType.RDMA_OPEN,
    pp.RdmaMap: pp.MsgType.RDMA_MAP,
    pp.Store: pp.MsgType.STORE,
    pp.Free: pp.MsgType.FREE,
}

_IOV_MAX = 1024  # buffers per writev (Linux UIO_MAXIOV)
_HOT_MODULE = "duvm.memserver._hotloop"


def compiled_loop() -> ModuleType | None:
    """The compiled STORE/LOAD/FREE loop (`_hotloop`, its `serve`) when the compiled path runs
    here, else None."""
    return accel.load(_HOT_MODULE)


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
    return [b.tobytes() if isinstance(b, memoryview) else b for b in bufs]


class Connection(asyncio.BufferedProtocol):
    """One client connection: authenticate, then decode requests, handle them, batch replies."""

    def __init__(
        self, server: MemServer, hot_loop: Callable[[], ModuleType | None] = compiled_loop
    ) -> None:
        """`hot_loop` gives the compiled loop to serve with (None: the reference loop only)."""
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
        self.epoch = 0  # the epoch this connection fenced with (FENCE); 0: never
        self._hello: pp.Hello | None = None
        self._nonce_s = b""
        self._secret: bytes | None = None
        self._deadline: asyncio.TimerHandle | None = None
        # the compiled STORE/LOAD/FREE loop (duvm.memserver._hotloop), None on the pure path
        self._hot = hot_loop()

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
        self.store.connection_opened()
        self.last_active = time.monotonic()
        self.server.connection_opened(self)
        self._deadline = asyncio.get_running_loop().call_later(
            self.server.handshake_timeout, self._handshake_expired
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.store.connection_closed()
        if self._deadline is not None:
            self._deadline.cancel()
        self.server.connection_closed(self)  # its RDMA regions go before its namespace can
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
            self.server.count("handshake_timeouts")
            self.closing = True
            self.transport.abort()

    def evict(self) -> None:
        """The server drops this unauthenticated connection (its handshake slots are full)."""
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def close_if_idle(self, cutoff: float) -> bool:
        """Close this authenticated connection if it was last active before `cutoff`
        (monotonic seconds); whether it was closed."""
        if self.authed and self.last_active < cutoff and self.transport is not None:
            self.transport.close()
            return True
        return False

    def abort(self) -> None:
        """The server is closing: drop the connection now."""
        if self.transport is not None:
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
        hot = self._hot if lat is None else None  # per-frame latency: the reference loop
        try:
            while not self.closing:
                if (
                    hot is not None
                    and self.ns is not None
                    and not arena_views
                    and not self.ns.chunk_pages  # RDMA namespaces map slots by chunk
                    and isinstance(self.ns.pages, hot.IndexCore)  # a store made compiled
                ):
                    # the compiled loop serves what it can; the frame it stops at (anything
                    # to refuse included) is the reference loop's, below. Once the reference
                    # loop has queued arena views (a large LOAD), it serves the rest of this
                    # read itself, copying them only if a STORE or FREE follows
                    buf, start, end = dec.window()
                    to = hot.serve(
                        buf,
                        start,
                        end,
                        dec.limit(_STORE),
                        dec.limit(_LOAD),
                        self.ns.pages,
                        self.ns.reserved,
                        store.arena,
                        store.arena.memory,
                        store.counters,
                        out,
                        self.epoch >= self.ns.epoch,  # may write: not fenced off
                    )
                    if to != start:
                        dec.consume(to)
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
                        if self.epoch < ns.epoch:  # a newer generation fenced the namespace
                            store.check_epoch(ns, self.epoch, pp.MsgType.STORE)
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
                        keys = parse_batch(mtype, body)[0]
                        if self.epoch < ns.epoch:
                            store.check_epoch(ns, self.epoch, pp.MsgType.FREE)
                        n = store.free(ns, keys)
                        out.append(_header(_FREE_REPLY, req_id, 8) + _FREE_BODY(n, 0))
                    else:
                        out += encode(self._dispatch(decode_frame(*frame)))
                        if self.authed and dec.max_frame == HANDSHAKE_FRAME:
                            dec = self._grow_decoder()
                except Refused as e:
                    store.refused()
                    out += encode(pp.ErrorReply(req_id, pp.MsgType(mtype), e.code, str(e)))
                except pp.InvalidRequest as e:  # whole frame, bad fields: answer, keep going
                    if self.ns is None:
                        self.server.count("unauthenticated_requests")
                        raise pp.RemoteProtocolError(f"{e} (before authentication)") from None
                    store.refused()
                    out += encode(
                        pp.ErrorReply(e.req_id, pp.MsgType(e.type), pp.ErrorCode.INVALID, str(e))
                    )
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
            self.server.count("unauthenticated_requests")
            raise pp.RemoteProtocolError(f"{type(msg).__name__} before authentication")
        rdma = self.server.rdma
        if isinstance(msg, pp.Fence):  # the RDMA service's fence hook drops older regions
            return pp.FenceReply(msg.req_id, store.fence(ns, msg.epoch, self))
        if self.epoch < ns.epoch and type(msg) in _MUTATING:
            store.check_epoch(ns, self.epoch, _MUTATING[type(msg)])
        if isinstance(msg, pp.Reserve):
            stored = store.reserve(ns, msg.pages)
            if rdma is not None:
                rdma.sync_regions(ns)
            return pp.ReserveReply(msg.req_id, msg.pages, stored)
        if isinstance(msg, pp.Release):  # the store's release hook drops RDMA regions first
            return pp.ReleaseReply(msg.req_id, store.release(ns))
        if isinstance(msg, (pp.RdmaOpen, pp.RdmaMap)):
            if rdma is None:
                raise Refused(pp.ErrorCode.INVALID, "this memserver does not serve RDMA")
            if isinstance(msg, pp.RdmaOpen):
                return rdma.open(self, ns, msg.chunk_pages, msg.req_id)
            return rdma.map(self, ns, msg.chunk, msg.req_id)
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
        if not self.server.checks_secret:
            return pp.Challenge(
                msg.req_id, version, False, self._nonce_s, auth.NO_KEY, bytes(pp.PROOF_SIZE)
            )
        secret = self.server.secret_for(msg.key_id)
        if secret is None:
            self.server.count("auth_failures")
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
                server.count("auth_failures")
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
        if not server.authenticated(self):
            return self._refuse(
                msg.req_id,
                pp.MsgType.AUTH,
                pp.ErrorCode.BUSY,
                f"too many connections (limit {server.max_connections})",
            )
        ns, resumed = self.store.attach(hello.client_id, auth.token_digest(hello.token))
        self.ns, self.authed = ns, True
        self._secret = None
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
