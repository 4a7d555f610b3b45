"""One memserver's STATUS, asked without joining any namespace (monitoring, `duvm status`,
`duvm doctor`)."""

from __future__ import annotations

import asyncio
import json
import secrets

from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.wire import pageproto as pp
from duvm.wire.auth import PeerSecurity
from duvm.wire.pagedecode import NEED_DATA, Decoder
from duvm.wire.pageencode import encode_bytes


async def query_status(
    host: str, port: int, *, timeout: float = 5.0, security: PeerSecurity | None = None
) -> dict:
    """One memserver's STATUS without joining any namespace (monitoring, `duvm status`).
    Raises MemserverUnreachable when it cannot be reached within `timeout`. With a secret or
    TLS (`security`) it authenticates first, under a throwaway
    client id that holds nothing."""
    peer = f"{host}:{port}"
    if security is not None and (security.keyring is not None or security.tls is not None):
        client = MemClient(
            host,
            port,
            f"status-{secrets.token_hex(8)}",
            connect_timeout=timeout,
            retries=0,
            security=security,
        )
        try:
            async with asyncio.timeout(timeout):
                await client.connect()
                return await client.status()
        except TimeoutError:
            raise MemserverUnreachable(f"cannot reach memserver {peer}: timed out") from None
        finally:
            await client.close()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(encode_bytes(pp.Status(1)))
                dec = Decoder("client")
                while True:
                    msg = dec.next_event()
                    if msg is not NEED_DATA:
                        break
                    dec.receive_data(await reader.read(1 << 16))  # b"" marks the end
            finally:
                writer.close()
    except (OSError, TimeoutError) as e:
        reason = "timed out" if isinstance(e, TimeoutError) else e.strerror or e
        raise MemserverUnreachable(f"cannot reach memserver {peer}: {reason}") from None
    except pp.RemoteProtocolError as e:
        raise MemserverUnreachable(f"memserver {peer} answered STATUS badly: {e}") from None
    if isinstance(msg, pp.ErrorReply):
        raise PageServerError(msg.code, msg.message, peer)
    if not isinstance(msg, pp.StatusReply):
        raise MemserverUnreachable(f"memserver {peer} answered STATUS with {type(msg).__name__}")
    return json.loads(msg.json)
