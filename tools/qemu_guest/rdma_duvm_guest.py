"""Runs inside the QEMU test guest: duvm's RDMA transport on Soft-RoCE (rdma_rxe), end to end
through real memservers, and its access control. Reports facts, judges nothing
(``rdma_check.py --duvm`` and ``test_rdma_qemu.py`` on the host do).

Theory of operation
-------------------
As ``rdma_guest.py`` (whose helpers it uses): rxe0 on eth0, the host's Python and rdma-core over
9p. Two memservers listen on the guest's eth0 address with ``--rdma on`` and a cluster secret;
a `MemClient` per namespace connects with ``transport="rdma"``. Steps, each one JSON event:

- ``roundtrip``: pages written and read back by RDMA WRITE/READ across several chunks, equal;
  the memserver's STORE/LOAD counters stay 0 (no memserver CPU per page), and a TCP client of
  the same namespace reads the same bytes.
- ``forged``: a second namespace's client posts with the first one's address and rkey, then
  with its own rkey at the first one's address: the NIC refuses both, its link breaks, and the
  first namespace's pages are intact.
- ``stale``: after RELEASE the old rkeys are refused.
- ``ticket``: an rdma-cm connect with a made-up ticket is rejected (no TCP handshake, so no
  region key is ever handed out).
- ``expired``: a real ticket (RDMA_OPEN on an authenticated TCP connection that stays open),
  used after its lifetime, is rejected.
- ``past_end``: a client posts with its own rkey at the page just past its own region, where
  another namespace's page lies in the arena: the NIC refuses it and nothing leaks.
- ``fallback``: ``transport="auto"`` against a third memserver started with ``--rdma off``
  moves its pages by TCP and says why.
- ``cpu``: the daemon-side CPU per 4 KiB request over RDMA and over TCP, same guest.
- ``doctor``: `duvm doctor` with an ``rdma://`` peer that listens and one that does not.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rdma_guest import DEVICE, IP, NETDEV, emit, run  # sibling; tools/ is not a package

SECRET = "/run/cluster.secret"
PORTS = (7070, 7071)
TCP_ONLY_PORT = 7072  # a memserver with --rdma off, for the fallback of transport "auto"
PS = 4096


def start_memservers() -> list[subprocess.Popen[bytes]]:
    procs = []
    for port in (*PORTS, TCP_ONLY_PORT):
        log = open(f"/run/memserver{port}.log", "wb")  # noqa: SIM115 - the child's stdout
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "duvm.cli",
                    "memserver",
                    "--listen",
                    f"{IP}:{port}",
                    "--capacity",
                    "64M",
                    "--rdma",
                    "off" if port == TCP_ONLY_PORT else "on",
                    "--secret-file",
                    SECRET,
                    "-v",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + 120
    for port in (*PORTS, TCP_ONLY_PORT):
        while "listening on" not in Path(f"/run/memserver{port}.log").read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(Path(f"/run/memserver{port}.log").read_text())
            time.sleep(0.2)
    return procs


def _client(name: str, port: int, transport: str) -> Any:
    from duvm.store.memclient import MemClient
    from duvm.wire import auth

    sec = auth.PeerSecurity(auth.Keyring.from_file(SECRET))
    return MemClient(IP, port, name, security=sec, transport=transport, chunk_pages=256)


async def _cb(client: Any, write: bool, keys: tuple[int, ...], buf: memoryview) -> Any:
    """One request through the callback path (the daemon's hot path); its exception or None."""
    fut = asyncio.get_running_loop().create_future()
    posted = (client.store_cb if write else client.load_cb)(
        keys, buf, lambda exc: fut.done() or fut.set_result(exc)
    )
    if not posted:
        return "not connected"
    return await asyncio.wait_for(fut, 60)


async def reconnect(client: Any) -> bool:
    """Wait out the breaker a broken link opened, then reconnect (RDMA again)."""
    for _ in range(100):
        if await client.probe():
            return client.transport_in_use == "rdma"
        await asyncio.sleep(0.2)
    return False


async def roundtrip() -> dict[str, Any]:
    a = _client("guest/a", PORTS[0], "rdma")
    await a.connect()
    out: dict[str, Any] = {"transport": a.transport_in_use, "rdma_error": a.rdma_error}
    await a.reserve(1024)
    data = os.urandom(300 * PS)
    keys = tuple(range(100, 400))  # chunks 0 and 1
    for i in range(0, 300, 50):
        await a.store_batch(keys[i : i + 50], memoryview(data)[i * PS : (i + 50) * PS])
    # a batch of scattered keys in one chunk: one chain of several runs
    scattered = (600, 602, 604, 700)
    sdata = os.urandom(len(scattered) * PS)
    out["cb_store"] = repr(await _cb(a, True, scattered, memoryview(sdata)))
    back = bytearray(300 * PS)
    for i in range(0, 300, 100):
        await a.load_batch(keys[i : i + 100], memoryview(back)[i * PS : (i + 100) * PS])
    sback = bytearray(len(scattered) * PS)
    out["cb_load"] = repr(await _cb(a, False, scattered, memoryview(sback)))
    out["equal"] = bytes(back) == data and bytes(sback) == sdata
    st = await a.status()
    out["server_counters"] = st["counters"]
    out["server_rdma"] = st.get("rdma")
    tcp = _client("guest/a", PORTS[0], "tcp")  # the same namespace, over TCP
    await tcp.connect()
    out["tcp_reads_same"] = bytes(await tcp.load(keys[:10])) == data[: 10 * PS]
    await tcp.close()
    out["chunks_mapped"] = sorted(a.rdma.chunks)
    return out | {"_client": a, "_data": data, "_keys": keys}


async def forged(a: Any, data: bytes, keys: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    b = _client("guest/b", PORTS[0], "rdma")
    await b.connect()
    await b.reserve(256)
    mine = os.urandom(PS)
    await b.store_batch((5,), memoryview(mine))  # maps b's chunk 0
    a_addr, a_rkey = a.rdma.chunks[0]
    b_rkey = b.rdma.chunks[0][1]
    out["distinct_rkeys"] = a_rkey != b_rkey
    # b claims a's chunk 0 with a's address and rkey: another domain's key
    b.rdma.chunks[1] = (a_addr, a_rkey)
    buf = bytearray(PS)
    # b's key 256 + k would be a's key k: 356 is a's key 100, the first page a wrote
    out["foreign_rkey"] = repr(await _cb(b, False, (356,), memoryview(buf)))
    out["foreign_rkey_leaked"] = bytes(buf) == data[:PS]
    await asyncio.sleep(0.5)
    out["b_link_after"] = b.transport_in_use
    # reconnected, b tries its own rkey at a's address (outside its regions)
    out["b_reconnected"] = await reconnect(b)
    if b.rdma is not None:
        await b.load_batch((5,), memoryview(bytearray(PS)))  # maps b's chunk 0 again
        _, b_rkey2 = b.rdma.chunks[0]
        b.rdma.chunks[2] = (a_addr, b_rkey2)
        out["own_rkey_foreign_address"] = repr(
            await _cb(b, True, (512,), memoryview(os.urandom(PS)))
        )
        out["b_reconnected_again"] = await reconnect(b)
    else:
        out["own_rkey_foreign_address"] = f"b has no RDMA link after reconnecting: {b.rdma_error}"
    back = bytearray(len(keys) * PS)
    await a.load_batch(keys[:100], memoryview(back)[: 100 * PS])
    await a.load_batch(keys[100:200], memoryview(back)[100 * PS : 200 * PS])
    await a.load_batch(keys[200:], memoryview(back)[200 * PS :])
    out["a_intact"] = bytes(back) == data
    st = await a.status()
    out["server_rdma"] = st.get("rdma")
    await b.release()
    await b.close()
    return out


async def stale(a: Any) -> dict[str, Any]:
    old = dict(a.rdma.chunks)
    link = a.rdma
    await a.release()
    link.chunks.update(old)  # the client keeps using its old keys
    res = repr(await _cb(a, False, (100,), memoryview(bytearray(PS))))
    await a.close()
    return {"stale_rkey": res}


async def ticket() -> dict[str, Any]:
    from duvm.rdma import verbs
    from duvm.store import rdma_link
    from duvm.wire import pageproto as pp

    v = verbs.load()
    fake = pp.RdmaOpenReply(0, PORTS[1], 1, os.urandom(32))
    try:
        staging = rdma_link.new_staging(v, 16)
        link = await rdma_link.open_link(v, IP, fake, 256, "forger", None, staging)
    except rdma_link.LinkError as e:
        return {"forged_ticket": f"refused: {e}"}
    link.close()
    return {"forged_ticket": "ACCEPTED"}


async def expired() -> dict[str, Any]:
    """A genuine ticket, presented after `TICKET_TTL_S`: its TCP connection is still open, so
    only its age can make the memserver reject it."""
    from duvm.memserver.rdma_service import TICKET_TTL_S
    from duvm.rdma import verbs
    from duvm.store import rdma_link
    from duvm.wire import pageproto as pp

    c = _client("guest/expired", PORTS[1], "tcp")
    await c.connect()
    reply = await c._request(pp.RdmaOpen(0, 256))
    out: dict[str, Any] = {"ticket_issued": isinstance(reply, pp.RdmaOpenReply)}
    await asyncio.sleep(TICKET_TTL_S + 2)
    v = verbs.load()
    try:
        staging = rdma_link.new_staging(v, 16)
        link = await rdma_link.open_link(v, IP, reply, 256, "expired", None, staging)
    except rdma_link.LinkError as e:
        out["expired_ticket"] = f"refused: {e}"
    else:
        link.close()
        out["expired_ticket"] = "ACCEPTED"
    out["tcp_still_connected"] = c.connected
    await c.close()
    return out


async def past_end() -> dict[str, Any]:
    """`edge` holds one chunk (its first region in a fresh arena); `neighbour`, a TCP namespace
    attached after it, stores a page into the next free slot, the first one past that region.
    `edge` then reads and writes that page with its own, valid rkey."""
    edge = _client("guest/edge", PORTS[1], "rdma")
    await edge.connect()
    await edge.reserve(256)  # one chunk of 256 pages: one region
    await edge.store_batch((5,), memoryview(os.urandom(PS)))  # maps chunk 0
    neighbour = _client("guest/neighbour", PORTS[1], "tcp")
    await neighbour.connect()
    await neighbour.reserve(4)
    secret = os.urandom(PS)
    await neighbour.store([0], secret)
    addr, rkey = edge.rdma.chunks[0]
    edge.rdma.chunks[3] = (addr + 256 * PS, rkey)  # key 768: one page past the region
    buf = bytearray(PS)
    out: dict[str, Any] = {"transport": edge.transport_in_use}
    out["past_end_read"] = repr(await _cb(edge, False, (768,), memoryview(buf)))
    out["past_end_leaked"] = bytes(buf) == secret
    if await reconnect(edge):
        await edge.load_batch((5,), memoryview(bytearray(PS)))  # maps chunk 0 again
        addr, rkey = edge.rdma.chunks[0]
        edge.rdma.chunks[3] = (addr + 256 * PS, rkey)
        junk = memoryview(os.urandom(PS))
        out["past_end_write"] = repr(await _cb(edge, True, (768,), junk))
        out["edge_reconnected_again"] = await reconnect(edge)
    else:
        out["past_end_write"] = f"no RDMA link after reconnecting: {edge.rdma_error}"
    out["neighbour_intact"] = bytes(await neighbour.load([0])) == secret
    for c in (edge, neighbour):
        await c.release()
        await c.close()
    return out


async def fallback() -> dict[str, Any]:
    """`auto` against a memserver that serves TCP only: TCP, with the reason."""
    c = _client("guest/auto", TCP_ONLY_PORT, "auto")
    await c.connect()
    await c.reserve(4)
    page = os.urandom(PS)
    await c.store([1], page)
    out = {
        "transport": c.transport_in_use,
        "rdma_error": c.rdma_error,
        "equal": bytes(await c.load([1])) == page,
    }
    await c.release()
    await c.close()
    return out


async def cpu() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for transport in ("rdma", "tcp"):
        c = _client(f"guest/cpu-{transport}", PORTS[1], transport)
        await c.connect()
        await c.reserve(256)
        page = memoryview(os.urandom(PS))
        buf = memoryview(bytearray(PS))
        await c.store_batch((0,), page)
        n = 2000
        for write in (True, False):
            t0, c0 = time.monotonic(), time.process_time()
            for i in range(n):
                if write:
                    await c.store_batch((i % 256,), page)
                else:
                    await c.load_batch((i % 256,), buf)
            wall, cputime = time.monotonic() - t0, time.process_time() - c0
            kind = "write" if write else "read"
            out[f"{transport}_{kind}_us_per_request"] = round(wall / n * 1e6, 1)
            out[f"{transport}_{kind}_cpu_us_per_request"] = round(cputime / n * 1e6, 1)
        out[f"{transport}_in_use"] = c.transport_in_use
        await c.release()
        await c.close()
    return out


def doctor() -> dict[str, Any]:
    """`duvm doctor` naming one memserver with an RDMA listener and one without."""
    peers = f"rdma://{IP}:{PORTS[0]},rdma://{IP}:{TCP_ONLY_PORT}"
    res = run(sys.executable, "-m", "duvm.cli", "doctor", "--peers", peers, "--secret-file", SECRET)
    lines = [line for line in res["out"].splitlines() if " rdma" in line or "memlock" in line]
    return {"rc": res["rc"], "rdma_lines": lines}


async def checks() -> None:
    r = await roundtrip()
    a, data, keys = r.pop("_client"), r.pop("_data"), r.pop("_keys")
    emit("roundtrip", **r)
    emit("forged", **await forged(a, data, keys))
    emit("stale", **await stale(a))
    emit("ticket", **await ticket())
    emit("expired", **await expired())
    emit("past_end", **await past_end())
    emit("fallback", **await fallback())
    emit("cpu", **await cpu())
    emit("doctor", **doctor())


def main() -> int:
    emit("start", kernel=os.uname().release)
    emit("link_add", **run("rdma", "link", "add", DEVICE, "type", "rxe", "netdev", NETDEV))
    emit("secret", **run(sys.executable, "-m", "duvm.cli", "secret", "generate", SECRET))
    procs = start_memservers()
    try:
        asyncio.run(checks())
    except Exception as exc:
        emit("crash", error=f"{type(exc).__name__}: {exc}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        logs = {p: Path(f"/run/memserver{p}.log").read_text()[-3000:] for p in PORTS}
        emit("memserver_logs", logs=logs, rc=[p.returncode for p in procs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
