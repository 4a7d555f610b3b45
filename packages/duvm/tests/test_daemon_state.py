"""Persisted daemon state (duvm.store.daemon_state): the files, their checks, and a daemon that is
SIGKILLed and resumed from them against a real memserver, read through a real NBD client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from duvm.store import daemon_state as ds
from duvm.store import state_files as sf
from hypothesis import given, settings
from hypothesis import strategies as st

PY = [sys.executable, "-m", "duvm.cli"]


def _saved(**kw: object) -> ds.SavedDaemon:
    base = {
        "size": 8 << 20,
        "slab_pages": 256,
        "replicas": 1,
        "client_id": "n1:/run/duvm",
        "peers": ["127.0.0.1:7070"],
        "token": bytes(range(32)),
        "sets": [[0]] * 8,
        "key": None,
    }
    base.update(kw)
    return ds.SavedDaemon(**base)  # type: ignore[arg-type]


def test_state_round_trip_with_private_permissions(tmp_path: Path) -> None:
    sd = ds.StateDir(tmp_path / "st")
    saved = _saved(key=b"k" * 32, sets=[[0, 1], [1, 0]])
    sd.save(saved)
    assert sd.load() == saved
    assert (tmp_path / "st").stat().st_mode & 0o777 == 0o700
    assert sd.state_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / "st").iterdir()] == [sf.STATE_FILE]  # no temp left


def test_readable_by_others_is_refused(tmp_path: Path) -> None:
    sd = ds.StateDir(tmp_path / "st")
    sd.save(_saved())
    sd.state_file.chmod(0o644)
    with pytest.raises(ds.StateError, match=r"mode 0644.*must be 0600"):
        sd.load()
    sd.state_file.chmod(0o600)
    (tmp_path / "st").chmod(0o755)
    with pytest.raises(ds.StateError, match="mode 0755"):
        sd.load()


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "corrupt"),
        ("{", "corrupt"),
        ("[]", "corrupt"),
        ('{"version": 99}', "format version"),
        ('{"version": 1, "size": 1}', "KeyError"),
    ],
)
def test_corrupt_state_is_refused_with_the_file_named(tmp_path: Path, text: str, why: str) -> None:
    sd = ds.StateDir(tmp_path / "st")
    sd.save(_saved())
    sd.state_file.write_text(text)
    with pytest.raises(ds.StateError, match=why) as exc:
        sd.load()
    assert str(sd.state_file) in str(exc.value)


def test_impossible_values_and_missing_state_are_refused(tmp_path: Path) -> None:
    sd = ds.StateDir(tmp_path / "st")
    with pytest.raises(ds.StateError, match="nothing to resume"):
        sd.load()
    d = json.loads(_saved().to_json())
    d["token"] = "00"
    sd.save(_saved())
    sd.state_file.write_text(json.dumps(d))
    with pytest.raises(ds.StateError, match="impossible"):
        sd.load()


def test_page_tables_round_trip_and_refuse_truncated_or_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "pages.bin"
    t = ds.PageTables.create(path, 1000, encrypted=True)
    t.state[5] = 1
    t.crc[5] = 0xDEADBEEF
    assert t.meta is not None
    t.meta[28 * 5 : 28 * 6] = b"m" * 28
    t.nonce_counter = 12345
    t.close()
    assert path.stat().st_mode & 0o777 == 0o600
    t = ds.PageTables.open(path, 1000, encrypted=True)
    assert (t.state[5], t.crc[5], t.nonce_counter) == (1, 0xDEADBEEF, 12345)
    assert t.meta is not None and t.meta[28 * 5 : 28 * 6] == b"m" * 28
    assert t.state.count(0) == 999 and t.state.find(1) == 5 and t.state.find(1, 6) == -1
    t.close()
    with pytest.raises(ds.StateError, match="describes 1000 pages"):
        ds.PageTables.open(path, 999, encrypted=True)
    with pytest.raises(ds.StateError, match="plain"):
        ds.PageTables.open(path, 1000, encrypted=False)
    size = path.stat().st_size
    os.truncate(path, size - 1)
    with pytest.raises(ds.StateError, match="truncated or corrupt"):
        ds.PageTables.open(path, 1000, encrypted=True)
    os.truncate(path, 10)
    with pytest.raises(ds.StateError, match="truncated"):
        ds.PageTables.open(path, 1000, encrypted=True)
    path.write_bytes(b"x" * size)
    with pytest.raises(ds.StateError, match="bad magic"):
        ds.PageTables.open(path, 1000, encrypted=True)
    path.unlink()
    with pytest.raises(ds.StateError, match="missing"):
        ds.PageTables.open(path, 1000, encrypted=True)


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=1, max_size=300), st.integers(0, 2), st.integers(0, 320), st.integers(0, 320)
)
def test_byte_table_find_and_count_match_bytearray(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, x: int, a: int, b: int
) -> None:
    data = bytes(v % 3 for v in data)
    path = tmp_path_factory.mktemp("bt") / "p.bin"
    t = ds.PageTables.create(path, len(data), encrypted=False)
    try:
        t.state[:] = data
        ref = bytearray(data)
        assert t.state.find(x, a, b) == ref.find(x, a, b)
        assert t.state.find(x, a) == ref.find(x, a)
        assert t.state.count(x, a, b) == ref.count(x, a, b)
    finally:
        t.close()


def test_tables_written_just_before_sigkill_are_in_the_file(tmp_path: Path) -> None:
    """The point of the shared mapping: a store into it is in the page cache at once, so a
    process killed right after loses nothing, without any write() or msync()."""
    path = tmp_path / "pages.bin"
    code = (
        "import os, signal, sys\nfrom pathlib import Path\n"
        "from duvm.store import daemon_state as ds\n"
        f"t = ds.PageTables.create(Path({str(path)!r}), 64, encrypted=False)\n"
        "t.crc[63] = 0xCAFEF00D\nt.state[63] = 1\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr
    t = ds.PageTables.open(path, 64, encrypted=False)
    try:
        assert (t.crc[63], t.state[63], t.state.count(1)) == (0xCAFEF00D, 1, 1)
    finally:
        t.close()


# --- a real daemon, killed and resumed ------------------------------------------------------


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


class _Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log, "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        out.close()
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        return (self.tmp / name).read_text(errors="replace")

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def procs(tmp_path: Path):
    p = _Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def _memserver(procs: _Procs) -> int:
    procs.start(
        [*PY, "memserver", "--listen", "127.0.0.1:0", "--capacity", "64M", "--no-mlock"], "ms.log"
    )
    _wait_for(lambda: "listening on" in procs.log("ms.log"), 30, "memserver")
    return int(procs.log("ms.log").split("listening on ")[1].split()[0].rsplit(":", 1)[1])


def _daemon(
    procs: _Procs, port: int, sock: Path, state: Path, *extra: str
) -> subprocess.Popen[bytes]:
    sock.unlink(missing_ok=True)
    p = procs.start(
        [
            *PY,
            "daemon",
            "--peers",
            f"127.0.0.1:{port}",
            "--size",
            "8M",
            "--socket",
            str(sock),
            "--client-id",
            "test-resume",
            "--state-dir",
            str(state),
            "--no-mlock",
            *extra,
        ],
        "daemon.log",
    )
    _wait_for(lambda: sock.exists() or p.poll() is not None, 60, "daemon socket")
    return p


def _qemu_io(sock: Path, *cmds: str) -> str:
    args = ["qemu-io", "-f", "raw", f"nbd+unix:///?socket={sock}"]
    for c in cmds:
        args += ["-c", c]
    res = subprocess.run(args, capture_output=True, text=True, timeout=60)
    return res.stdout + res.stderr


def _namespace(port: int) -> dict | None:
    import asyncio

    from duvm.store.memserver_status import query_status

    st_ = asyncio.run(query_status("127.0.0.1", port))
    return next((n for n in st_["namespaces"] if n["client_id"] == "test-resume"), None)


@pytest.mark.timeout(180)
def test_sigkilled_daemon_resumes_with_its_pages_and_never_serves_a_bad_one(
    procs: _Procs, tmp_path: Path
) -> None:
    if subprocess.run(["which", "qemu-io"], capture_output=True).returncode:
        pytest.skip("qemu-io is not installed (Debian package qemu-utils)")
    port = _memserver(procs)
    sock, state = tmp_path / "d.sock", tmp_path / "state"
    d = _daemon(procs, port, sock, state)
    out = _qemu_io(sock, "write -P 0xab 0 64k", "write -P 0xcd 1M 8k")
    assert "wrote 65536/65536" in out and "wrote 8192/8192" in out, out
    assert {p.name for p in state.iterdir()} == {sf.STATE_FILE, sf.PAGES_FILE}
    d.send_signal(signal.SIGKILL)
    d.wait(30)
    assert _namespace(port)["stored_pages"] == 18  # kept for the lease  # type: ignore[index]

    d = _daemon(procs, port, sock, state, "--resume")
    assert d.poll() is None, procs.log("daemon.log")
    out = _qemu_io(sock, "read -P 0xab 0 64k", "read -P 0xcd 1M 8k", "read -P 0 2M 4k")
    assert out.count("read ") == 3 and "verification failed" not in out, out
    assert "error" not in out.lower(), out

    # a page whose checksum does not match what the memserver holds is EIO, never its bytes
    d.send_signal(signal.SIGKILL)
    d.wait(30)
    t = ds.PageTables.open(state / sf.PAGES_FILE, 2048, encrypted=False)
    t.crc[1] ^= 1
    t.close()
    d = _daemon(procs, port, sock, state, "--resume")
    bad = _qemu_io(sock, "read -P 0xab 4096 4k")
    assert "Input/output error" in bad and "read 4096/4096" not in bad, bad
    good = _qemu_io(sock, "read -P 0xab 8192 4k")
    assert "read 4096/4096" in good and "verification failed" not in good, good

    # a clean stop releases the namespace and forgets the state: nothing to resume
    d.send_signal(signal.SIGTERM)
    assert d.wait(30) == 0, procs.log("daemon.log")
    assert list(state.iterdir()) == []
    assert _namespace(port) is None
    d = _daemon(procs, port, sock, state, "--resume")
    assert d.wait(30) == 1
    assert "nothing to resume" in procs.log("daemon.log")


def test_resume_for_another_device_is_refused(procs: _Procs, tmp_path: Path) -> None:
    port = _memserver(procs)
    sock, state = tmp_path / "d.sock", tmp_path / "state"
    d = _daemon(procs, port, sock, state)
    d.send_signal(signal.SIGKILL)
    d.wait(30)
    sock.unlink()
    p = procs.start(
        [
            *PY,
            "daemon",
            "--peers",
            f"127.0.0.1:{port}",
            "--size",
            "16M",
            "--socket",
            str(sock),
            "--client-id",
            "test-resume",
            "--state-dir",
            str(state),
            "--resume",
            "--no-mlock",
        ],
        "bad.log",
    )
    assert p.wait(60) == 1
    assert "saved for another device: size 16777216 (saved 8388608)" in procs.log("bad.log")
    assert (state / sf.PAGES_FILE).exists()  # a refused resume destroys nothing


@pytest.mark.timeout(180)
def test_encrypted_pages_are_readable_after_sigkill_and_resume(
    procs: _Procs, tmp_path: Path
) -> None:
    """The key, the nonce/tag table and the nonce counter survive too; the memserver only ever
    held ciphertext, and the resumed daemon seals new writes with fresh nonces."""
    if subprocess.run(["which", "qemu-io"], capture_output=True).returncode:
        pytest.skip("qemu-io is not installed (Debian package qemu-utils)")
    port = _memserver(procs)
    sock, state = tmp_path / "d.sock", tmp_path / "state"
    d = _daemon(procs, port, sock, state, "--encrypt")
    out = _qemu_io(sock, "write -P 0x5a 0 32k")
    assert "wrote 32768/32768" in out, out
    saved = ds.StateDir(state).load()
    assert saved.key is not None and len(saved.key) == 32
    d.send_signal(signal.SIGKILL)
    d.wait(30)
    t = ds.PageTables.open(state / sf.PAGES_FILE, 2048, encrypted=True)
    counter = t.nonce_counter
    t.close()
    assert counter == 8  # one nonce per sealed page, stored before each seal

    d = _daemon(procs, port, sock, state, "--resume")
    # both lives sealed pages (the line follows the socket's creation: wait for it)
    _wait_for(lambda: procs.log("daemon.log").count("pages encrypted") == 2, 30, "its log")
    out = _qemu_io(sock, "read -P 0x5a 0 32k", "write -P 0x77 32k 4k", "read -P 0x77 32k 4k")
    assert out.count("read ") == 2 and "verification failed" not in out, out
    assert "error" not in out.lower(), out
    d.send_signal(signal.SIGKILL)
    d.wait(30)
    t = ds.PageTables.open(state / sf.PAGES_FILE, 2048, encrypted=True)
    assert t.nonce_counter == 9  # continued after the saved counter, never reused
    t.close()


async def test_slab_map_changes_are_saved_coalesced(memserver_pool, tmp_path: Path) -> None:
    """A dropped replica reaches daemon-state.json in the same loop iteration, once for a
    burst; a clean close forgets everything."""
    _, addrs = await memserver_pool(2, 8 << 20)
    # no repair task: it would put the dropped replicas back meanwhile
    store, state = await ds.open_store(
        tmp_path / "st", addrs, 4 << 20, "coalesce", 2, encrypt=False, resume=False, repair=False
    )
    sd = ds.StateDir(tmp_path / "st")
    saves = []
    real_save = sd.save
    state.dir.save = lambda s: (saves.append(1), real_save(s))  # type: ignore[method-assign]
    try:
        assert all(len(s) == 2 for s in sd.load().sets)
        for slab in range(store.table.nslabs):
            assert store.replication.drop_replica(slab, store.table.sets[slab][0], "test")
        assert saves == []  # not yet: once, at the end of this iteration
        await asyncio.sleep(0)
        assert saves == [1]
        assert sd.load().sets == [list(s) for s in store.table.sets]
        assert all(len(s) == 1 for s in sd.load().sets)
    finally:
        await store.close()
        state.discard()
    assert not sd.exists() and not sd.pages_file.exists()


@pytest.mark.parametrize("path", ["reference", "compiled"])
async def test_a_takeover_fences_the_dead_daemons_late_writes(
    memserver_pool, tmp_path: Path, pick_path, path: str
) -> None:
    """Catches a standby that serves without fencing (`Standby._fence` not called, or called
    with the dead daemon's own generation): a STORE the dead daemon still had in its socket's
    send buffer reaches the memserver after the standby wrote the same page again (the kernel
    resends the request in flight at the crash to the standby within a second, D48), and the
    page then holds the old bytes under the standby's checksum: it reads EIO. Both memserver
    request loops."""
    from duvm.store.memserver_errors import PageServerError
    from duvm.wire.pageproto import ErrorCode

    pick_path(path, "duvm.memserver._hotloop")
    _, addrs = await memserver_pool(2, 8 << 20)
    st = tmp_path / "st"
    store, state = await ds.open_store(
        st, addrs, 4 << 20, "fence", 2, encrypt=False, resume=False, repair=False
    )
    standby = None
    try:
        gen = state.tables.generation
        assert gen >= 1 and [c.epoch for c in store.clients] == [gen, gen]
        standby = await ds.open_standby(st, addrs, 4 << 20, "fence", 2, repair=False)
        assert [c.epoch for c in standby.remote.clients] == [gen, gen]  # joined, not fenced
        old = b"\x01" * 4096
        await store.write(0, memoryview(old))
        # the daemon "dies" here: its connections stay open, as its sockets' buffers do
        await standby.take_over()
        new_gen = standby.state.tables.generation
        assert new_gen > gen and state.tables.generation == new_gen  # one mapped header
        assert [c.epoch for c in standby.remote.clients] == [new_gen, new_gen]
        new = b"\x02" * 4096
        await standby.store.write(0, memoryview(new))
        # the dead daemon's STORE of page 0 arrives late, on its own connections
        for peer in store.table.sets[0]:
            with pytest.raises(PageServerError) as refused:
                await store.clients[peer].store([0], old)
            assert refused.value.code == ErrorCode.FENCED
        out = bytearray(4096)
        await standby.store.read(0, memoryview(out))
        assert bytes(out) == new
    finally:
        if standby is not None:
            await standby.store.close()
        await store.close()
        state.discard()


def test_each_generation_is_above_the_last_and_kept_in_the_tables(tmp_path: Path) -> None:
    """Catches a successor that counts from 0 again (a new daemon after `duvm disable
    --force` would be refused by its own old namespaces, or worse a successor would fence with
    its predecessor's generation and not fence it out)."""
    assert sf.next_generation(5) >= 6 and sf.next_generation(1 << 62) == (1 << 62) + 1
    t = ds.PageTables.create(tmp_path / sf.PAGES_FILE, 16, encrypted=False)
    assert t.generation == 0
    t.generation = 1234
    t.close()
    assert sf.generation_of(tmp_path / sf.PAGES_FILE) == 1234
    t = ds.PageTables.open(tmp_path / sf.PAGES_FILE, 16, encrypted=False)
    assert t.generation == 1234
    t.close()
    assert sf.generation_of(tmp_path / "missing") == 0
