"""A directory whose files can never be swapped out: a ramfs mounted for the daemon's state.

Why: /run is a tmpfs, and tmpfs pages are swapped like any other memory, possibly to the duvm
device itself. While the daemon lives it keeps its page tables locked (mlockall), but once it
dies nothing does, and the restarted daemon must read them back before anything can be swapped
in: a state file swapped out to the device whose server is dead can never come back (the read
waits for the kernel's dead-connection timeout, then fails with EIO, and every page on the
device is lost). ramfs pages are never swapped, so `duvm enable` mounts one on the daemon's
state directory and `duvm disable` unmounts it. Its size is the state itself: a few bytes per
device page (33 with encryption), memory the daemon already keeps locked.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from duvm.base.libc import libc

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MNT_DETACH = 0x2


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(esc, ch)
    return field


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    out = []
    with open(mountinfo) as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields = left.split()
            if sep and len(fields) >= 5 and right.split():
                out.append((_unescape(fields[4]), right.split()[0]))
    return out


def filesystem_of(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem `path` is on (the innermost, latest mount that holds it)."""
    target = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for point, fstype in mounts(mountinfo):
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return best[1] if best else None


def mounted_at(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem mounted exactly on `path` (the latest), None if none is."""
    target = os.path.realpath(path)
    found = None
    for point, fstype in mounts(mountinfo):
        if point == target:
            found = fstype
    return found


def is_mount_point(path: Path, mountinfo: str = "/proc/self/mountinfo") -> bool:
    return mounted_at(path, mountinfo) is not None


def ensure(path: Path) -> bool:
    """Make `path` a directory on ramfs, mode 0700. Returns True when it mounted one (the
    caller unmounts it with `release`), False when `path` already was on ramfs. OSError with
    the reason when it cannot (not root, no ramfs)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if filesystem_of(path) == "ramfs":
        return False
    c = libc()
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if c.mount(b"duvm-state", os.fsencode(path), b"ramfs", flags, b"mode=0700") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount a ramfs on {path}: {os.strerror(err)}")
    return True


def release(path: Path) -> None:
    """Unmount the ramfs `ensure` mounted on `path` (its files go with it). Nothing when
    `path` is no ramfs mount point."""
    if mounted_at(path) != "ramfs":
        return
    c = libc()
    # Still open somewhere (a shell's cwd)? Then detach it now; it is freed when the last
    # user goes.
    target = os.fsencode(path)
    if c.umount2(target, 0) != 0 and c.umount2(target, MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot unmount {path}: {os.strerror(err)}")
