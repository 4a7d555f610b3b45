"""Where a daemon's pages are: per-peer page counts and the state snapshot that metrics and the
control socket report. Plain Python with no dependencies, so the control socket can answer
without importing the Prometheus client. Call on the daemon's event-loop thread.
"""

from __future__ import annotations

from typing import Any


def pages_per_peer(store: Any) -> list[int] | None:
    """Written pages held by each peer of a RemoteStore (a page counts once per replica);
    None when the store keeps no per-page state (not a RemoteStore)."""
    state, sets, slab = (
        getattr(store, "_state", None),
        getattr(store, "sets", None),
        getattr(store, "slab_pages", None),
    )
    clients = getattr(store, "clients", None)
    if state is None or sets is None or not slab or clients is None:
        return None
    out = [0] * len(clients)
    for s, members in enumerate(sets):
        n = state[s * slab : (s + 1) * slab].count(1)  # remote_store.DATA
        if n:
            for i in members:
                out[i] += n
    return out


def add_pages_per_peer(store: Any, health: dict[str, Any]) -> None:
    """Put each peer's `pages` (see `pages_per_peer`) into a `RemoteStore.health()` dict."""
    per = pages_per_peer(store)
    for i, p in enumerate(health.get("peers", [])):
        p["pages"] = per[i] if per is not None and i < len(per) else None


def daemon_snapshot(server: Any) -> dict[str, Any]:
    """The daemon's state for metrics and the control socket; call on the loop thread."""
    store = server.store
    while not hasattr(store, "health") and hasattr(store, "inner"):  # CryptStore wraps it
        store = store.inner
    health = store.health() if hasattr(store, "health") else None
    if health is not None:
        add_pages_per_peer(store, health)
    return {
        "export_bytes": server.store.size,
        "nbd": server.stats.as_dict(),
        "nbd_connections": server.connections,
        "store": type(server.store).__name__,
        "health": health,
    }
