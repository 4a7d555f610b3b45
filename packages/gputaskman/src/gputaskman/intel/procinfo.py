"""What a process is: runtime libraries, mapped model files, command line, category.

API
---
* ``scan_process(pid, create_time=None) -> ProcInfo``: one full look at one process
  (``/proc/PID/stat``, ``cmdline``, ``maps``, ``cwd``, ``exe``). Never raises for a process
  that is gone or protected: the `ProcInfo` says so in `gone` / `reasons`.
* ``Scanner(budget=0.150).scan(order) -> ScanResult``: the budgeted, cached version for
  refreshes. `order` is the caller's priority (e.g. processes with GPU memory first), as
  pids or ``(pid, create_time)`` pairs. ``budget=None`` scans everything (one-shot output).
* ``classify(...)``, `Classification`, `Runtime`, `RUNTIMES`, `detect_runtimes` and the
  category names are defined in `runtimes` and re-exported here; `MODEL_EXTENSIONS` comes
  from `procargs` (command-line redaction and model arguments).
* ``parse_maps_line`` / ``mapped_paths`` / ``mapped_models``: sans-io helpers over the
  text of ``/proc/PID/maps``.

Theory of operation
-------------------
Runtime detection reads the memory map, never the process's memory: a shared object whose
file name matches a `RUNTIMES` entry (``libcudart.so.12`` -> CUDA runtime) is *detection*,
not proof of GPU work (PyTorch maps libcudart even on a CPU-only run). Mapped files with a
model extension are ``mapped`` evidence; model-looking arguments are ``cmdline`` (value of
a model flag) or ``path-arg`` evidence, found only after secrets are redacted, resolved
against the process's working directory. ``psutil.open_files()`` is never used: it costs
seconds per process; one read of ``maps`` costs tens of microseconds (see the benchmark).

The `Scanner` keeps one `ProcInfo` per ``(pid, create_time)``, so a process is scanned
once and a reused PID never inherits another process's runtimes. Each refresh first scans
processes never seen, in the caller's order, until the budget is spent (at least one per
refresh, so a tiny budget still makes progress; the last scan may overrun the budget by one
process); then, if time remains, rescans entries older than `maps_max_age` (libraries
loaded after start, e.g. a Python that imports torch later). Kernel threads (PF_KTHREAD)
are recognised from ``stat`` and not read further.
`scan_one` rescans on demand (the inspector). Entries for processes not requested for
`forget_after` refreshes are dropped, so the cache stays bounded.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from gputaskman.base import procfs

try:
    import pwd
except ImportError:  # Windows: no /proc to scan there either
    pwd = None  # type: ignore[assignment]
from gputaskman.base.procargs import (
    MODEL_EXTENSIONS,
    model_args,
    redact_argv,
    resolve,
    split_cmdline,
)
from gputaskman.base.readings import Reason
from gputaskman.intel.runtimes import (
    BROWSER,
    CATEGORIES,
    COMPOSITOR,
    DECISION,
    GRAPHICS,
    LLM,
    RUNTIMES,
    SPEECH,
    TRAINING,
    VIDEO,
    VISION,
    Classification,
    Runtime,
    RuntimeSpec,
    classify,
    detect_runtimes,
)

__all__ = [
    "BROWSER",
    "CATEGORIES",
    "COMPOSITOR",
    "DECISION",
    "GRAPHICS",
    "LLM",
    "MODEL_EXTENSIONS",
    "RUNTIMES",
    "SPEECH",
    "TRAINING",
    "VIDEO",
    "VISION",
    "Classification",
    "FieldReason",
    "MapsEntry",
    "ModelEvidence",
    "ProcInfo",
    "Runtime",
    "RuntimeSpec",
    "ScanResult",
    "Scanner",
    "classify",
    "detect_runtimes",
    "mapped_models",
    "mapped_paths",
    "parse_maps_line",
    "scan_process",
]

# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class ModelEvidence:
    """One reason to think the process holds a model file.

    `evidence` is ``mapped`` (the file is in the memory map), ``cmdline`` (the value of a
    model flag) or ``path-arg`` (a model-looking argument; informational only).
    `path` is the absolute path as the process sees it (None when relative and the cwd is
    unknown); `raw` is the argument as written (None for mapped). `deleted` means the maps
    line ended in ``(deleted)``. `exists` / `size_bytes` come from a stat through
    ``/proc/PID/root`` (mapped and cmdline evidence only) and are None when not checked.
    """

    evidence: str
    path: str | None
    raw: str | None = None
    flag: str | None = None
    deleted: bool = False
    exists: bool | None = None
    size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class FieldReason:
    """Why a field of `ProcInfo` is missing: `field` is ``maps``, ``cmdline``, ``cwd``,
    ``exe``, ``stat`` or ``process``."""

    field: str
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """Everything procinfo knows about one process. Unknown is None (with a `FieldReason`);
    an empty tuple means "looked and found none" (only when the field has no reason)."""

    pid: int
    create_time: float | None
    name: str | None
    exe: str | None
    cwd: str | None
    cmdline: tuple[str, ...] | None  # redacted
    redacted: int  # how many argument values were hidden
    runtimes: tuple[Runtime, ...]
    models: tuple[ModelEvidence, ...]
    classification: Classification | None
    scanned_at: float  # time.monotonic() of the scan
    gone: bool = False
    reasons: tuple[FieldReason, ...] = ()
    kernel_thread: bool = False  # no user memory: maps, cwd and exe are not read
    ppid: int | None = None  # the parent's PID (stat)
    user: str | None = None  # the user it runs as (effective uid) by name, or the uid

    @property
    def key(self) -> tuple[int, float | None]:
        return (self.pid, self.create_time)

    @property
    def category(self) -> str | None:
        return self.classification.label if self.classification else None

    @property
    def runtime_keys(self) -> tuple[str, ...]:
        return tuple(r.key for r in self.runtimes)

    def reason(self, name: str) -> FieldReason | None:
        return next((r for r in self.reasons if r.field == name), None)


@dataclass(frozen=True, slots=True)
class MapsEntry:
    """One parsed ``/proc/PID/maps`` line."""

    start: int
    end: int
    perms: str
    offset: int
    dev: str
    inode: int
    path: str | None  # None for anonymous mappings
    deleted: bool


# --------------------------------------------------------------------------- maps parsing

_DELETED = " (deleted)"


def parse_maps_line(line: str) -> MapsEntry | None:
    """Parse one maps line; None when it is not in the kernel's format. Never raises.

    ``start-end perms offset dev inode   path``: the path may contain spaces (the kernel
    escapes only newlines) and may end in `` (deleted)``.
    """
    parts = line.rstrip("\n").split(None, 5)
    if len(parts) < 5:
        return None
    addr, perms, offset, dev, inode = parts[:5]
    lo, dash, hi = addr.partition("-")
    try:
        start, end = int(lo, 16), int(hi, 16)
        off = int(offset, 16)
        ino = int(inode)
    except ValueError:
        return None
    if not dash or len(perms) != 4 or ":" not in dev or start < 0 or end < 0 or ino < 0:
        return None
    path = parts[5] if len(parts) == 6 else None
    deleted = False
    if path is not None and path.endswith(_DELETED):
        path, deleted = path[: -len(_DELETED)], True
    return MapsEntry(start, end, perms, off, dev, ino, path or None, deleted)


_PATH_RE = re.compile(r"/[^\n]*")


def mapped_paths(text: str) -> set[str]:
    """Unique file paths in maps text (with any `` (deleted)`` suffix kept).

    Fast path for refreshes: the address, perms, offset, dev and inode columns never hold
    a ``/``, so a line's path runs from its first ``/`` to the end of the line, and one
    regex pass finds them all (about 3x cheaper than a Python loop over lines). Pseudo
    entries (``[heap]``) and anonymous mappings have no ``/`` and are skipped.
    """
    return set(_PATH_RE.findall(text))


def mapped_models(paths: Iterable[str]) -> list[tuple[str, bool]]:
    """(path, deleted) for mapped files with a model extension, deduplicated, sorted."""
    out: dict[str, bool] = {}
    for p in paths:
        deleted = p.endswith(_DELETED)
        clean = p[: -len(_DELETED)] if deleted else p
        if clean.lower().endswith(MODEL_EXTENSIONS):
            out[clean] = out.get(clean, False) or deleted
    return sorted(out.items())


# --------------------------------------------------------------------------- scanning


def _stat_model(pid: int, path: str | None, root: str) -> tuple[bool | None, int | None]:
    """(exists, size) of `path` inside the process's mount namespace."""
    if path is None:
        return None, None
    try:
        st = os.stat(f"{root}/{pid}/root{path}")
    except FileNotFoundError:
        return False, None
    except OSError:
        return None, None
    return True, st.st_size


def _gone(pid: int, create_time: float | None, err: procfs.ProcError) -> ProcInfo:
    return ProcInfo(
        pid,
        create_time,
        None,
        None,
        None,
        None,
        0,
        (),
        (),
        None,
        time.monotonic(),
        gone=True,
        reasons=(FieldReason("process", err.reason, err.detail),),
    )


def scan_process(
    pid: int,
    create_time: float | None = None,
    *,
    root: str = procfs.PROC,
    btime: float | None = None,
) -> ProcInfo:
    """Look at one process. `create_time`, when given, must match the process found at
    `pid`, else the process the caller meant is gone (its PID was reused)."""
    reasons: list[FieldReason] = []
    try:
        st = procfs.read_stat(pid, root=root)
    except procfs.ProcError as err:
        return (
            _gone(pid, create_time, err)
            if isinstance(err, procfs.NoSuchProcess)
            else (
                ProcInfo(
                    pid,
                    create_time,
                    None,
                    None,
                    None,
                    None,
                    0,
                    (),
                    (),
                    None,
                    time.monotonic(),
                    reasons=(FieldReason("stat", err.reason, err.detail),),
                )
            )
        )
    bt = btime if btime is not None else procfs.boot_time(root)
    ct = procfs.create_time(st.start_ticks, bt) if bt is not None else None
    if create_time is not None and ct is not None and abs(ct - create_time) > 1e-6:
        return _gone(
            pid,
            create_time,
            procfs.NoSuchProcess(pid, f"pid {pid} now belongs to a process started at {ct:.2f}"),
        )

    if st.kernel_thread:
        # Kernel threads have no memory map, command line or executable; skip three reads.
        return ProcInfo(
            pid,
            ct,
            st.name,
            None,
            None,
            (),
            0,
            (),
            (),
            None,
            time.monotonic(),
            kernel_thread=True,
            ppid=st.ppid,
            user=_user(pid, root),
        )

    argv: tuple[str, ...] | None = None
    redacted = 0
    margs = ()
    try:
        raw = split_cmdline(procfs.read_proc(pid, "cmdline", root=root))
        red = redact_argv(raw)
        argv, redacted = red.argv, len(red.redacted)
        margs = model_args(red)
    except procfs.NoSuchProcess as err:
        return _gone(pid, ct, err)
    except procfs.ProcError as err:
        reasons.append(FieldReason("cmdline", err.reason, err.detail))

    links: dict[str, str | None] = {}
    for what in ("cwd", "exe"):
        try:
            links[what] = procfs.readlink_proc(pid, what, root=root)
        except procfs.ProcError as err:
            links[what] = None
            reasons.append(FieldReason(what, err.reason, err.detail))

    paths: set[str] = set()
    try:
        paths = mapped_paths(procfs.read_proc(pid, "maps", root=root).decode("utf-8", "replace"))
        runtimes = detect_runtimes(paths)
    except procfs.NoSuchProcess as err:
        return _gone(pid, ct, err)
    except procfs.ProcError as err:
        runtimes = ()
        reasons.append(FieldReason("maps", err.reason, err.detail))

    models: list[ModelEvidence] = []
    for path, deleted in mapped_models(paths):
        exists, size = (None, None) if deleted else _stat_model(pid, path, root)
        models.append(
            ModelEvidence("mapped", path, deleted=deleted, exists=exists, size_bytes=size)
        )
    cwd = links["cwd"]
    for ma in margs:
        path = resolve(ma.raw, cwd)
        # path-arg is informational only: no stat (a stat of an arbitrary argument could
        # block on a dead network mount, and the ladder gives it no weight anyway).
        exists, size = _stat_model(pid, path, root) if ma.evidence == "cmdline" else (None, None)
        models.append(
            ModelEvidence(
                ma.evidence, path, raw=ma.raw, flag=ma.flag, exists=exists, size_bytes=size
            )
        )
    name = st.name
    return ProcInfo(
        pid=pid,
        create_time=ct,
        name=name,
        exe=links["exe"],
        cwd=cwd,
        cmdline=argv,
        redacted=redacted,
        runtimes=runtimes,
        models=tuple(models),
        classification=classify(name, argv, runtimes, models),
        scanned_at=time.monotonic(),
        reasons=tuple(reasons),
        ppid=st.ppid,
        user=_user(pid, root),
    )


def _user(pid: int, root: str) -> str | None:
    """The user the process runs as (its effective uid, what ps's USER shows) by name, or the
    uid as text when no account names it; None when unreadable. In the real /proc that is the
    owner of /proc/PID (one stat, about a tenth of reading ``status``: 1,000 processes scanned
    cold took 15 ms longer with ``status``); a fixture tree's owner is whoever wrote it, so
    there the second ``Uid:`` field of its ``status`` file is read."""
    try:
        if root == procfs.PROC:
            return user_name(os.stat(f"{root}/{pid}").st_uid)
        for line in procfs.read_proc(pid, "status", root=root).splitlines():
            if line.startswith(b"Uid:"):
                return user_name(int(line.split()[2]))
    except (OSError, procfs.ProcError, ValueError, IndexError):
        return None
    return None


@functools.lru_cache(maxsize=256)
def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name if pwd is not None else str(uid)
    except KeyError:
        return str(uid)


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
