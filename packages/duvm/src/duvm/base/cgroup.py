"""Run a process in a memory-limited cgroup, so it swaps while the rest of the machine does not.

Theory of operation
-------------------
A RAM limit on one cgroup makes the kernel reclaim (and so swap out) that cgroup's anonymous
pages once it holds more than the limit, while the machine as a whole has plenty of free memory.
That is how the demo and the tests push pages through duvm without starving anything else.

Two kernel interfaces exist:

* **cgroup v2** (unified hierarchy, with the ``memory`` controller available at the root):
  ``memory.max`` is the RAM limit; ``memory.swap.max`` stays ``max`` so the excess swaps.
* **cgroup v1** (``/sys/fs/cgroup/memory``): ``memory.limit_in_bytes`` is the RAM limit;
  ``memory.memsw.limit_in_bytes`` (RAM + swap) is left unlimited, for the same reason.

A hybrid machine (v1 controllers plus an empty unified tree, like this project's CI VM) uses v1.
The v1 group is created below the caller's own memory cgroup, so limits the caller already lives
under still apply; the v2 group below the root (v2 forbids children of a cgroup with processes).

The process joins the group before it runs a single instruction of the target program (the
forked child writes itself into ``cgroup.procs`` before exec). :meth:`MemoryCgroup.remove`
kills whatever is still inside (only descendants of what we started can be), waits until the
group is empty and removes the directory; the context manager always does so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNSWAPPABLE = "duvm-unswappable"  # the cgroup v2 group whose memory is never swapped out


class CgroupError(Exception):
    """No usable memory cgroup, or the kernel refused a cgroup operation."""


def detect_version(root: Path = CGROUP_ROOT) -> int | None:
    """2 or 1 for the interface whose memory controller is usable, None when neither is."""
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return 1
    return None


def _own_v1_memory_path(proc_cgroup: str) -> str:
    """The memory line of /proc/self/cgroup -> that cgroup's path ('/' when unknown)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            return parts[2] or "/"
    return "/"


class MemoryCgroup:
    """A uniquely named cgroup with a RAM limit; use as a context manager."""

    def __init__(self, limit_bytes: int, *, root: Path = CGROUP_ROOT, prefix: str = "duvm") -> None:
        if limit_bytes < 4096:
            raise ValueError(f"memory limit {limit_bytes} is below one page")
        self.limit_bytes = limit_bytes
        self.version = detect_version(root)
        if self.version is None:
            raise CgroupError(
                f"no cgroup memory controller under {root} (neither v2 with "
                "'memory' in cgroup.controllers nor v1 at memory/)"
            )
        self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if self.version == 2:
            self.parent = root
        else:
            own = _own_v1_memory_path(Path("/proc/self/cgroup").read_text())
            self.parent = root / "memory" / own.lstrip("/")
        self.path = self.parent / self.name
        self._created = False

    # -- lifecycle ---------------------------------------------------------------------------

    def create(self) -> MemoryCgroup:
        if self.version == 2:
            control = self.parent / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                self._write(control, "+memory")
        try:
            self.path.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {self.path}: {exc}") from exc
        self._created = True
        try:
            if self.version == 2:
                self._write(self.path / "memory.max", str(self.limit_bytes))
            else:
                self._write(self.path / "memory.limit_in_bytes", str(self.limit_bytes))
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self, timeout: float = 30.0) -> None:
        """Kill what is left inside, wait for the group to empty, remove it. Idempotent."""
        if not self._created:
            return
        deadline = time.monotonic() + timeout
        while self.path.exists():
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                try:
                    self.path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY while the last task is still exiting
                    if time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove cgroup {self.path}: {exc}") from exc
            elif time.monotonic() > deadline:
                raise CgroupError(f"processes {pids} would not leave cgroup {self.path}")
            time.sleep(0.02)
        self._created = False

    def __enter__(self) -> MemoryCgroup:
        return self.create()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    # -- processes ---------------------------------------------------------------------------

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def add(self, pid: int) -> None:
        self._write(self.path / "cgroup.procs", str(pid))

    def popen(
        self, cmd: list[str], *, preexec_fn: Callable[[], None] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start `cmd` inside the group (it joins before exec, so no allocation escapes);
        `preexec_fn` runs in the child after it joined."""
        join = joiner(self.path)

        def setup() -> None:
            join()
            if preexec_fn is not None:
                preexec_fn()

        return subprocess.Popen(cmd, preexec_fn=setup, **kwargs)

    def run(
        self, cmd: list[str], timeout: float | None = None, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Like subprocess.run (capture_output too), inside the group."""
        if kwargs.pop("capture_output", False):
            kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
        proc = self.popen(cmd, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    # -- accounting --------------------------------------------------------------------------

    def memory_stat(self) -> dict[str, int]:
        """memory.stat as numbers (v1 and v2 name things differently; callers pick)."""
        out: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError):
            for line in (self.path / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if value.strip().isdigit():
                    out[key] = int(value)
        return out

    def swap_bytes(self) -> int | None:
        """Bytes of this group's memory now in swap (None: the kernel does not account swap
        per group, cgroup v1 booted without swap accounting)."""
        if self.version == 2:
            return _read_int(self.path / "memory.swap.current")
        return self.memory_stat().get("swap")

    def oom_kills(self) -> int | None:
        """Processes of this group the kernel's OOM killer ended (None: not reported)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return None

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    @staticmethod
    def _write(path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as exc:
            raise CgroupError(f"cannot write {value!r} to {path}: {exc}") from exc


def joiner(group: Path) -> Callable[[], None]:
    """What a forked child runs before exec to join `group` (a preexec function): the program
    runs its first instruction inside it."""
    procs = str(group / "cgroup.procs")

    def join() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)

    return join


# --- memory that is never swapped out ---------------------------------------------------------


def unswappable_group(root: Path = CGROUP_ROOT) -> Path:
    """The cgroup v2 group `UNSWAPPABLE` below the root, made on first use: its memory is never
    swapped out (``memory.swap.max`` 0) and has no RAM limit. It is for helpers on the swap
    path that cannot lock themselves in memory: nbdfuse (mlockall does not survive exec) would
    otherwise be swapped out to the device it serves, and then wait for itself.

    CgroupError where there is no cgroup v2 memory controller: cgroup v1 cannot keep global
    reclaim from swapping a group out (its swappiness 0 binds only the group's own limit)."""
    if detect_version(root) != 2:
        raise CgroupError("no cgroup v2 memory controller (cgroup v1 cannot forbid swapping)")
    control = root / "cgroup.subtree_control"
    if "memory" not in control.read_text().split():
        MemoryCgroup._write(control, "+memory")
    group = root / UNSWAPPABLE
    try:
        group.mkdir(exist_ok=True)
    except OSError as exc:
        raise CgroupError(f"cannot create cgroup {group}: {exc}") from exc
    MemoryCgroup._write(group / "memory.swap.max", "0")
    # and none of its pages reclaimed, file pages included: nbdfuse refaulting its own code
    # under pressure needs a free page that only its own progress would make
    MemoryCgroup._write(group / "memory.min", "max")
    return group


def remove_if_empty(group: Path) -> None:
    """rmdir the group when nothing runs in it any more (another duvm may still use it)."""
    with contextlib.suppress(OSError):
        group.rmdir()


# --- would swapoff hurt someone? -------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def swap_headroom_problems(root: Path = CGROUP_ROOT, limit: int = 20) -> list[str]:
    """Cgroups holding more in swap than they have room for under their RAM limit.

    swapoff charges every page it brings home to the page's cgroup; a group that cannot take
    its pages back makes swapoff fail with ENOMEM and the kernel OOM-kills that group's
    processes (seen here on cgroup v1). Checking first lets `disable` refuse with a reason
    instead. Conservative: swap on any device counts. At most `limit` lines are returned.
    """
    version = detect_version(root)
    problems: list[str] = []
    if version == 2:
        base = root
        swap_name, usage_name, limit_name = "memory.swap.current", "memory.current", "memory.max"
    elif version == 1:
        base = root / "memory"
        swap_name, usage_name = "", "memory.usage_in_bytes"
        limit_name = "memory.limit_in_bytes"
    else:
        return problems
    for stat in base.rglob("memory.stat" if version == 1 else "memory.swap.current"):
        group = stat.parent
        if version == 1:
            fields_ = {}
            with contextlib.suppress(OSError):
                for line in stat.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k in ("total_swap", "hierarchical_memory_limit") and v.isdigit():
                        fields_[k] = int(v)
            swapped = fields_.get("total_swap")
            cap = fields_.get("hierarchical_memory_limit")
        else:
            swapped = _read_int(group / swap_name)
            cap = _read_int(group / limit_name)  # "max" reads as None: no limit
        usage = _read_int(group / usage_name)
        if not swapped or cap is None or usage is None:
            continue
        room = max(cap - usage, 0)
        if swapped > room:
            rel = "/" + str(group.relative_to(base)).lstrip(".")
            problems.append(
                f"cgroup {rel} has {swapped >> 20} MiB in swap but only "
                f"{room >> 20} MiB of room under its {cap >> 20} MiB limit"
            )
            if len(problems) >= limit:
                break
    return problems
