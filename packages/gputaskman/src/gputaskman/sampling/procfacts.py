"""Per row, what the kernel says of a process beyond its RSS and CPU: what of it is swapped
out, locked or pinned (``/proc/PID/status``), and who owns it (``/proc/PID/cgroup``).

Theory of operation
-------------------
`RowFacts.annotate` runs once per refresh over the snapshot's rows (the processes shown, not
every process on the machine), after the host sample. For each row of this machine it opens
``/proc/PID`` once and reads three small files relative to that directory: ``stat`` (the start
time, so a PID reused since the host sample is "process gone", never another process's
numbers: an open ``/proc/PID`` stays bound to the process it was opened for), ``status`` and
``cgroup``. One row costs about 25 µs (README cost table).

* **Memory** (`readings.ProcMemory`): ``VmSwap``, ``VmLck`` and ``VmPin`` of ``status``, kind
  measured, in bytes. A line the kernel does not write (a kernel thread, a zombie, VmPin
  before Linux 3.2) is ``not supported`` with the reason; a failed read is ``process gone``
  or ``denied``. Where swapped-out bytes are (`swap_holder`): ``"pool"`` only when the node's
  only active swap device (``/proc/swaps``, from the host sample) is the device a duvm
  daemon's status names as its own (`duvmpool.DaemonPool.swap_device`); otherwise ``"swap"``,
  the reading's detail saying why. Which device holds which page is never guessed.
* **Owner** (`readings.Owner`): ``cgroup`` parsed by `cgroupname.parse_cgroup`; the user
  from ``status``'s ``Uid`` line (the effective uid, as ps's USER; its name from the password
  database, cached, or the uid).
  A pod's name and namespace come from one local, read-only source without credentials:
  kubelet's pod log directories, ``/var/log/pods/<namespace>_<name>_<uid>`` (kubelet's
  ``BuildPodLogsDirectory``; namespaces and names cannot hold ``_``), listed again only when
  the directory changes. Without it they stay unknown, for the shipped PromQL join with
  kube-state-metrics' ``kube_pod_info`` (prometheus/rules.yml).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import SimpleNamespace

from gputaskman.base import procfs
from gputaskman.base.cgroupname import parse_cgroup
from gputaskman.base.readings import Kind, Owner, ProcGpu, ProcMemory, Reading, Reason
from gputaskman.sampling import host

PODS_DIR = "/var/log/pods"
POOL, SWAP = "pool", "swap"
# the status lines read, and the ProcMemory field each fills
STATUS_FIELDS = {b"VmSwap": "swapped", b"VmLck": "locked", b"VmPin": "pinned"}
STATUS_KEYS = tuple((b"\n" + key + b":", name) for key, name in STATUS_FIELDS.items())
CGROUP_MEMO = 4096  # distinct /proc/PID/cgroup texts remembered, parsed (a cgroup's name)
SAME_PROCESS_SECS = 0.5  # as report.SAME_PROCESS_SECS: two reads of the same start ticks
ABSENT = "{field} not in /proc/{pid}/status (a kernel thread, a zombie, or a kernel without it)"


def parse_status(data: bytes) -> tuple[dict[str, int], int | None]:
    """``/proc/PID/status`` -> ({ProcMemory field: bytes} for the lines present, effective
    uid: the user ps and the USER column show). A line in another unit than ``kB`` or not a
    number is left out (unknown, never 0). Each line is found, not every line split: the
    file has some 55 lines and this runs for every row at every refresh."""
    out: dict[str, int] = {}
    text = b"\n" + data
    for key, name in STATUS_KEYS:
        at = text.find(key)
        if at < 0:
            continue
        end = text.find(b"\n", at + len(key))
        parts = text[at + len(key) : None if end < 0 else end].split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1] == b"kB":
            out[name] = int(parts[0]) * 1024
    uid: int | None = None
    at = text.find(b"\nUid:")
    if at >= 0:  # real, effective, saved, filesystem
        end = text.find(b"\n", at + 5)
        ids = text[at + 5 : None if end < 0 else end].split()
        uid = int(ids[1]) if len(ids) > 1 and ids[1].isdigit() else None
    return out, uid


def swap_holder(swap: object | None, pool: object | None) -> tuple[str, str]:
    """(``"pool"`` or ``"swap"``, why) for the swapped-out bytes of every process of this
    node: ``"pool"`` only when the one active swap device is the device a duvm daemon names.
    `swap` is a `host.SwapInfo`, `pool` a `duvmpool.PoolInfo` (either may be None)."""
    devices = getattr(swap, "devices", None)
    if devices is None:
        return SWAP, "/proc/swaps not read: which device holds the pages is unknown"
    if len(devices) != 1:
        n = len(devices)
        return SWAP, f"{n} active swap devices: the kernel does not say which holds a page"
    dev = devices[0].filename
    daemons = getattr(pool, "daemons", ()) or ()
    named = [d for d in daemons if getattr(d, "swap_device", None)]
    for d in named:
        if d.swap_device == dev:
            return POOL, f"{dev}, the only active swap device, is duvm's ({d.socket})"
    if named:
        return SWAP, f"{dev}, the only active swap device, is not the one duvm's daemon names"
    if daemons:
        return SWAP, f"duvm's daemon does not name its swap device: {dev} counted as swap"
    return SWAP, f"{dev} is the only active swap device; no duvm daemon answered"


class RowFacts:
    """Reads each row's memory and owner (see the module docstring). `proc_root` and
    `pods_dir` are where /proc and kubelet's pod log directories are (a fixture tree's in
    tests); `user_name` maps a uid to a name (None: unnamed); `swaps`, when given, is the
    ``/proc/swaps`` to read instead of the host sample's (a fixture tree's own, so that its
    processes are never labelled by this machine's swap)."""

    def __init__(
        self,
        proc_root: str = procfs.PROC,
        pods_dir: str = PODS_DIR,
        user_name: Callable[[int], str | None] | None = None,
        swaps: str | None = None,
    ) -> None:
        self._root = proc_root
        self._swaps = swaps
        self._pods_dir = pods_dir
        self._btime = procfs.boot_time(proc_root)
        self._user_name = user_name if user_name is not None else _passwd_name
        self._users: dict[int, str] = {}
        self._pods_stamp: int | None = None
        self._pods: dict[str, tuple[str, str]] = {}
        # (/proc/PID/cgroup text, uid) -> what they name: most rows' stay, parsed once
        self._owners: dict[tuple[str, int | None], Owner] = {}

    # -- kubelet's pod log directories

    def pod_names(self) -> dict[str, tuple[str, str]]:
        """pod UID -> (namespace, name), from `pods_dir`; {} where there is none."""
        try:
            stamp = os.stat(self._pods_dir).st_mtime_ns
        except OSError:
            self._pods_stamp, self._pods = None, {}
            return self._pods
        if stamp != self._pods_stamp:
            try:
                names = os.listdir(self._pods_dir)
            except OSError:
                names = []
            self._pods = parse_pod_dirs(names)
            self._pods_stamp = stamp
        return self._pods

    # -- rows

    def _user(self, uid: int) -> str:
        name = self._users.get(uid)
        if name is None:
            name = self._users[uid] = self._user_name(uid) or str(uid)
        return name

    def read(
        self, pid: int, create_time: float | None
    ) -> tuple[dict[str, int], int | None, str | procfs.ProcError, procfs.ProcError | None]:
        """(memory fields, uid, cgroup text or why it was not read, error) of one process:
        everything empty with the error when the process could not be read."""
        try:
            dirfd = os.open(f"{self._root}/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            err = procfs.translate(exc, pid, "its /proc directory")
            return {}, None, err, err
        try:
            stat = procfs.parse_stat(_read_at(dirfd, pid, "stat"))
            if stat is not None and create_time is not None and self._btime is not None:
                started = procfs.create_time(stat.start_ticks, self._btime)
                if abs(started - create_time) > SAME_PROCESS_SECS:
                    gone = procfs.NoSuchProcess(pid, f"PID {pid} now belongs to another process")
                    return {}, None, gone, gone
            fields, uid = parse_status(_read_at(dirfd, pid, "status"))
            try:
                cgroup: str | procfs.ProcError = _read_at(dirfd, pid, "cgroup").decode(
                    "utf-8", "replace"
                )
            except procfs.NoSuchProcess:
                raise
            except procfs.ProcError as err:  # denied, or a kernel without cgroups
                cgroup = err
            return fields, uid, cgroup, None
        except procfs.ProcError as err:
            return {}, None, err, err
        finally:
            os.close(dirfd)

    def annotate(self, rows: Iterable[ProcGpu], swap: object, pool: object) -> list[ProcGpu]:
        """`rows` with `memory` and `owner` set for every row of this machine (a row of
        another OS is left as it is). `swap` / `pool` are the host sample's."""
        if self._swaps is not None:
            try:
                with open(self._swaps, encoding="utf-8", errors="replace") as f:
                    swap = SimpleNamespace(devices=host.parse_swaps(f.read())[0])
            except OSError:
                swap = None
        holder, why = swap_holder(swap, pool)
        done: dict[int, tuple[ProcMemory, Owner]] = {}
        out = []
        for r in rows:
            if r.host is not None:
                out.append(r)
                continue
            got = done.get(r.pid)
            if got is None:
                got = done[r.pid] = self._facts(r, holder, why)
            out.append(replace(r, memory=got[0], owner=got[1]))
        return out

    def _facts(self, r: ProcGpu, holder: str, why: str) -> tuple[ProcMemory, Owner]:
        pid = r.pid
        src = f"/proc/{pid}/status"
        if r.create_time is None:
            detail = "no /proc entry for this PID here (another PID namespace, or exited)"
            missing = Reading.missing(Reason.UNAVAILABLE, src, detail)
            return ProcMemory(missing, missing, missing), Owner(
                None, reason=Reason.UNAVAILABLE, detail=detail
            )
        fields, uid, cgroup, err = self.read(pid, r.create_time)
        if err is not None:
            missing = Reading.missing(err.reason, src, err.detail)
            return ProcMemory(missing, missing, missing), Owner(
                None, reason=err.reason, detail=err.detail
            )
        memory: dict[str, Reading] = {}
        for key, name in STATUS_FIELDS.items():
            label = key.decode()
            v = fields.get(name)
            if v is None:
                detail = ABSENT.format(field=label, pid=pid)
                memory[name] = Reading.missing(Reason.NOT_SUPPORTED, f"{src} ({label})", detail)
            elif name == "swapped":
                memory[name] = Reading(v, Kind.MEASURED, f"{src} ({label})", None, why)
            else:
                memory[name] = Reading.measured(v, f"{src} ({label})")
        known = memory["swapped"].value is not None
        mem = ProcMemory(**memory, swapped_to=holder if known else None)
        if isinstance(cgroup, procfs.ProcError):
            user = None if uid is None else self._user(uid)
            owner = Owner(None, user=user, reason=cgroup.reason, detail=cgroup.detail)
        else:
            owner = self._owners.get((cgroup, uid))
            if owner is None:
                if len(self._owners) >= CGROUP_MEMO:
                    self._owners.clear()
                user = None if uid is None else self._user(uid)
                owner = replace(parse_cgroup(cgroup), user=user)
                self._owners[(cgroup, uid)] = owner
        if owner.pod_uid is not None:
            named = self.pod_names().get(owner.pod_uid)
            if named is not None:
                owner = replace(
                    owner, pod_namespace=named[0], pod_name=named[1], pod_source=self._pods_dir
                )
        return mem, owner


def parse_pod_dirs(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """kubelet's pod log directory names (``<namespace>_<name>_<uid>``) -> {uid: (namespace,
    name)}; a name not of that form is skipped."""
    out = {}
    for n in names:
        parts = n.split("_")
        if len(parts) == 3 and all(parts):
            out[parts[2]] = (parts[0], parts[1])
    return out


def _read_at(dirfd: int, pid: int, name: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as exc:
        raise procfs.translate(exc, pid, name) from None
    try:
        chunks = []
        while chunk := os.read(fd, 8192):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise procfs.translate(exc, pid, name) from None
    finally:
        os.close(fd)


def _passwd_name(uid: int) -> str | None:
    try:
        import pwd
    except ImportError:  # not a Unix: no password database
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
