"""A raw page-protocol connection to a memserver, for tests that send frames the client
library never would (replayed proofs, wrong tokens, garbage)."""

from __future__ import annotations

import asyncio

from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import NEED_DATA, Decoder
from duvm.wire.pageencode import encode_bytes


async def raw_conn(addr):
    """`(ask, writer)`: `ask(msg or bytes)` sends one frame and returns the reply (None once
    the server closed the connection)."""
    reader, writer = await asyncio.open_connection(*addr)
    dec = Decoder("client")

    async def ask(msg_or_bytes) -> pp.Message | None:
        wire = msg_or_bytes if isinstance(msg_or_bytes, bytes) else encode_bytes(msg_or_bytes)
        writer.write(wire)
        while True:
            m = dec.next_event()
            if m is not NEED_DATA:
                return m
            try:
                data = await asyncio.wait_for(reader.read(1 << 16), 5)
            except ConnectionResetError:  # closed with our bytes unread: a reset, not a FIN
                return None
            if not data:
                return None
            dec.receive_data(data)

    return ask, writer
