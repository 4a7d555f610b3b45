"""The compiled page cipher against the pure-Python reference (differential tests).

Both are driven with the same key, counter and request sequences; every sealed byte, every
nonce and tag, every opened page and every refusal must be the same, and each opens what the
other sealed (so a daemon and its state file may switch paths). Without the compiled module
these tests skip, except where DUVM_REQUIRE_COMPILED=1 (CI builds it) makes that a failure.
They run whatever DUVM_PURE_PYTHON says: they compare the two paths rather than pick one.
The CryptStore tests run over both paths: the same writes give the same ciphertext below.
"""

from __future__ import annotations

import importlib
import os

import pytest
from duvm.base import accel
from duvm.store.crypt_store import CryptStore
from duvm.store.memory_store import MemoryStore
from duvm.store.page_cipher import META, PurePageCipher, TagFailure
from duvm.store.storage import StorageError
from hypothesis import given, settings
from hypothesis import strategies as st

PS = 4096
# the compiled module whenever it is built and current, whatever DUVM_PURE_PYTHON says: these
# tests compare the two paths, they do not pick one
BUILT = accel.state("duvm.store._pagecipher")
compiled = importlib.import_module("duvm.store._pagecipher") if BUILT == "compiled" else None
if compiled is None and os.environ.get("DUVM_REQUIRE_COMPILED") == "1":
    raise AssertionError(f"the compiled path is required here: {BUILT}")
needs_compiled = pytest.mark.skipif(compiled is None, reason=f"compiled path: {BUILT}")


def _pair(key: bytes, counter: int = 0) -> tuple[object, PurePageCipher]:
    assert compiled is not None
    return compiled.PageCipher(key, counter), PurePageCipher(key, counter)


def _seal(cipher, first: int, plain: bytes) -> tuple[bytes, bytes]:
    n = len(plain) // PS
    sealed, meta = bytearray(len(plain)), bytearray(n * META)
    cipher.seal(first, memoryview(plain), memoryview(sealed), memoryview(meta))
    return bytes(sealed), bytes(meta)


def _open(cipher, first: int, sealed: bytes, meta: bytes) -> tuple[object, bytes | None]:
    """(pages opened or ("tag", index)), and the bytes when it succeeded."""
    data = bytearray(sealed)
    try:
        n = cipher.open(first, memoryview(data), memoryview(meta))
    except TagFailure as e:
        return ("tag", e.index), None
    return n, bytes(data)


# A request: first page number, page contents (few distinct, so equal pages occur), which
# pages are unwritten (zero metadata), and one tampering of the stored bytes.
TAMPER = st.sampled_from(["none", "byte", "tag", "nonce", "swap", "first", "replay"])


@needs_compiled
@settings(max_examples=120)
@given(
    key=st.binary(min_size=32, max_size=32),
    counter=st.integers(0, (1 << 96) - 1 - 64) | st.integers(0, 1000) | st.just((1 << 64) - 2),
    first=st.integers(0, (1 << 64) - 65),
    pages=st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=8),
    unwritten=st.sets(st.integers(0, 7)),
    tamper=TAMPER,
    where=st.integers(0, 7),
)
def test_both_paths_seal_and_open_every_request_alike(
    key, counter, first, pages, unwritten, tamper, where
) -> None:
    """Catches a compiled rule that differs from the reference: a nonce counter that does not
    carry from its low 64 bits, the page number or nonce left out of the associated data, a
    tag written or checked at the wrong place, an unwritten page not zeroed."""
    fast, ref = _pair(key, counter)
    plain = b"".join((p * (PS // len(p) + 1))[:PS] for p in pages)
    n = len(pages)
    got, want = _seal(fast, first, plain), _seal(ref, first, plain)
    assert got == want
    assert fast.counter == ref.counter == counter + n
    sealed, meta = bytearray(want[0]), bytearray(want[1])
    for i in unwritten:
        if i < n:
            meta[i * META : (i + 1) * META] = bytes(META)
    i = where % n
    if tamper == "byte":
        sealed[i * PS + where * 97 % PS] ^= 0x01
    elif tamper == "tag":
        meta[i * META + META - 1] ^= 0x80
    elif tamper == "nonce":
        meta[i * META] ^= 0x02
    elif tamper == "swap" and n > 1:  # two pages' ciphertext and entries swapped together
        j = (i + 1) % n
        a, b = slice(i * PS, (i + 1) * PS), slice(j * PS, (j + 1) * PS)
        sealed[a], sealed[b] = sealed[b], sealed[a]
        ma, mb = slice(i * META, (i + 1) * META), slice(j * META, (j + 1) * META)
        meta[ma], meta[mb] = meta[mb], meta[ma]
    elif tamper == "replay":  # an older version of page i, with its own valid entry
        old_s, old_m = _seal(ref, first + i, bytes(PS))
        sealed[i * PS : (i + 1) * PS], meta[i * META : (i + 1) * META] = old_s, old_m
    opened_first = first + 1 if tamper == "first" else first
    outcome = _open(fast, opened_first, bytes(sealed), bytes(meta))
    assert outcome == _open(ref, opened_first, bytes(sealed), bytes(meta))
    if tamper == "none":  # the untouched request opens to what was sealed
        count, data = outcome
        assert count == n - len([u for u in unwritten if u < n])
        expect = bytearray(plain)
        for u in unwritten:
            if u < n:
                expect[u * PS : (u + 1) * PS] = bytes(PS)
        assert data == bytes(expect)
    assert fast.written(memoryview(meta)) == ref.written(memoryview(meta))


@needs_compiled
def test_each_path_opens_what_the_other_sealed() -> None:
    key = os.urandom(32)
    fast, ref = _pair(key, 41)
    plain = os.urandom(3 * PS)
    s_fast, m_fast = _seal(fast, 7, plain)
    fast2, ref2 = _pair(key)
    assert _open(ref2, 7, s_fast, m_fast) == (3, plain)
    s_ref, m_ref = _seal(ref, 7, plain)
    assert _open(fast2, 7, s_ref, m_ref) == (3, plain)


@needs_compiled
def test_the_nonce_space_runs_out_alike_and_nothing_is_sealed() -> None:
    """Catches a compiled counter that wraps to nonce 0 (a nonce reused under the key)
    instead of refusing, or that seals part of a request before refusing it."""
    top = (1 << 96) - 1
    for cipher in _pair(os.urandom(32), top - 2):
        sealed, meta = bytearray(3 * PS), bytearray(3 * META)
        with pytest.raises(OverflowError):
            cipher.seal(0, memoryview(bytes(3 * PS)), memoryview(sealed), memoryview(meta))
        assert cipher.counter == top - 2 and sealed == bytes(3 * PS) and meta == bytes(3 * META)
        _seal(cipher, 0, bytes(2 * PS))  # the last two nonces are still there to use
        assert cipher.counter == top


@needs_compiled
@pytest.mark.parametrize(
    ("plain", "sealed", "meta"),
    [(PS, PS + 1, META), (PS, 2 * PS, META), (PS, PS, META - 1), (PS - 1, PS - 1, 0)],
)
def test_both_paths_refuse_mismatched_buffers(plain: int, sealed: int, meta: int) -> None:
    for cipher in _pair(os.urandom(32)):
        with pytest.raises(ValueError):
            cipher.seal(
                0,
                memoryview(bytes(plain)),
                memoryview(bytearray(sealed)),
                memoryview(bytearray(meta)),
            )
        assert cipher.counter == 0
    for make in (lambda k: compiled.PageCipher(k), PurePageCipher):
        with pytest.raises(ValueError, match="32-byte key"):
            make(b"short")


def test_the_factory_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from duvm.store.page_cipher import page_cipher

    monkeypatch.setenv(accel.ENV, "1")
    assert type(page_cipher(os.urandom(32))) is PurePageCipher
    assert accel.report().path == "pure" and accel.report().chosen
    monkeypatch.delenv(accel.ENV)
    if compiled is not None:
        assert type(page_cipher(os.urandom(32))) is compiled.PageCipher


# --- CryptStore over either path -----------------------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["write", "read", "trim", "zero", "rot"]),
        st.integers(0, 15),  # first page
        st.integers(1, 4),  # pages
        st.integers(0, 255),  # fill byte
    ),
    min_size=1,
    max_size=25,
)


@needs_compiled
@settings(max_examples=60)
@given(key=st.binary(min_size=32, max_size=32), ops=OPS)
async def test_crypt_store_behaves_alike_over_both_paths(key, ops) -> None:
    """Catches a difference the store would show: other ciphertext below, another reply or
    errno, a trimmed page that does not read as zeros, a rotten page that is not EIO."""
    stores = []
    for cipher in _pair(key):
        cs = CryptStore(MemoryStore(20 * PS), key=key)
        cs.cipher = cipher
        stores.append(cs)
    for op, first, n, fill in ops:
        results = []
        for cs in stores:
            off, length = first * PS, n * PS
            try:
                if op == "write":
                    await cs.write(off, memoryview(bytes([fill]) * length))
                    results.append(None)
                elif op == "read":
                    out = bytearray(length)
                    await cs.read(off, memoryview(out))
                    results.append(bytes(out))
                elif op == "trim":
                    await cs.trim(off, length)
                    results.append(None)
                elif op == "zero":
                    await cs.write_zeroes(off, length)
                    results.append(None)
                else:  # one byte of the stored ciphertext rots
                    raw = bytearray(PS)
                    await cs.inner.read(off, memoryview(raw))
                    raw[fill * 13 % PS] ^= 0x10
                    await cs.inner.write(off, memoryview(raw))
                    results.append(None)
            except StorageError as e:
                results.append(("error", e.errno, e.reason))
        assert results[0] == results[1], (op, first, n)
        below = []
        for cs in stores:
            raw = bytearray(20 * PS)
            await cs.inner.read(0, memoryview(raw))
            below.append(bytes(raw))
        assert below[0] == below[1]
    assert stores[0].counters() == stores[1].counters()
