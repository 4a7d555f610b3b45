"""The RDMA staging buffer shared through the daemon's state directory (`rdma_link.new_staging`
with a path, `StateDir.staging_file`, `daemon_state._remote_store`): the daemon, its standby and
a restarted daemon map one file per memserver on the ramfs `duvm enable` mounts, so a standby
adds no second staging buffer (16 MiB per memserver) to what the node must have free for it.

The real compiled `Staging` maps the real file (no RDMA device is needed to map and lock
memory); the RDMA transfers through it run in the QEMU guests (test_rdma_qemu.py, the
``:dkill:rdma`` stress set-ups). The ramfs is a real one, mounted here (root)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from duvm.base import pressure, ramfs
from duvm.rdma import verbs
from duvm.store import daemon_state
from duvm.store.rdma_link import new_staging
from duvm.store.state_files import PageTables, StateDir

PAGES = 2048  # 8 MiB: well above the noise of the interpreter's own allocations
v = verbs.load()
needs_verbs = pytest.mark.skipif(
    v is None, reason=f"the RDMA transport is not built ({verbs.state()})"
)


def _anon_kib() -> int:
    kib = pressure.rss_kib(field="RssAnon")
    assert kib is not None
    return kib


@needs_verbs
def test_a_staging_file_is_mapped_shared_not_copied(tmp_path: Path) -> None:
    """Catches a staging buffer that ignores its file (a private or anonymous mapping): each
    process mapping it would then hold its own copy, and a standby would cost the node the
    staging twice over. The file is created 0600 at the buffer's size, a second mapping
    neither resizes it nor adds anonymous memory; without a path the buffer is anonymous."""
    path = tmp_path / "rdma-staging-x.bin"
    before = _anon_kib()
    first = new_staging(v, PAGES, str(path))
    second = new_staging(v, PAGES, str(path))  # the standby's
    grew = _anon_kib() - before
    assert first.shared and second.shared and first.nbytes == PAGES * 4096
    st = path.stat()
    assert st.st_size == PAGES * 4096 and stat.S_IMODE(st.st_mode) == 0o600
    assert grew < (PAGES * 4) // 4, f"{grew} KiB of anonymous memory for two shared mappings"
    # the kernel's own word: both mappings of the file are shared ("rw-s"), not private
    maps = [ln.split() for ln in Path("/proc/self/maps").read_text().splitlines()]
    assert [m[1] for m in maps if m[-1] == str(path)] == ["rw-s", "rw-s"]
    before = _anon_kib()
    own = new_staging(v, PAGES)
    assert not own.shared and _anon_kib() - before >= (PAGES * 4) * 3 // 4
    del first, second, own


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    d = tmp_path / "state"
    assert ramfs.ensure(d)
    try:
        yield d
    finally:
        ramfs.release(d)


def test_only_a_state_dir_on_ramfs_gets_shared_staging_and_a_clean_stop_removes_it(
    tmp_path: Path, ram_dir: Path
) -> None:
    """Catches staging files put where they could be swapped out or written back (a state
    directory on tmpfs or a disk: the NIC's pages must stay put), one file for two memservers
    (two queue pairs would share slots), and staging files left behind by a clean stop."""
    peers = [("10.0.0.1", 7100), ("10.0.0.2", 7100)]
    for where, shared in ((tmp_path / "disk", False), (ram_dir, True)):
        sd = StateDir(where)
        sd.ensure()
        tables = PageTables.create(sd.pages_file, 64, False)
        try:
            store = daemon_state._remote_store(
                sd, peers, 64 * 4096, "t", 2, 16, tables, b"k" * 32, 7
            )
            files = [c.staging_file for c in store.clients]
            assert [c.token for c in store.clients] == [b"k" * 32] * 2
            assert [c.epoch for c in store.clients] == [7, 7]
        finally:
            tables.close()
        if not shared:
            assert files == [None, None]
            continue
        assert len(set(files)) == 2 and all(f and Path(f).parent == where for f in files)
        assert files[0] == str(sd.staging_file("10.0.0.1", 7100))
        for f in files:
            Path(str(f)).write_bytes(b"\0" * 4096)
        sd.remove()
        assert sorted(p.name for p in where.iterdir()) == []
