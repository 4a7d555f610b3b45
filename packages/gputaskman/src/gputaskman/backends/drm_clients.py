"""DRM clients from /proc: who holds which client, what each process may be credited with.

Theory of operation
-------------------
`scan_clients` walks ``/proc/PID/fd``; a descriptor whose link points into ``/dev/dri/`` is a
DRM file, and its ``/proc/PID/fdinfo/N`` is parsed by `drm_fdinfo.parse_fdinfo`. Only those
links are followed, so the cost is one ``readlink`` per descriptor plus one small read per
DRM descriptor (never ``psutil.open_files()``). A process's name and start time are not read
here: the collector takes them from the host sample it already has. When fdinfo prints no
``drm-pdev``, the node's sysfs ``device`` link is read once per node per scan, not once per
descriptor.

A *client* is one ``struct drm_file``. The kernel prints the same ``drm-client-id`` (unique
per ``drm-pdev``) in every descriptor that refers to it: ``dup()``, ``fork()`` and
``SCM_RIGHTS`` all hand out the same client. So descriptors are grouped by
``(pdev, client-id)`` and every client is counted once, however many descriptors and
processes hold it. A descriptor without a client id or device cannot be deduplicated; it is
kept apart (`ScanResult.unkeyed`) and never credited to anyone.

`attribute` decides, per process and device, what the process may be credited with:

* **memory** only when every client the process holds on that device is provably private:
  the process is the one holder of the client id, the client was opened on a render node
  (``renderD*``; a primary ``card*`` node is where compositors and display servers import
  other clients' buffers), and the driver printed ``drm-shared-<region>`` for every region and
  all are 0. The credit is the sum of the clients' resident bytes. Resident minus shared is
  never computed: the two count by different placements and can go negative or double count.
  Otherwise the bytes are unknown (None) and ``memory_why`` says which rule failed.
* **engine busy** per engine, from clients the process alone holds (a client shared by
  several processes is credited to none of them). Rates come from `EngineRates`, which needs
  two samples: the first sample of a client has no rate (None), never 0.

Everything reads from a ``root`` directory (default ``/``) so tests lay out fake trees.
Not validated on real hardware: formats follow the kernel sources cited in drm_fdinfo.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from gputaskman.backends.drm_fdinfo import MAX_FDINFO_CHARS, FdInfo, normalize_pci, parse_fdinfo
from gputaskman.base import procfs

ClientKey = tuple[str, int]  # (normalized pdev, drm-client-id)

_RENDER_NODE = re.compile(r"renderD[0-9]+")
_LOCAL_REGION = re.compile(r"(vram|local|stolen-local)[0-9]*")
_SYSTEM_REGION = re.compile(r"(system|stolen-system)[0-9]*|gtt|cpu")
#: Rates above 100% happen when a lagging counter catches up (the spec allows it); shown capped.
MAX_PERCENT: Final = 100.0


def is_local_region(region: str) -> bool:
    """Device-local memory (VRAM): amdgpu ``vram``, xe ``vramN``, i915 ``localN``."""
    return _LOCAL_REGION.fullmatch(region) is not None


def is_system_region(region: str) -> bool:
    """System memory used by the GPU: ``gtt``, ``cpu``, xe ``system``, i915 ``systemN``."""
    return _SYSTEM_REGION.fullmatch(region) is not None


@dataclass(frozen=True, slots=True)
class FdRecord:
    """One DRM descriptor of one process."""

    pid: int
    fd: int
    node: str  # device node name, e.g. "renderD128" or "card0"
    info: FdInfo


@dataclass(frozen=True, slots=True)
class Client:
    """One DRM client (``struct drm_file``) and everyone holding it."""

    pdev: str
    client_id: int
    driver: str
    info: FdInfo  # as read through the first descriptor; dup'd ones describe the same file
    pids: tuple[int, ...]
    nodes: tuple[str, ...]
    fds: tuple[tuple[int, int], ...]  # (pid, fd)

    @property
    def key(self) -> ClientKey:
        return (self.pdev, self.client_id)

    @property
    def shared_by_processes(self) -> bool:
        return len(self.pids) > 1

    def private_memory_problem(self) -> str | None:
        """Why this client's bytes cannot be credited to its holder; None if they can."""
        if self.shared_by_processes:
            pids = ", ".join(map(str, self.pids))
            return f"DRM client {self.client_id} is held by processes {pids}"
        if not all(_RENDER_NODE.fullmatch(n) for n in self.nodes):
            return f"DRM client {self.client_id} is on a primary node ({', '.join(self.nodes)})"
        regions = self.info.regions
        if not regions:
            return f"DRM client {self.client_id}: the driver prints no memory stats"
        unproven = sorted(r for r, m in regions.items() if m.shared is None)
        if unproven:
            return f"DRM client {self.client_id}: no drm-shared-* for {', '.join(unproven)}"
        shared = sorted(r for r, m in regions.items() if m.shared)
        if shared:
            return f"DRM client {self.client_id} shares buffers in {', '.join(shared)}"
        return None


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Everything one pass over /proc found."""

    clients: tuple[Client, ...] = ()
    unkeyed: tuple[FdRecord, ...] = ()  # no client id or device: cannot be deduplicated
    denied: tuple[int, ...] = ()  # processes whose descriptors we may not read
    errors: tuple[str, ...] = ()  # unreadable fdinfo lines, with pid/fd


def _node_pdev(root: str, node: str) -> str | None:
    """PCI address of a DRM node via ``/sys/class/drm/<node>/device`` (fdinfo fallback)."""
    try:
        target = os.readlink(os.path.join(root, "sys/class/drm", node, "device"))
    except OSError:
        return None
    return normalize_pci(os.path.basename(target))


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(MAX_FDINFO_CHARS)


def scan_clients(root: str = "/") -> ScanResult:
    """Find every DRM descriptor under ``root/proc`` and group them into clients."""
    proc = os.path.join(root, "proc")
    try:
        pids = sorted(procfs.list_pids(proc))
    except OSError as exc:
        return ScanResult(errors=(f"cannot list {proc}: {exc.strerror or exc}",))
    records: list[FdRecord] = []
    denied: list[int] = []
    errors: list[str] = []
    for pid in pids:
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            denied.append(pid)
            continue
        except OSError:
            continue  # the process exited
        for name in fds:
            if not name.isdigit():
                continue
            try:
                target = os.readlink(os.path.join(fd_dir, name))
            except OSError:
                continue  # closed meanwhile
            if not target.startswith("/dev/dri/"):
                continue
            try:
                text = _read_text(os.path.join(proc, str(pid), "fdinfo", name))
            except PermissionError:
                denied.append(pid)
                break
            except OSError:
                continue
            info = parse_fdinfo(text)
            if info is None:
                continue  # an old kernel or a driver without usage stats
            errors.extend(f"pid {pid} fd {name}: {e}" for e in info.errors)
            records.append(FdRecord(pid, int(name), os.path.basename(target), info))
    pdev_of: dict[str, str | None] = {}  # node -> pdev, one sysfs readlink per node per scan

    def node_pdev(node: str) -> str | None:
        if node not in pdev_of:
            pdev_of[node] = _node_pdev(root, node)
        return pdev_of[node]

    clients, unkeyed = group_clients(records, node_pdev)
    return ScanResult(
        clients=clients,
        unkeyed=unkeyed,
        denied=tuple(sorted(set(denied))),
        errors=tuple(errors),
    )


def group_clients(
    records: Iterable[FdRecord], node_pdev: Callable[[str], str | None] | None = None
) -> tuple[tuple[Client, ...], tuple[FdRecord, ...]]:
    """Group descriptors by ``(pdev, client-id)``. Returns (clients, unkeyed descriptors).

    `node_pdev` (``node -> pdev | None``) supplies the device when fdinfo has no
    ``drm-pdev``; without either, or without a client id, a descriptor is unkeyed.
    """
    groups: dict[ClientKey, list[FdRecord]] = {}
    unkeyed: list[FdRecord] = []
    for rec in records:
        pdev = rec.info.pdev
        if pdev is None and node_pdev is not None:
            pdev = node_pdev(rec.node)
        if pdev is None or rec.info.client_id is None:
            unkeyed.append(rec)
            continue
        groups.setdefault((pdev, rec.info.client_id), []).append(rec)
    clients = tuple(
        Client(
            pdev=pdev,
            client_id=cid,
            driver=recs[0].info.driver,
            info=recs[0].info,
            pids=tuple(sorted({r.pid for r in recs})),
            nodes=tuple(sorted({r.node for r in recs})),
            fds=tuple(sorted((r.pid, r.fd) for r in recs)),
        )
        for (pdev, cid), recs in sorted(groups.items())
    )
    return clients, tuple(unkeyed)


# ------------------------------------------------------------------------ engine rates


@dataclass(slots=True)
class _Counters:
    t_ns: int
    engine_ns: dict[str, int]
    cycles: dict[str, int]
    total_cycles: dict[str, int]


def _held(prev: Mapping[str, int], cur: Mapping[str, int]) -> dict[str, int]:
    """The spec: a counter that goes backwards keeps its previous, larger value."""
    return {k: max(v, prev.get(k, v)) for k, v in cur.items()}


class EngineRates:
    """Per-client engine busy percentages from counter deltas between two samples.

    ``drm-engine-<e>`` (ns): delta busy ns / delta wall ns / capacity. ``drm-cycles-<e>`` with
    ``drm-total-cycles-<e>`` (xe): delta cycles / delta total cycles / capacity, entirely in
    the GPU's clock. ``drm-cycles-<e>`` with ``drm-maxfreq-<e>``: delta cycles / (delta wall
    seconds x max Hz) / capacity. A client seen for the first time has None for every engine.
    """

    def __init__(self) -> None:
        self._prev: dict[ClientKey, _Counters] = {}

    def update(
        self, clients: Iterable[Client], now_ns: int
    ) -> dict[ClientKey, dict[str, float | None]]:
        """Feed one sample (``now_ns`` from a monotonic clock); returns rates per client."""
        rates: dict[ClientKey, dict[str, float | None]] = {}
        seen: dict[ClientKey, _Counters] = {}
        for c in clients:
            info = c.info
            prev = self._prev.get(c.key)
            cur = _Counters(
                now_ns,
                _held(prev.engine_ns if prev else {}, info.engine_ns),
                _held(prev.cycles if prev else {}, info.cycles),
                _held(prev.total_cycles if prev else {}, info.total_cycles),
            )
            seen[c.key] = cur
            rates[c.key] = {e: self._rate(info, e, prev, cur) for e in info.engines}
        self._prev = seen  # clients that closed are forgotten
        return rates

    @staticmethod
    def _rate(info: FdInfo, engine: str, prev: _Counters | None, cur: _Counters) -> float | None:
        if prev is None:
            return None
        capacity = info.capacity(engine)
        wall_ns = cur.t_ns - prev.t_ns
        # An engine that appears in a client seen before was idle until now: amdgpu omits
        # drm-engine-<e> lines whose busy time is still 0, so its previous value is 0.
        if engine in cur.engine_ns:
            if wall_ns <= 0:
                return None
            busy = cur.engine_ns[engine] - prev.engine_ns.get(engine, 0)
            return min(MAX_PERCENT, 100.0 * busy / wall_ns / capacity)
        if engine not in cur.cycles:
            return None
        busy = cur.cycles[engine] - prev.cycles.get(engine, 0)
        if engine in cur.total_cycles and engine in prev.total_cycles:
            span = cur.total_cycles[engine] - prev.total_cycles[engine]
            if span <= 0:
                return None
            return min(MAX_PERCENT, 100.0 * busy / span / capacity)
        hz = info.maxfreq_hz.get(engine)
        if not hz or wall_ns <= 0:
            return None
        return min(MAX_PERCENT, 100.0 * busy / (wall_ns / 1e9 * hz) / capacity)


# ------------------------------------------------------------------------- attribution


@dataclass(frozen=True, slots=True)
class ProcUsage:
    """What one process may be credited with on one device.

    ``private`` is true when every client the process holds on the device is provably
    private; only then are ``local_bytes`` (device-local regions) and ``system_bytes``
    (system-memory regions) summed, each None when no client prints such a region. When not
    private, ``memory_why`` says which rule failed. ``engines`` maps engine names to busy
    percent from the clients the process alone holds, None where no rate exists yet;
    ``engine_why`` says why a rate or every engine is missing.
    """

    pid: int
    pdev: str
    driver: str
    client_ids: tuple[int, ...]
    private: bool
    local_bytes: int | None
    system_bytes: int | None
    memory_why: str | None
    engines: Mapping[str, float | None]
    engine_why: str | None


def _sum_resident(clients: Iterable[Client], wanted: Callable[[str], bool]) -> int | None:
    total: int | None = None
    for c in clients:
        for region, mem in c.info.regions.items():
            if wanted(region) and mem.resident_bytes is not None:
                total = (total or 0) + mem.resident_bytes
    return total


def attribute(
    clients: Iterable[Client],
    rates: Mapping[ClientKey, Mapping[str, float | None]] | None = None,
) -> tuple[ProcUsage, ...]:
    """One `ProcUsage` per (process, device) that holds a DRM client there."""
    by_proc: dict[tuple[int, str], list[Client]] = {}
    for c in clients:
        for pid in c.pids:
            by_proc.setdefault((pid, c.pdev), []).append(c)
    out: list[ProcUsage] = []
    for (pid, pdev), held in sorted(by_proc.items()):
        problems = [p for c in held if (p := c.private_memory_problem())]
        private = not problems
        local = _sum_resident(held, is_local_region) if private else None
        system = _sum_resident(held, is_system_region) if private else None
        own = [c for c in held if not c.shared_by_processes]
        engines: dict[str, float | None] = {}
        engine_why: str | None = None
        if not own:
            engine_why = "every DRM client of this process is shared with another process"
        elif rates is None:
            engine_why = "engine rates were not sampled"
        else:
            for c in own:
                for engine, pct in rates.get(c.key, {}).items():
                    if pct is None or (engine in engines and engines[engine] is None):
                        engines[engine] = None  # one unknown part makes the sum unknown
                    else:
                        engines[engine] = min(MAX_PERCENT, (engines.get(engine) or 0.0) + pct)
            if any(v is None for v in engines.values()):
                engine_why = "first sample of a DRM client: a rate needs two samples"
        out.append(
            ProcUsage(
                pid=pid,
                pdev=pdev,
                driver=held[0].driver,
                client_ids=tuple(sorted(c.client_id for c in held)),
                private=private,
                local_bytes=local,
                system_bytes=system,
                memory_why="; ".join(problems) or None,
                engines=MappingProxyType(engines),
                engine_why=engine_why,
            )
        )
    return tuple(out)
