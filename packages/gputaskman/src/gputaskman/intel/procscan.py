"""The budgeted, cached process scan for refreshes: `Scanner` runs `procinfo.scan_process`
over many processes in the caller's order within a time budget, keeping one `ProcInfo` per
``(pid, create_time)``.

API
---
* ``Scanner(budget=0.150).scan(order) -> ScanResult``: `order` is the caller's priority
  (e.g. processes with GPU memory first), as pids or ``(pid, create_time)`` pairs.
  ``budget=None`` scans everything (one-shot output).

Theory of operation
-------------------
The `Scanner` keeps one `ProcInfo` per ``(pid, create_time)``, so a process is scanned
once and a reused PID never inherits another process's runtimes. Each refresh first scans
processes never seen, in the caller's order, until the budget is spent (at least one per
refresh, so a tiny budget still makes progress; the last scan may overrun the budget by one
process); then, if time remains, rescans entries older than `maps_max_age` (libraries
loaded after start, e.g. a Python that imports torch later). `scan_one` rescans on demand
(the inspector). Entries for processes not requested for `forget_after` refreshes are
dropped, so the cache stays bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from gputaskman.base import procfs
from gputaskman.intel.procinfo import ProcInfo, scan_process


@dataclass(frozen=True, slots=True)
class ScanResult:
    """One budgeted refresh. `infos` holds every requested process that has a `ProcInfo`
    (scanned now or cached); `pending` those the budget did not reach (they are scanned on
    a later refresh, first in line); `gone` those that exited. `elapsed_s` is the wall time
    of this call; `scanned` how many processes were read this time."""

    infos: Mapping[int, ProcInfo]
    pending: tuple[int, ...]
    gone: tuple[int, ...]
    scanned: int
    elapsed_s: float
    budget_s: float | None
    stale_rescanned: int = 0
    cache_size: int = 0


_DEFAULT = object()


class Scanner:
    """Budgeted, cached `scan_process` over many processes (see the module docstring)."""

    DEFAULT_BUDGET = 0.150

    def __init__(
        self,
        budget: float | None = DEFAULT_BUDGET,
        *,
        maps_max_age: float = 60.0,
        forget_after: int = 3,
        root: str = procfs.PROC,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget = budget
        self.maps_max_age = maps_max_age
        self.forget_after = forget_after
        self._root = root
        self._clock = clock
        self._btime = procfs.boot_time(root)
        self._cache: dict[tuple[int, float], ProcInfo] = {}
        self._by_pid: dict[int, float] = {}  # pid -> create_time of the cached entry
        self._last_used: dict[tuple[int, float], int] = {}
        self._generation = 0

    def _key_of(self, item: int | tuple[int, float | None]) -> tuple[int, float | None]:
        if isinstance(item, tuple):
            return item[0], item[1]
        return item, None

    def _current_ct(self, pid: int) -> float | None:
        """The create_time of whatever runs at `pid` now (one stat read), None if gone."""
        try:
            st = procfs.read_stat(pid, root=self._root)
        except procfs.ProcError:
            return None
        if self._btime is None:
            return None
        return procfs.create_time(st.start_ticks, self._btime)

    def _store(self, info: ProcInfo) -> None:
        if info.create_time is None or info.gone:
            return
        old = self._by_pid.get(info.pid)
        if old is not None and old != info.create_time:
            self._cache.pop((info.pid, old), None)
            self._last_used.pop((info.pid, old), None)
        key = (info.pid, info.create_time)
        self._cache[key] = info
        self._by_pid[info.pid] = info.create_time
        self._last_used[key] = self._generation

    def cached(self, pid: int, create_time: float | None = None) -> ProcInfo | None:
        """The cached info for `pid` (and `create_time` when given), without any I/O."""
        ct = self._by_pid.get(pid) if create_time is None else create_time
        return None if ct is None else self._cache.get((pid, ct))

    def invalidate(self, pid: int) -> None:
        """Forget `pid` so the next `scan` reads it again (e.g. the user asked)."""
        ct = self._by_pid.pop(pid, None)
        if ct is not None:
            self._cache.pop((pid, ct), None)
            self._last_used.pop((pid, ct), None)

    def scan_one(self, pid: int, create_time: float | None = None) -> ProcInfo:
        """Scan `pid` now, ignoring the budget and the cache (on demand, e.g. inspector)."""
        info = scan_process(pid, create_time, root=self._root, btime=self._btime)
        self._store(info)
        return info

    def scan(
        self,
        order: Iterable[int | tuple[int, float | None]],
        budget: float | object | None = _DEFAULT,
    ) -> ScanResult:
        """Scan in `order` within the budget (None: no limit); see the module docstring."""
        limit = cast("float | None", self.budget if budget is _DEFAULT else budget)
        clock = self._clock
        start = clock()
        self._generation += 1
        gen = self._generation
        infos: dict[int, ProcInfo] = {}
        todo: list[tuple[int, float | None]] = []
        stale: list[tuple[int, float]] = []
        now_mono = time.monotonic()
        asked: set[int] = set()
        for item in order:
            pid, ct = self._key_of(item)
            if pid in asked:  # a PID listed twice (e.g. on two GPUs) is scanned once
                continue
            asked.add(pid)
            if ct is None:
                ct = self._current_ct(pid)
                if ct is None:
                    todo.append((pid, None))  # let scan_process report why
                    continue
            hit = self._cache.get((pid, ct))
            if hit is None:
                todo.append((pid, ct))
                continue
            infos[pid] = hit
            self._last_used[(pid, ct)] = gen
            if now_mono - hit.scanned_at > self.maps_max_age:
                stale.append((pid, ct))
        pending: list[int] = []
        gone: list[int] = []
        scanned = 0
        for pid, ct in todo:
            # At least one scan per refresh, so even a tiny budget makes progress.
            if limit is not None and scanned and clock() - start >= limit:
                pending.append(pid)
                continue
            info = scan_process(pid, ct, root=self._root, btime=self._btime)
            scanned += 1
            if info.gone:
                gone.append(pid)
                continue
            self._store(info)
            infos[pid] = info
        rescanned = 0
        for pid, ct in stale:
            if limit is not None and clock() - start >= limit:
                break
            info = scan_process(pid, ct, root=self._root, btime=self._btime)
            rescanned += 1
            if info.gone:
                self.invalidate(pid)
                infos.pop(pid, None)
                gone.append(pid)
                continue
            self._store(info)
            infos[pid] = info
        self._forget(gen)
        return ScanResult(
            infos=MappingProxyType(infos),
            pending=tuple(pending),
            gone=tuple(gone),
            scanned=scanned,
            elapsed_s=clock() - start,
            budget_s=limit,
            stale_rescanned=rescanned,
            cache_size=len(self._cache),
        )

    def _forget(self, gen: int) -> None:
        cutoff = gen - self.forget_after
        if cutoff <= 0:
            return
        old = [k for k, g in self._last_used.items() if g < cutoff]
        for key in old:
            self._last_used.pop(key, None)
            self._cache.pop(key, None)
            if self._by_pid.get(key[0]) == key[1]:
                del self._by_pid[key[0]]
