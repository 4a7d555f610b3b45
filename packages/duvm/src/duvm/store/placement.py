"""Where slabs live: power-of-two-choices placement over memservers' free room.

Theory of operation: for each replica of a slab we draw two distinct eligible peers at random
and take the one with more free room (ties: the lower index). Eligible means the peer has room
for the whole slab and holds no other replica of that slab, so no node ever holds two copies of
one page. Two random choices instead of "the emptiest peer" keep the load balanced within a
small factor of optimal while no single peer is chosen by every daemon at once (the thundering
herd a global minimum invites when many daemons place at the same time). Pure functions over
plain lists: the caller owns the state; a seeded `random.Random` makes tests reproducible.

Peers are deduplicated by address before any of this (`normalize_peers`): "localhost:7070" and
"127.0.0.1:7070" are one memserver, and two replicas on it would be one copy.
"""

from __future__ import annotations

import errno
import random
import socket

from duvm.store.storage import PAGE_SIZE, StorageError


def default_replicas(peers: int) -> int:
    """Copies of each page when none is configured: 2 whenever the pool allows it (a memserver
    that dies then costs nothing), else 1 (with a warning)."""
    return 2 if peers >= 2 else 1


def normalize_peers(peers: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The peers as given, checked to name distinct memservers. A name that resolves to the same
    address and port as an earlier one raises ValueError ("listed twice")."""
    seen: dict[tuple[str, int], tuple[str, int]] = {}
    for host, port in peers:
        try:
            addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
        except (OSError, UnicodeError):
            addr = host.lower()  # unresolvable now: connect() will say so
        key = (addr, port)
        if key in seen:
            raise ValueError(
                f"a memserver is listed twice: {host}:{port} is {seen[key][0]}:{seen[key][1]}"
            )
        seen[key] = (host, port)
    return list(peers)


def choose(
    room: list[int], need: int, exclude: set[int] | frozenset[int], rng: random.Random
) -> int | None:
    """One peer index by power of two choices among peers with `need` free pages not in
    `exclude`, or None when none qualifies."""
    eligible = [i for i, r in enumerate(room) if r >= need and i not in exclude]
    if not eligible:
        return None
    if len(eligible) == 1:
        return eligible[0]
    a, b = rng.sample(eligible, 2)
    if room[a] != room[b]:
        return a if room[a] > room[b] else b
    return min(a, b)


def place(
    slab_sizes: list[int], room: list[int], replicas: int, rng: random.Random
) -> list[tuple[int, ...]]:
    """A replica set (distinct peer indices) for each slab of `slab_sizes` pages, taking the
    pages from `room` as it goes. Raises StorageError(ENOSPC) when the pool cannot hold it."""
    room = list(room)
    total_free = sum(room)
    placement: list[tuple[int, ...]] = []
    for n in slab_sizes:
        chosen: list[int] = []
        for _ in range(replicas):
            i = choose(room, n, set(chosen), rng)
            if i is None:
                need = sum(slab_sizes) * replicas
                raise StorageError(
                    errno.ENOSPC,
                    f"the pool cannot hold the export: {need * PAGE_SIZE >> 20} MiB "
                    f"({replicas} replica(s), at most one per memserver) needed, "
                    f"{total_free * PAGE_SIZE >> 20} MiB unreserved on {len(room)} "
                    f"memserver(s)",
                )
            chosen.append(i)
            room[i] -= n
        placement.append(tuple(chosen))
    return placement
