"""duvm.base.ramfs: the daemon's state directory on a filesystem that is never swapped out. The
mounts are real (root on this machine); the mountinfo parsing also runs over fixed text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.base import ramfs

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a ramfs needs root")

MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:23 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=2G
90 25 0:51 / /run/duvm/daemon-state rw,nosuid - ramfs duvm-state rw,mode=700
91 22 0:52 / /srv/a\\040dir rw - ramfs x rw
"""


def test_the_innermost_mount_decides(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    where = str(info)
    assert ramfs.filesystem_of(Path("/run/duvm/daemon-state/x.json"), where) == "ramfs"
    assert ramfs.filesystem_of(Path("/run/duvm/daemon-statex"), where) == "tmpfs"
    assert ramfs.filesystem_of(Path("/run"), where) == "tmpfs"
    assert ramfs.filesystem_of(Path("/etc"), where) == "ext4"
    assert ramfs.filesystem_of(Path("/srv/a dir/f"), where) == "ramfs"  # \\040 is a space
    assert ramfs.is_mount_point(Path("/run/duvm/daemon-state"), where)
    assert not ramfs.is_mount_point(Path("/run/duvm"), where)
    assert ramfs.mounted_at(Path("/run/duvm/daemon-state"), where) == "ramfs"
    assert ramfs.mounted_at(Path("/run"), where) == "tmpfs"  # not the one below it
    assert ramfs.mounted_at(Path("/run/duvm"), where) is None


@root_only
def test_mount_then_release(tmp_path: Path) -> None:
    """Catches a state directory left on a swappable filesystem, and a release that leaves
    the mount (and the key inside it) behind."""
    d = tmp_path / "state"
    assert ramfs.ensure(d) is True
    try:
        assert ramfs.filesystem_of(d) == "ramfs" and ramfs.is_mount_point(d)
        assert (d.stat().st_mode & 0o777) == 0o700
        (d / "daemon-state.json").write_text("{}")
        assert ramfs.ensure(d) is False  # already ramfs: not mounted twice
        assert [p for p, _ in ramfs.mounts()].count(os.path.realpath(d)) == 1
    finally:
        ramfs.release(d)
    assert not ramfs.is_mount_point(d) and not (d / "daemon-state.json").exists()
    ramfs.release(d)  # nothing mounted: nothing done


@root_only
def test_a_busy_mount_is_detached(tmp_path: Path) -> None:
    d = tmp_path / "state"
    ramfs.ensure(d)
    busy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=d)
    try:
        ramfs.release(d)
        assert not ramfs.is_mount_point(d)
    finally:
        busy.kill()
        busy.wait()
