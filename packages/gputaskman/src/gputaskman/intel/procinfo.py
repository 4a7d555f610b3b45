"""What a process is: runtime libraries, mapped model files, command line, category.

API
---
* ``scan_process(pid, create_time=None) -> ProcInfo``: one full look at one process
  (``/proc/PID/stat``, ``cmdline``, ``maps``, ``cwd``, ``exe``). Never raises for a process
  that is gone or protected: the `ProcInfo` says so in `gone` / `reasons`.
* `procscan.Scanner` is the budgeted, cached version for refreshes.
* ``classify(...)``, `Classification`, `Runtime`, `RUNTIMES`, `detect_runtimes` and the
  category names are defined in `runtimes` and re-exported here, as is `ModelEvidence`
  (a row of `ProcInfo.models`, defined in `evidence`); `MODEL_EXTENSIONS` comes
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
Kernel threads (PF_KTHREAD) are recognised from ``stat`` and not read further.
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from gputaskman.base import procfs

try:
    import pwd
except ImportError:  # Windows: no /proc to scan there either
    pwd = None  # type: ignore[assignment]
from gputaskman.base.procargs import (
    MODEL_EXTENSIONS,
    is_repo_id,
    model_args,
    redact_argv,
    resolve,
    split_cmdline,
)
from gputaskman.base.readings import Reason
from gputaskman.intel.evidence import ModelEvidence
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
    ServerHint,
    classify,
    detect_runtimes,
    detect_server,
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
    "classify",
    "detect_runtimes",
    "mapped_models",
    "mapped_paths",
    "parse_maps_line",
    "scan_process",
]

# --------------------------------------------------------------------------- data


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
    server: ServerHint | None = None  # the serving runtime it runs (vLLM, SGLang, TGI)

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


# A Hugging Face hub cache blob (``models--ORG--NAME/blobs/<etag>``): the resolved path of a
# cached file that safetensors' safe_open maps; it has no extension (see `hfcache`).
_HF_BLOB = re.compile(r"/models--[^/]+/blobs/[^/]+\Z")


def mapped_models(paths: Iterable[str]) -> list[tuple[str, bool]]:
    """(path, deleted) for mapped files with a model extension, and Hugging Face hub cache
    model blobs (no extension), deduplicated, sorted."""
    out: dict[str, bool] = {}
    for p in paths:
        deleted = p.endswith(_DELETED)
        clean = p[: -len(_DELETED)] if deleted else p
        if clean.lower().endswith(MODEL_EXTENSIONS) or _HF_BLOB.search(clean):
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
        if ma.evidence == "cmdline" and is_repo_id(ma.raw) and exists is not True:
            # a Hugging Face repo id: the runtime looks it up in its hub cache (a folder of
            # that name where the process runs would win, as in transformers and vLLM)
            models.append(ModelEvidence("cmdline", None, raw=ma.raw, flag=ma.flag, name=ma.raw))
            continue
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
        # the runtimes' compiled modules are looked for only where PyTorch is mapped (every
        # one of them needs it), so other processes pay nothing for the walk over paths
        server=detect_server(
            name, argv, paths if any(r.key == "pytorch" for r in runtimes) else ()
        ),
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
