"""What is done to a daemon's memory clients together (`memclient.MemClient`, one per
memserver), as opposed to what one client does on its own connection.

- `fence_all`: a standby taking over fences every memserver at once with its epoch
  (`MemClient.set_epoch` on each, concurrently); one peer's refusal or absence is reported
  for that peer, never raised, so the others are fenced all the same.
- `reload_client_keyring`: SIGHUP in the daemon re-reads the secret file into every client's
  security, so each one's next connect proves the new current secret.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from duvm.wire import pageproto as pp
from duvm.wire.auth import Keyring, SecretError

if TYPE_CHECKING:
    from duvm.store.memclient import MemClient


async def fence_all(clients: Iterable[MemClient], epoch: int) -> list[int | Exception | None]:
    """`set_epoch(epoch)` on every client at once (a standby taking over): per client, in
    order, the namespace's epoch, None when it is not connected (its next connect fences), or
    the exception its FENCE met (PageServerError(FENCED): that memserver holds a newer
    generation; MemserverUnreachable: unreachable now, its reconnect fences). Never raises
    for one peer."""
    pp.Fence(0, epoch)
    res = await asyncio.gather(*(c.set_epoch(epoch) for c in clients), return_exceptions=True)
    for r in res:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation and the like are not a peer's answer
    return res  # type: ignore[return-value]


def reload_client_keyring(clients: list[MemClient], path: str) -> str:
    """SIGHUP in the daemon: re-read the secret file into every MemClient's security (their
    next connect proves the new current secret). Returns a log line without any secret."""
    try:
        keyring = Keyring.from_file(path)
    except SecretError as e:
        return f"SIGHUP: keeping the old secrets: {e}"
    for c in clients:
        if c.security is not None:
            c.security = dataclasses.replace(c.security, keyring=keyring)
    return f"SIGHUP: re-read {path}: current key id {keyring.current_id.hex()}"
