"""CryptStore: pages sealed on the owning node; the store below holds only ciphertext, and any
page it swaps, replays or alters reads as EIO, never as other bytes."""

from __future__ import annotations

import errno
import os

import pytest
from duvm.memserver.server import MemServer
from duvm.store.crypt_store import META, CryptStore
from duvm.store.memory_store import MemoryStore
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import StorageError
from hypothesis import given, settings
from hypothesis import strategies as st

PS = 4096


def _page(tag: bytes) -> bytes:
    return (tag * (PS // len(tag) + 1))[:PS]


async def _raw(store: MemoryStore, page: int) -> bytes:
    out = bytearray(PS)
    await store.read(page * PS, memoryview(out))
    return bytes(out)


async def test_round_trip_and_the_store_below_sees_only_ciphertext() -> None:
    inner = MemoryStore(64 * PS)
    cs = CryptStore(inner)
    secret = _page(b"password=hunter2;")
    await cs.write(3 * PS, memoryview(secret))
    out = bytearray(PS)
    await cs.read(3 * PS, memoryview(out))
    assert bytes(out) == secret
    raw = await _raw(inner, 3)
    assert len(raw) == PS and raw != secret and b"hunter2" not in raw
    assert cs.counters()["pages_sealed"] == 1 and cs.counters()["pages_opened"] == 1


async def test_multi_page_requests_and_unwritten_pages_read_zero() -> None:
    inner = MemoryStore(16 * PS)
    cs = CryptStore(inner)
    data = b"".join(_page(bytes([65 + i])) for i in range(4))
    await cs.write(2 * PS, memoryview(data))
    out = bytearray(8 * PS)
    await cs.read(0, memoryview(out))
    assert bytes(out) == bytes(2 * PS) + data + bytes(2 * PS)


async def test_every_page_of_a_multi_page_write_gets_its_own_nonce() -> None:
    """Catches one nonce shared by all the pages of a request: under AES-GCM equal pages then
    encrypt to equal ciphertext (the keystream repeats), which shows the memserver which pages
    match and, with a known page, lets it read the others."""
    inner = MemoryStore(16 * PS)
    cs = CryptStore(inner)
    same = _page(b"all four pages alike;")
    await cs.write(4 * PS, memoryview(same * 4))
    raws = [await _raw(inner, p) for p in range(4, 8)]
    assert len(set(raws)) == 4, "two pages of one write were sealed with one nonce"
    xor = bytes(a ^ b for a, b in zip(raws[0], raws[1], strict=True))
    assert xor != bytes(PS)  # (the keystreams differ, not only the tags)
    out = bytearray(4 * PS)
    await cs.read(4 * PS, memoryview(out))
    assert bytes(out) == same * 4
    assert cs.counters()["pages_sealed"] == 4


async def test_swapped_pages_fail_authentication_with_eio() -> None:
    inner = MemoryStore(8 * PS)
    cs = CryptStore(inner)
    a, b = _page(b"A"), _page(b"B")
    await cs.write(0, memoryview(a))
    await cs.write(PS, memoryview(b))
    ra, rb = await _raw(inner, 0), await _raw(inner, 1)
    # a malicious memserver swaps the two ciphertexts
    await inner.write(0, memoryview(rb))
    await inner.write(PS, memoryview(ra))
    out = bytearray(PS)
    with pytest.raises(StorageError) as ei:
        await cs.read(0, memoryview(out))
    assert ei.value.errno == errno.EIO and bytes(out) == bytes(PS)  # nothing unverified leaks
    assert cs.counters()["tag_failures"] == 1


async def test_replayed_old_version_and_flipped_bit_fail() -> None:
    inner = MemoryStore(4 * PS)
    cs = CryptStore(inner)
    await cs.write(0, memoryview(_page(b"old")))
    old = await _raw(inner, 0)
    await cs.write(0, memoryview(_page(b"new")))
    await inner.write(0, memoryview(old))  # replay of the previous ciphertext
    with pytest.raises(StorageError, match="failed authentication"):
        await cs.read(0, memoryview(bytearray(PS)))
    await cs.write(0, memoryview(_page(b"new")))
    raw = bytearray(await _raw(inner, 0))
    raw[100] ^= 1
    await inner.write(0, memoryview(raw))
    with pytest.raises(StorageError):
        await cs.read(0, memoryview(bytearray(PS)))


async def test_same_plaintext_twice_gives_different_ciphertext() -> None:
    inner = MemoryStore(4 * PS)
    cs = CryptStore(inner)
    p = _page(b"same")
    await cs.write(0, memoryview(p))
    await cs.write(PS, memoryview(p))
    first = await _raw(inner, 0)
    assert first != await _raw(inner, 1)
    await cs.write(0, memoryview(p))
    assert first != await _raw(inner, 0)  # a rewrite gets a new nonce


async def test_trim_and_zeroes_forget_the_page() -> None:
    inner = MemoryStore(4 * PS)
    cs = CryptStore(inner)
    await cs.write(0, memoryview(_page(b"x") * 2))
    await cs.trim(0, PS)
    await cs.write_zeroes(PS, PS)
    out = bytearray(2 * PS)
    await cs.read(0, memoryview(out))
    assert bytes(out) == bytes(2 * PS)
    assert bytes(cs._meta[: 2 * META]) == bytes(2 * META)


async def test_a_new_key_cannot_read_old_pages() -> None:
    inner = MemoryStore(4 * PS)
    cs = CryptStore(inner)
    await cs.write(0, memoryview(_page(b"s")))
    again = CryptStore(inner)  # what a restarted daemon has: a new key, an empty table
    out = bytearray(PS)
    await again.read(0, memoryview(out))
    assert bytes(out) == bytes(PS)  # unknown pages read as zeros, never as old plaintext
    again._meta[:META] = cs._meta[:META]  # even with the old nonce and tag: wrong key
    with pytest.raises(StorageError):
        await again.read(0, memoryview(out))


async def test_failed_write_keeps_the_previous_version_readable() -> None:
    from duvm.store.storage import FaultStore

    inner = MemoryStore(4 * PS)
    fs = FaultStore(inner)
    cs = CryptStore(fs)
    await cs.write(0, memoryview(_page(b"v1")))
    fs.fail["write"] = errno.EIO
    with pytest.raises(StorageError):
        await cs.write(0, memoryview(_page(b"v2")))
    out = bytearray(PS)
    await cs.read(0, memoryview(out))
    assert bytes(out) == _page(b"v1")


async def test_stacked_over_remote_store_the_memserver_holds_no_plaintext() -> None:
    srv = MemServer(64 * PS, lease_s=60, lock=False)
    addr = await srv.start()
    try:
        remote = await RemoteStore.open([addr], 32 * PS, "crypt:1")
        cs = CryptStore(remote)
        marker = b"BEGIN PRIVATE KEY"
        secret = _page(marker + os.urandom(16))
        for i in range(8):
            await cs.write(i * PS, memoryview(secret))
        out = bytearray(8 * PS)
        await cs.read(0, memoryview(out))
        assert bytes(out) == secret * 8
        arena = bytes(srv.store.arena.memory)
        assert srv.store.arena.used_slots == 8 and marker not in arena
        # the memserver swaps two stored pages of the namespace: detected
        ns = srv.store.namespaces["crypt:1"]
        ns.pages[0], ns.pages[1] = ns.pages[1], ns.pages[0]
        with pytest.raises(StorageError) as ei:
            await cs.read(0, memoryview(bytearray(PS)))
        assert ei.value.errno == errno.EIO
        await cs.close()
    finally:
        await srv.close()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["w", "r", "t"]),
            st.integers(0, 7),
            st.integers(1, 3),
            st.binary(min_size=1, max_size=8),
        ),
        max_size=25,
    )
)
def test_model_random_operations_match_a_plain_store(ops) -> None:
    import asyncio

    async def run() -> None:
        plain = bytearray(10 * PS)
        cs = CryptStore(MemoryStore(10 * PS))
        for op, page, n, fill in ops:
            a, b = page * PS, (page + n) * PS
            if op == "w":
                data = _page(fill) * n
                await cs.write(a, memoryview(data))
                plain[a:b] = data
            elif op == "t":
                await cs.trim(a, b - a)
                plain[a:b] = bytes(b - a)
            else:
                out = bytearray(b - a)
                await cs.read(a, memoryview(out))
                assert out == plain[a:b]

    asyncio.run(run())


async def test_a_write_declined_on_the_fast_path_is_sealed_once() -> None:
    """Catches the double seal: a write the store below declines on the fast path (a slab
    under repair, a replica not connected) was sealed for it and then sealed again by the
    coroutine write, twice the cipher's work exactly when the cluster is degraded. The layer
    keeps the request and finishes it on the coroutine path with the bytes it sealed."""

    class Declining(MemoryStore):  # a store below that declines every fast-path request
        def start_write(self, offset, data, done, tag) -> bool:
            return False

    cs = CryptStore(Declining(16 * PS))
    data = memoryview(_page(b"declined then written;"))
    conts: list = []
    assert cs.start_write(2 * PS, data, lambda tag, cont: conts.append((tag, cont)), "t")
    assert cs.cipher.counter == 1 and len(conts) == 1 and conts[0][0] == "t"
    await conts[0][1]  # the continuation the NBD connection runs as a Task
    assert cs.cipher.counter == 1  # no second seal
    out = bytearray(PS)
    await cs.read(2 * PS, memoryview(out))
    assert bytes(out) == bytes(data)
    assert cs.counters()["pages_sealed"] == 1
