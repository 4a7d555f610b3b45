"""The RDMA side of one memory client (`memclient.MemClient`): after each handshake, get an
RDMA connection (`rdma_link.open_link`) or say why not, and tell the client when it breaks.

- Transport (`MemClient.transport`): "tcp" moves pages in STORE/LOAD frames; "rdma" and
  "auto" open an RDMA connection after each handshake (`open_rdma`): STOREs and LOADs then
  move by one-sided RDMA WRITE/READ into the memserver's arena, and the TCP connection
  carries the rest (RESERVE, chunk maps, FREE, STATUS) and tells a dead peer. "rdma" fails
  the connection when RDMA cannot be had; "auto" then uses TCP and says why (`rdma_error`).
- The staging buffer (`rdma_link.new_staging`) is made at the first RDMA connection and kept
  on the client across reconnects; with `MemClient.staging_file` (the daemon's, on its ramfs
  state directory) it is that file's pages, shared with the standby.
- A broken RDMA connection drops the TCP one too (`MemClient.abort`), so the store fails over
  exactly as for a lost TCP connection; the reconnect tries RDMA again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from duvm.rdma import verbs
from duvm.store.memclient_send import LOAD, STORE
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.rdma_link import LinkError, RdmaOwner, new_staging, open_link
from duvm.wire import pageproto as pp

if TYPE_CHECKING:
    from duvm.store.memclient import MemClient
    from duvm.store.memclient_replies import ReplyProtocol

log = logging.getLogger(__name__)


async def open_rdma(client: MemClient, proto: ReplyProtocol) -> None:
    """After the handshake: get `client` an RDMA connection (`client.rdma`), or say why not
    (`client.rdma_error`; see module doc). With transport "rdma", no RDMA drops the
    connection `proto` and raises MemserverUnreachable."""
    why = None
    v = verbs.load()
    if v is None:
        why = f"the RDMA transport is not built ({verbs.state()})"
    else:
        try:
            if client._staging is None:
                client._staging = new_staging(v, path=client.staging_file)
            reply = await client._request(pp.RdmaOpen(0, client.chunk_pages))
            client.rdma = await open_link(
                v,
                client.host,
                reply,
                client.chunk_pages,
                client.peer,
                _owner(client),
                client._staging,
            )
        except PageServerError as e:
            why = f"the memserver refused RDMA: {e}"
        except LinkError as e:
            why = str(e)
    if why is None:
        client.rdma_error = None
        log.info("memserver %s: pages move by RDMA (%s)", client.peer, client.rdma.device)
        return
    if client.transport == "rdma":
        client.rdma_error = why
        proto.transport.abort()
        client._proto = None
        client.hello = None
        client.queue.disconnected()
        raise MemserverUnreachable(f"memserver {client.peer}: no RDMA connection: {why}")
    if why != client.rdma_error:
        log.warning("memserver %s: pages move by TCP, not RDMA: %s", client.peer, why)
    client.rdma_error = why


def _owner(client: MemClient) -> RdmaOwner:
    """What the link needs from `client`: its TCP requests (setup, chunk maps), the TCP path
    for a request the staging buffer cannot take, and word that the link broke."""

    def tcp_cb(write: bool, keys: tuple[int, ...], buf: memoryview, cb: Callable) -> None:
        (client.queue.store_cb if write else client.queue.load_cb)(keys, buf, cb)

    def tcp_batch(write: bool, keys: tuple[int, ...], buf: memoryview) -> Awaitable[Any]:
        if write:
            return client.queue.queue(STORE, keys, buf, None)
        return client.queue.queue(LOAD, keys, None, buf)

    def broken(why: str) -> None:
        """The RDMA connection broke: drop the TCP one too (the store fails over as for any
        lost connection; the reconnect tries RDMA again)."""
        client.rdma = None
        client.rdma_error = why
        client.abort(f"RDMA connection broken ({why})")

    return RdmaOwner(client._request, tcp_cb, tcp_batch, broken)
