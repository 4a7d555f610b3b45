"""The NBD server under a flood of idle connections and slow (slowloris) clients: a real
client (qemu-io) is still served, and the stalled handshakes are dropped at the timeout."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat

import pytest
from duvm.node.daemon.nbdserver import NBDServer
from duvm.store.memory_store import MemoryStore


async def _qemu_io(sock: str, *cmds: str) -> tuple[int, str]:
    args = ["qemu-io", "-f", "raw"]
    for c in cmds:
        args += ["-c", c]
    proc = await asyncio.create_subprocess_exec(
        *args,
        f"nbd+unix:///?socket={sock}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


async def test_flood_and_slowloris_do_not_stop_a_real_client(tmp_path) -> None:
    if shutil.which("qemu-io") is None:
        pytest.skip("qemu-io not installed")
    store = MemoryStore(1 << 20)
    srv = NBDServer(store, max_connections=64, handshake_timeout=1.5)
    sock = str(tmp_path / "nbd.sock")
    await srv.start_unix(sock)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600  # local control: root (owner) only
    writers = []
    try:
        for _ in range(40):  # idle connections that never negotiate
            _, w = await asyncio.open_unix_connection(sock)
            writers.append(w)

        async def slowloris() -> None:
            r, w = await asyncio.open_unix_connection(sock)
            writers.append(w)
            await r.readexactly(18)  # the greeting
            for b in b"\x00\x00\x00\x03IHAVEOPT":  # client flags, then an option, one byte a tick
                if w.is_closing():
                    return
                w.write(bytes([b]))
                await asyncio.sleep(0.2)

        slow = [asyncio.ensure_future(slowloris()) for _ in range(8)]
        rc, out = await _qemu_io(sock, "write -P 0x5a 4096 8192", "read -P 0x5a 4096 8192")
        assert rc == 0 and "read 8192/8192" in out, out
        await asyncio.sleep(2.5)  # past the handshake timeout: every stalled client is gone
        assert srv.open_connections == 0
        assert srv.stats.protocol_errors >= 48
        rc, out = await _qemu_io(sock, "read -P 0x5a 4096 8192")
        assert rc == 0, out
        for s in slow:
            s.cancel()
    finally:
        for w in writers:
            w.close()
        await srv.close()
        await store.close()
