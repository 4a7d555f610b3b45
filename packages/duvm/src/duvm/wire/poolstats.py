"""The daemon's state snapshot that metrics report: the store's own description and health
(per-peer page counts included, `BlockStore.health`) and the NBD server's counters. Plain
Python with no dependencies. Call on the daemon's event-loop thread.
"""

from __future__ import annotations

from typing import Any


def daemon_snapshot(server: Any) -> dict[str, Any]:
    """The daemon's state for metrics and the control socket; call on the loop thread."""
    return {
        "export_bytes": server.store.size,
        "nbd": server.stats.as_dict(),
        "nbd_connections": server.connections,
        "store": server.store.describe(),
        "health": server.store.health(),  # through filters (BlockStore.health)
        "counters": server.store.counters(),  # every layer's (BlockStore.counters)
    }
