"""The duvm pool as this machine's duvm processes report it (kind ``runtime``).

gputaskman never imports duvm. It speaks the local status socket both duvm processes offer
(duvm's ``control_socket`` module): a Unix socket, one JSON request per line,
``{"cmd": "status"}``, one JSON object per line back (``{"error": ...}`` on refusal).

* The **daemon** (`duvm daemon`, started by `duvm enable`) listens on ``<NBD socket>.ctl``;
  `duvm enable` puts the NBD socket in ``/run/duvm``, so the default place to look is
  ``/run/duvm/*.ctl``. Its answer carries ``store`` (replication health: per peer
  ``pages`` (this node's written pages there, one count per replica), ``reserved_pages``,
  ``slabs``, ``connected``; ``degraded_slabs``, ``pages_lost_now``, ``replicas``) and ``nbd``
  counters. ``store`` is null for a daemon without a pool (``--memory``). An answer that
  names the block device serving the export as swap (``"swap_device": "/dev/nbd0"``) lets
  gputaskman label swapped-out bytes as held by the pool (`procfacts.swap_holder`); duvm's
  daemon sends it once `duvm enable` (or a resume, or a standby's takeover) told it, and
  without it they are labelled swap.
* A **memserver** started with ``--control-socket PATH`` (suggested:
  ``/run/duvm/memserver.ctl``) answers ``{"role": "memserver", ...}`` with its STATUS
  document: capacity, reservations and every client namespace with its stored pages, that is
  how much RAM this node lends and to whom. A memserver without that flag is not seen: its
  TCP STATUS needs the cluster secret, which gputaskman does not hold (a documented limit).

Both sockets are owner-only (mode 0600, peer credentials checked), so an unprivileged
gputaskman sees "permission denied" with the socket named, not a number.

``GTM_DUVM_SOCKETS`` (paths separated by ``:``) replaces the default glob, for daemons whose
sockets live elsewhere. Every number here is a `Reading` of kind ``runtime`` whose source
names the socket; a field the answer lacks is None with a reason, never 0.

Theory of operation: `sample()` globs for sockets (one directory listing), then asks each one
with a short timeout (`TIMEOUT_S`), so a hung daemon costs one refresh at most that long.
`parse_status` is sans-io (fuzzed in the tests): any JSON value in, a `DaemonPool`, a
`Lending` or a `ValueError` out.
"""

from __future__ import annotations

import glob
import json
import math
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gputaskman.base.fmt import NA, fmt_bytes, reading_json
from gputaskman.base.readings import Kind, Reading, Reason

DEFAULT_GLOB = "/run/duvm/*.ctl"
ENV = "GTM_DUVM_SOCKETS"
TIMEOUT_S = 1.0  # the TUI samples on a worker thread: a hung daemon delays data, not keys
MAX_REPLY = 4 << 20  # a memserver lists at most 1,000 namespaces: far below this
PAGE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class PeerPages:
    """One memserver as this node's daemon sees it."""

    peer: str
    connected: bool | None
    pages: Reading  # this node's written pages held there (one count per replica)
    reserved_pages: Reading
    slabs: Reading


@dataclass(frozen=True, slots=True)
class DaemonPool:
    """This node's duvm daemon: where its pages are and the pool's health."""

    socket: str
    pid: int | None
    size_bytes: Reading
    replicas: Reading
    pages_written: Reading
    degraded_slabs: Reading
    pages_lost: Reading
    health: str  # ok / degraded / failing / unknown
    reasons: tuple[str, ...]
    peers: tuple[PeerPages, ...]
    # the block device it serves as swap, when its status names it ("swap_device"): what
    # labels swapped-out bytes as held by the pool (`procfacts.swap_holder`); None: not named
    swap_device: str | None = None


@dataclass(frozen=True, slots=True)
class Borrower:
    """One client namespace on this node's memserver."""

    client_id: str
    stored_bytes: Reading
    reserved_bytes: Reading
    connections: int | None


@dataclass(frozen=True, slots=True)
class Lending:
    """This node's memserver: how much RAM it lends and to whom."""

    socket: str
    capacity_bytes: Reading
    used_bytes: Reading
    reserved_bytes: Reading
    borrowers: tuple[Borrower, ...]
    borrowers_total: int | None


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """Everything found. `errors` maps a socket to why it gave no status."""

    daemons: tuple[DaemonPool, ...] = ()
    lending: tuple[Lending, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)
    looked: str = DEFAULT_GLOB


# --------------------------------------------------------------------------- parsing


def _num(obj: Mapping[str, Any], key: str, source: str, scale: int = 1) -> Reading:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        return Reading.missing(Reason.UNAVAILABLE, source, f"{key} not reported", kind=Kind.RUNTIME)
    return Reading.runtime(v * scale, source)


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _health(store: Mapping[str, Any], peers: list[PeerPages]) -> tuple[str, tuple[str, ...]]:
    """ok / degraded (fewer replicas than wanted, a peer away) / failing (pages lost, no peer
    connected), with the reasons."""
    reasons: list[str] = []
    state = "ok"
    down = [p.peer for p in peers if p.connected is False]
    if peers and len(down) == len(peers):
        state = "failing"
        reasons.append("no memserver connected")
    elif down:
        state = "degraded"
        reasons.append("not connected: " + ", ".join(down))
    lost = _int_or_none(store.get("pages_lost_now"))
    if lost:
        state = "failing"
        reasons.append(f"{lost} page(s) lost")
    degraded = _int_or_none(store.get("degraded_slabs"))
    if degraded:
        state = "failing" if state == "failing" else "degraded"
        reasons.append(f"{degraded} slab(s) below {store.get('replicas', '?')} replicas")
    return state, tuple(reasons)


def _parse_daemon(st: Mapping[str, Any], path: str) -> DaemonPool:
    src = f"duvm daemon:{path}"
    device = st.get("swap_device")
    device = device if isinstance(device, str) and device.startswith("/") else None
    store = st.get("store")
    if store is not None and not isinstance(store, Mapping):
        raise ValueError("'store' is not an object")
    peers: list[PeerPages] = []
    if store is None:
        no_pool = Reading.missing(
            Reason.NOT_SUPPORTED, src, "daemon serves local RAM, no pool", kind=Kind.RUNTIME
        )
        return DaemonPool(
            path,
            _int_or_none(st.get("pid")),
            _num(st, "size_bytes", src),
            _num(st, "replicas", src),
            no_pool,
            no_pool,
            no_pool,
            "ok",
            ("no pool: the daemon serves local RAM",),
            (),
            device,
        )
    raw_peers = store.get("peers", [])
    if not isinstance(raw_peers, list):
        raise ValueError("'store.peers' is not a list")
    for p in raw_peers:
        if not isinstance(p, Mapping) or not isinstance(p.get("peer"), str):
            raise ValueError("a peer entry without a 'peer' name")
        conn = p.get("connected")
        peers.append(
            PeerPages(
                p["peer"],
                conn if isinstance(conn, bool) else None,
                _num(p, "pages", src),
                _num(p, "reserved_pages", src),
                _num(p, "slabs", src),
            )
        )
    health, reasons = _health(store, peers)
    return DaemonPool(
        path,
        _int_or_none(st.get("pid")),
        _num(st, "size_bytes", src),
        _num(store, "replicas", src),
        _num(store, "pages_written", src),
        _num(store, "degraded_slabs", src),
        _num(store, "pages_lost_now", src),
        health,
        reasons,
        tuple(peers),
        device,
    )


def _parse_memserver(st: Mapping[str, Any], path: str) -> Lending:
    src = f"duvm memserver:{path}"
    ns = st.get("namespaces", [])
    if not isinstance(ns, list):
        raise ValueError("'namespaces' is not a list")
    borrowers = []
    for n in ns:
        if not isinstance(n, Mapping) or not isinstance(n.get("client_id"), str):
            raise ValueError("a namespace without a 'client_id'")
        borrowers.append(
            Borrower(
                n["client_id"],
                _num(n, "stored_pages", src, PAGE_SIZE),
                _num(n, "reserved_pages", src, PAGE_SIZE),
                _int_or_none(n.get("connections")),
            )
        )
    return Lending(
        path,
        _num(st, "capacity_pages", src, PAGE_SIZE),
        _num(st, "used_pages", src, PAGE_SIZE),
        _num(st, "reserved_pages", src, PAGE_SIZE),
        tuple(borrowers),
        _int_or_none(st.get("namespaces_total")),
    )


def parse_status(obj: Any, path: str) -> DaemonPool | Lending:
    """One status answer -> what it describes. ValueError (with the reason) for anything
    that is neither a daemon's nor a memserver's status."""
    if not isinstance(obj, Mapping):
        raise ValueError("the answer is not a JSON object")
    if "error" in obj and len(obj) == 1:
        raise ValueError(f"refused: {obj['error']}")
    if obj.get("role") == "memserver" or "capacity_pages" in obj:
        return _parse_memserver(obj, path)
    if "store" in obj or "nbd" in obj:
        return _parse_daemon(obj, path)
    raise ValueError("neither a daemon's nor a memserver's status")


# --------------------------------------------------------------------------- I/O


def discover(env: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """Socket paths to ask, and a description of where they were looked for."""
    env = os.environ if env is None else env
    given = env.get(ENV)
    if given is not None:
        return [p for p in given.split(":") if p], f"${ENV}"
    return sorted(glob.glob(DEFAULT_GLOB)), DEFAULT_GLOB


def query(path: str, timeout: float = TIMEOUT_S) -> Any:
    """Send ``{"cmd": "status"}`` and return the decoded answer (OSError/ValueError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(b'{"cmd": "status"}\n')
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REPLY:
                raise ValueError(f"answer longer than {MAX_REPLY} bytes")
    if not buf:
        raise ValueError("closed without an answer")
    return json.loads(bytes(buf).split(b"\n", 1)[0])


def _why(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return "permission denied (the socket is owner-only: run as root or as its owner)"
    if isinstance(exc, FileNotFoundError):
        return "socket gone"
    if isinstance(exc, ConnectionRefusedError):
        return "nothing listening (stale socket)"
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {TIMEOUT_S:g} s"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def sample(paths: Iterable[str] | None = None, looked: str | None = None) -> PoolInfo:
    """Ask every socket (found by `discover` unless given) for its status."""
    if paths is None:
        found, looked = discover()
    else:
        found = list(paths)
    daemons: list[DaemonPool] = []
    lending: list[Lending] = []
    errors: dict[str, str] = {}
    for path in found:
        try:
            got = parse_status(query(path), path)
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            errors[path] = _why(exc)
            continue
        (daemons if isinstance(got, DaemonPool) else lending).append(got)  # type: ignore[arg-type]
    return PoolInfo(tuple(daemons), tuple(lending), errors, looked or "given paths")


# --------------------------------------------------------------------------- output


def pool_json(info: PoolInfo) -> dict[str, Any]:
    """The ``system.duvm`` object (see report.py): reading objects of kind ``runtime``."""
    return {
        "kind": Kind.RUNTIME.value,
        "looked": info.looked,
        "daemons": [
            {
                "socket": d.socket,
                "pid": d.pid,
                "health": d.health,
                "reasons": list(d.reasons),
                "size_bytes": reading_json(d.size_bytes),
                "replicas": reading_json(d.replicas),
                "pages_written": reading_json(d.pages_written),
                "degraded_slabs": reading_json(d.degraded_slabs),
                "pages_lost": reading_json(d.pages_lost),
                "swap_device": d.swap_device,
                "peers": [
                    {
                        "peer": p.peer,
                        "connected": p.connected,
                        "pages": reading_json(p.pages),
                        "reserved_pages": reading_json(p.reserved_pages),
                        "slabs": reading_json(p.slabs),
                    }
                    for p in d.peers
                ],
            }
            for d in info.daemons
        ],
        "lending": [
            {
                "socket": m.socket,
                "capacity_bytes": reading_json(m.capacity_bytes),
                "used_bytes": reading_json(m.used_bytes),
                "reserved_bytes": reading_json(m.reserved_bytes),
                "borrowers_listed_of": reading_json(_count(m.borrowers_total, m.socket)),
                "borrowers": [
                    {
                        "client_id": b.client_id,
                        "stored_bytes": reading_json(b.stored_bytes),
                        "reserved_bytes": reading_json(b.reserved_bytes),
                        "connections": reading_json(_count(b.connections, m.socket)),
                    }
                    for b in m.borrowers
                ],
            }
            for m in info.lending
        ],
        "errors": dict(info.errors),
    }


def _count(v: int | None, path: str) -> Reading:
    src = f"duvm memserver:{path}"
    if v is None:
        return Reading.missing(Reason.UNAVAILABLE, src, "not reported", kind=Kind.RUNTIME)
    return Reading.runtime(v, src)


def _pages(r: Reading) -> str:
    return NA if r.value is None else f"{int(r.value)} pages ({fmt_bytes(r.value * PAGE_SIZE)})"


def pool_lines(info: PoolInfo | None) -> list[str]:
    """Text for --once and the system panel; [] when there is nothing duvm on this node."""
    if info is None or not (info.daemons or info.lending or info.errors):
        return []
    lines: list[str] = []
    for d in info.daemons:
        why = f" ({'; '.join(d.reasons)})" if d.reasons else ""
        lines.append(f"duvm  pool {d.health}{why}  [runtime: {d.socket}]")
        lines.append(
            f"      device {fmt_bytes(d.size_bytes.value)}  written "
            f"{_pages(d.pages_written)}  replicas "
            f"{NA if d.replicas.value is None else int(d.replicas.value)}"
        )
        for p in d.peers:
            state = {True: "up", False: "DOWN", None: "n/a"}[p.connected]
            lines.append(
                f"      peer {p.peer}  {state}  our pages {_pages(p.pages)}  "
                f"reserved {_pages(p.reserved_pages)}"
            )
    for m in info.lending:
        lines.append(
            f"duvm  lending {fmt_bytes(m.used_bytes.value)} used, "
            f"{fmt_bytes(m.reserved_bytes.value)} reserved of "
            f"{fmt_bytes(m.capacity_bytes.value)}  [runtime: {m.socket}]"
        )
        for b in m.borrowers:
            lines.append(
                f"      to {b.client_id}  {fmt_bytes(b.stored_bytes.value)} stored, "
                f"{fmt_bytes(b.reserved_bytes.value)} reserved"
            )
        if m.borrowers_total is not None and m.borrowers_total > len(m.borrowers):
            lines.append(f"      ... {m.borrowers_total - len(m.borrowers)} more clients")
    for path, why in info.errors.items():
        lines.append(f"duvm  {path}: n/a ({why})")
    return lines
