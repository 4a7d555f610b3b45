"""The system tools attaching needs (losetup, mkswap, swapon, ...), found and run by absolute
path: in the standard sbin/bin directories, never via $PATH (this runs as root, and `duvm doctor`
must find exactly what `duvm enable` will run). A missing tool is reported with the Debian
package that provides it.

`Tools` is where they are looked for: `SYSTEM_TOOLS` (the standard directories) unless a
caller passes others (tests: a directory with only some tools in it)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from duvm.node.attach.attach_state import AttachError

TOOL_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# tool -> Debian package (bookworm; trixie splits nbdfuse into its own package)
TOOL_PACKAGES = {
    "nbdfuse": "libnbd-bin (Debian 12) or nbdfuse (Debian 13+)",
    "fusermount3": "fuse3",
    "losetup": "mount",
    "mkswap": "util-linux",
    "swapon": "util-linux",
    "swapoff": "util-linux",
    "blkdiscard": "util-linux",
    "modprobe": "kmod",
}


def find_tool(name: str, dirs: tuple[str, ...] | None = None) -> str | None:
    """The executable `name` in the system directories (never $PATH: this runs as root)."""
    for d in TOOL_DIRS if dirs is None else dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


@dataclass(frozen=True)
class Tools:
    """The system tools in `dirs`: found, required (with the package to install) and run."""

    dirs: tuple[str, ...] = TOOL_DIRS

    def find(self, name: str) -> str | None:
        return find_tool(name, self.dirs)

    def require(self, name: str) -> str:
        path = self.find(name)
        if path is None:
            raise AttachError(f"{name} not found; install the Debian package {TOOL_PACKAGES[name]}")
        return path

    def run(self, tool: str, *args: str, timeout: float = 120) -> str:
        """Run `tool` to completion and return its stdout; AttachError with its message if
        it fails or outlives `timeout` seconds."""
        cmd = [self.require(tool), *args]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise AttachError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s") from exc
        if res.returncode != 0:
            msg = (res.stderr or res.stdout).strip()
            raise AttachError(f"{' '.join(cmd)} failed (exit {res.returncode}): {msg}")
        return res.stdout


SYSTEM_TOOLS = Tools()


def require_root() -> None:
    if os.geteuid() != 0:
        raise AttachError("attaching swap needs root (loop/nbd devices, swapon): run with sudo")
