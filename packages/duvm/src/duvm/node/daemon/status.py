"""What the daemon reports about itself: one typed `DaemonStatus`, read on its event loop,
which its control socket answers as JSON (`to_json`: `duvm status`, gputaskman's system panel)
and its Prometheus collector exports (`duvm.node.daemon.metrics`).

One meaning per word:

* `size_bytes`: the size of the NBD export.
* `backend`: what serves the pages, for people (`BlockStore.describe`).
* `replication`: the replication health of the store, through filters such as encryption
  (`BlockStore.health`, a `ReplicationHealth`, each peer's written pages included); None for
  a store without replicas (`--memory`).
* `counters`: every layer's counters (`BlockStore.counters`), each kept by its owner.
* `nbd`: the NBD server's counters since it started (`NbdCounts`; its `connections` counts
  every connection accepted); `open_connections` is how many are open now.
* `workers`: with `--workers N`, the pids of the processes serving now, worker 0 (this one)
  first; None with one. `counters`, `nbd` and `open_connections` are then worker 0's own.

The JSON keeps the names its readers know: "store" is the replication health with the counters
beside it, flat (null without replicas), "nbd" the NBD counters; gputaskman reads "pid",
"size_bytes", "replicas", "store" (its "peers" with "peer", "connected", "pages",
"reserved_pages", "slabs"; "replicas", "pages_written", "degraded_slabs", "pages_lost_now") and
the presence of "nbd" and "swap_device" (the block device it serves as swap, once told: see
`duvm.base.control_socket`); `duvm status` reads "store" and "request_path".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from duvm.node.daemon.nbdserver import NbdCounts, NBDServer
from duvm.store.storage import BlockStore, ReplicationHealth


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """The daemon's state at one moment (built on its loop thread by `daemon_status`)."""

    pid: int
    size_bytes: int
    replicas: int | None  # replicas wanted per slab; None without a pool (--memory)
    request_path: str | None  # "compiled" or "pure" (duvm.base.accel); None if not said
    backend: str
    replication: ReplicationHealth | None
    counters: dict[str, int]
    nbd: NbdCounts | None  # None without an NBD server (a store reported on its own)
    open_connections: int | None
    workers: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The control socket's answer (keys as documented above; unknown parts are null)."""
        return {
            "pid": self.pid,
            "size_bytes": self.size_bytes,
            "replicas": self.replicas,
            "request_path": self.request_path,
            "store": None if self.replication is None else {**self.replication, **self.counters},
            "nbd": None if self.nbd is None else dict(self.nbd),
            "workers": self.workers,
        }


def daemon_status(
    store: BlockStore,
    server: NBDServer | None,
    replicas: int | None = None,
    request_path: str | None = None,
    workers: list[int] | None = None,
) -> DaemonStatus:
    """The status of the daemon serving `store` through `server`; call on the loop thread."""
    return DaemonStatus(
        pid=os.getpid(),
        size_bytes=store.size,
        replicas=replicas,
        request_path=request_path,
        backend=store.describe(),
        replication=store.health(),  # through filters (BlockStore.health)
        counters=store.counters(),  # every layer's (BlockStore.counters)
        nbd=server.stats.as_dict() if server is not None else None,
        open_connections=server.open_connections if server is not None else None,
        workers=workers,
    )
