"""Peer authentication, TLS, namespace isolation and connection limits of the memserver,
driven by real clients and by raw frames on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.memserver_status import query_status
from duvm.wire import auth
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import HANDSHAKE_FRAME, Decoder
from duvm.wire.pageencode import encode_bytes
from memserver_raw import raw_conn

PS = pp.PAGE_SIZE


def _keyring(*secrets: bytes) -> auth.Keyring:
    return auth.Keyring(tuple(secrets))


S1, S2 = os.urandom(32), os.urandom(32)


def _sec(*secrets: bytes, **kw) -> auth.PeerSecurity:
    return auth.PeerSecurity(_keyring(*secrets), **kw)


@pytest.fixture
async def secured():
    srv = MemServer(4 << 20, lease_s=60, lock=False, keyring=_keyring(S1))
    srv.addr = await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


# --- secret files ----------------------------------------------------------------------------


def test_secret_file_must_be_private(tmp_path: Path) -> None:
    p = tmp_path / "secret"
    p.write_text(S1.hex() + "\n")
    for mode in (0o640, 0o604, 0o660, 0o602):
        p.chmod(mode)
        with pytest.raises(auth.SecretError, match="group/other may access"):
            auth.load_secrets(p)
    p.chmod(0o600)
    assert auth.load_secrets(p) == [S1]
    p.chmod(0o400)
    assert auth.Keyring.from_file(p).current == S1


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("", "holds no secret"),
        ("# only a comment\n", "holds no secret"),
        ("zz" * 32, "not hex"),
        ("ab" * 16, "64 hex digits"),
        (f"{'ab' * 32}\n{'ab' * 32}\n", "twice"),
    ],
)
def test_bad_secret_files_are_refused_with_a_reason(tmp_path: Path, text: str, msg: str) -> None:
    p = tmp_path / "secret"
    p.write_text(text)
    p.chmod(0o600)
    with pytest.raises(auth.SecretError, match=msg):
        auth.load_secrets(p)


def test_secret_generate_refuses_a_path_in_a_missing_folder(tmp_path: Path) -> None:
    """Catches `duvm secret generate` creating folders from a mistyped path without a word
    (the secret would then sit where no config points)."""
    target = tmp_path / "no" / "such" / "cluster.secret"
    res = subprocess.run(
        [sys.executable, "-m", "duvm.cli", "secret", "generate", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"no directory {target.parent}: create it first" in res.stderr
    assert not (tmp_path / "no").exists()
    ok = tmp_path / "cluster.secret"
    res = subprocess.run(
        [sys.executable, "-m", "duvm.cli", "secret", "generate", str(ok)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert len(auth.load_secrets(ok)) == 1 and ok.stat().st_mode & 0o777 == 0o600


def test_keyring_repr_never_shows_a_secret() -> None:
    kr = _keyring(S1, S2)
    assert S1.hex() not in repr(kr) and S2.hex() not in repr(kr)
    assert auth.key_id(S1).hex() in repr(kr)


def test_memserver_refuses_a_readable_secret_file_and_open_network_without_auth(
    tmp_path: Path,
) -> None:
    p = tmp_path / "secret"
    p.write_text(S1.hex() + "\n")
    p.chmod(0o644)
    cmd = [sys.executable, "-m", "duvm.cli", "memserver", "--capacity", "1M", "--no-mlock"]
    r = subprocess.run(
        [*cmd, "--listen", "127.0.0.1:0", "--secret-file", str(p)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "chmod 600" in r.stderr and S1.hex() not in r.stderr
    r = subprocess.run([*cmd, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "without authentication" in r.stderr


# --- authentication --------------------------------------------------------------------------


async def test_authenticated_client_works_and_status_needs_auth(secured: MemServer) -> None:
    c = MemClient(*secured.addr, "node-a/1", security=_sec(S1))
    hello = await c.connect()
    assert hello.version == 2
    await c.reserve(4)
    await c.store([1], b"p" * PS)
    assert await c.load([1]) == b"p" * PS
    with pytest.raises(PageServerError) as ei:
        await query_status(*secured.addr)  # no secret: refused, not answered
    assert ei.value.code == pp.ErrorCode.AUTH
    st = await query_status(*secured.addr, security=_sec(S1))
    assert st["security"]["auth"] == "secret" and st["used_pages"] == 1
    await c.close()


async def test_wrong_secret_and_no_secret_are_refused_and_logged(
    secured: MemServer, caplog
) -> None:
    caplog.set_level(logging.INFO, "duvm")
    for sec, msg in ((_sec(S2), "unknown key id"), (None, "no secret offered")):
        c = MemClient(*secured.addr, "intruder", security=sec, retries=0)
        with pytest.raises(PageServerError) as ei:
            await c.connect()
        assert ei.value.code == pp.ErrorCode.AUTH and ei.value.errno == 13  # EACCES
        assert msg in caplog.text
        await c.close()
    assert secured.counters["auth_failures"] == 2
    assert "intruder" not in json.dumps(secured.store.status()["namespaces"])
    assert S1.hex() not in caplog.text and S2.hex() not in caplog.text


async def test_client_refuses_a_server_that_cannot_prove_the_secret() -> None:
    plain = MemServer(1 << 20, lease_s=60, lock=False)  # no secret: proves nothing
    addr = await plain.start()
    try:
        c = MemClient(*addr, "careful", security=_sec(S1), retries=0)
        with pytest.raises(PageServerError, match="cannot prove itself"):
            await c.connect()
        assert plain.store.namespaces == {}  # never joined: no page could have been sent
    finally:
        await plain.close()


async def _fake_server(handler) -> tuple[asyncio.base_events.Server, tuple[str, int]]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[:2]


async def test_client_refuses_an_impostor_with_a_forged_proof() -> None:
    async def impostor(reader, writer) -> None:
        dec = Decoder("server")
        dec.receive_data(await reader.read(4096))
        hello = dec.next_event()  # knows the key id (public) but not the secret
        writer.write(
            encode_bytes(
                pp.Challenge(hello.req_id, 2, True, os.urandom(32), hello.key_id, os.urandom(32))
            )
        )
        got = await reader.read(4096)
        writer.got = got
        writer.close()

    srv, addr = await _fake_server(impostor)
    try:
        c = MemClient(*addr, "careful", security=_sec(S1), retries=0)
        with pytest.raises(PageServerError, match="failed to prove"):
            await c.connect()
    finally:
        srv.close()


async def _raw_login(addr, client_id: str, secret: bytes | None, token: bytes):
    ask, w = await raw_conn(addr)
    kid = auth.key_id(secret) if secret else auth.NO_KEY
    hello = pp.Hello(1, client_id, nonce=os.urandom(32), key_id=kid, token=token)
    ch = await ask(hello)
    assert isinstance(ch, pp.Challenge)
    proof = (
        auth.proof(secret, "client", hello.nonce, ch.nonce, client_id, token)
        if secret
        else bytes(32)
    )
    return ask, w, await ask(pp.Auth(2, proof)), (hello, ch)


async def test_raw_frames_before_auth_are_refused(secured: MemServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "duvm.memserver")
    for early in (
        pp.make_store(1, [0], bytes(PS)),
        pp.make_load(1, [0]),
        pp.make_free(1, [0]),
        pp.Reserve(1, 5),
        pp.Release(1),
        pp.Auth(1, bytes(32)),
    ):
        ask, w = await raw_conn(secured.addr)
        assert await ask(early) is None  # closed without an answer
        w.close()
    # after HELLO but before a valid AUTH: still nothing
    ask, w = await raw_conn(secured.addr)
    hello = pp.Hello(1, "x", nonce=os.urandom(32), key_id=auth.key_id(S1), token=bytes(32))
    assert isinstance(await ask(hello), pp.Challenge)
    assert await ask(pp.make_load(2, [0])) is None
    w.close()
    # a STORE is cut off earlier still: its frame exceeds what an unauthenticated peer may send
    assert "STORE frame of 4112 payload bytes exceeds the limit" in caplog.text
    assert secured.counters["unauthenticated_requests"] == 5
    assert secured.store.namespaces == {}


async def test_a_replayed_proof_fails_on_a_new_connection(secured: MemServer) -> None:
    ask, w, welcome, (hello, ch) = await _raw_login(secured.addr, "n1", S1, b"t" * 32)
    assert isinstance(welcome, pp.HelloReply)
    w.close()
    proof = auth.proof(S1, "client", hello.nonce, ch.nonce, "n1", b"t" * 32)
    ask, w = await raw_conn(secured.addr)
    assert isinstance(await ask(hello), pp.Challenge)  # same HELLO, fresh server nonce
    reply = await ask(pp.Auth(2, proof))
    assert isinstance(reply, pp.ErrorReply) and reply.code == pp.ErrorCode.AUTH
    w.close()


async def test_a_recorded_server_proof_is_refused_by_a_client_with_a_fresh_nonce(
    secured: MemServer,
) -> None:
    """Catches a server proof that does not bind the client's nonce: an impostor that recorded
    one real CHALLENGE could then replay it to every later client and pass as the memserver."""
    ask, w = await raw_conn(secured.addr)
    hello, st = auth.start_handshake("n1", _sec(S1), b"t" * 32)
    recorded = await ask(hello)
    assert isinstance(recorded, pp.Challenge) and recorded.auth_required
    w.close()
    # the client that asked accepts it (the proof is genuine)...
    assert isinstance(auth.answer_challenge(recorded, st, _sec(S1), "real"), pp.Auth)
    # ...a new client, same id, token and secret but its own fresh nonce, refuses the replay
    _, fresh = auth.start_handshake("n1", _sec(S1), b"t" * 32)
    assert fresh.nonce != st.nonce
    with pytest.raises(auth.AuthError, match="failed to prove the cluster secret"):
        auth.answer_challenge(recorded, fresh, _sec(S1), "impostor")


async def test_rotation_old_and_new_secret_both_accepted_until_retired() -> None:
    srv = MemServer(1 << 20, lease_s=60, lock=False, keyring=_keyring(S1, S2))
    addr = await srv.start()
    try:
        for sec in (_sec(S1), _sec(S2, S1)):  # a node not yet promoted, one promoted
            c = MemClient(*addr, f"r-{sec.keyring.current_id.hex()}", security=sec, retries=0)
            await c.connect()
            await c.close()
        srv.set_keyring(_keyring(S2))  # retire S1 (what SIGHUP does after `secret retire`)
        c = MemClient(*addr, "late", security=_sec(S1), retries=0)
        with pytest.raises(PageServerError, match="AUTH"):
            await c.connect()
    finally:
        await srv.close()


# --- isolation -------------------------------------------------------------------------------


async def test_a_client_cannot_reach_another_clients_pages_whatever_ids_it_sends(
    secured: MemServer,
) -> None:
    victim = MemClient(*secured.addr, "victim/nbd0", security=_sec(S1))
    await victim.connect()
    await victim.reserve(8)
    keys = [0, 1, 7, 2**64 - 1]
    await victim.store(keys, b"".join(bytes([65 + i]) * PS for i in range(4)))
    # 1. the same client id with another token (even with the cluster secret): DENIED
    _, w, reply, _ = await _raw_login(secured.addr, "victim/nbd0", S1, os.urandom(32))
    assert isinstance(reply, pp.ErrorReply) and reply.code == pp.ErrorCode.DENIED
    w.close()
    # 2. its own namespace, the victim's page keys in every request
    ask, w, reply, _ = await _raw_login(secured.addr, "attacker", S1, os.urandom(32))
    assert isinstance(reply, pp.HelloReply) and reply.stored_pages == 0
    r = await ask(pp.make_load(3, keys))
    assert isinstance(r, pp.ErrorReply) and r.code == pp.ErrorCode.NOT_FOUND
    r = await ask(pp.make_free(4, keys))
    assert isinstance(r, pp.FreeReply) and r.freed == 0
    r = await ask(pp.make_store(5, [0], b"X" * PS))
    assert isinstance(r, pp.ErrorReply) and r.code == pp.ErrorCode.NO_SPACE  # no reservation
    assert isinstance(await ask(pp.Reserve(6, 4)), pp.ReserveReply)
    assert isinstance(await ask(pp.make_store(7, [0, 1], b"X" * 2 * PS)), pp.StoreReply)
    assert isinstance(await ask(pp.Release(8)), pp.ReleaseReply)
    w.close()
    # the victim's pages are untouched
    assert await victim.load(keys) == b"".join(bytes([65 + i]) * PS for i in range(4))
    assert len(secured.store.namespaces["victim/nbd0"].pages) == 4
    await victim.close()


async def test_isolation_holds_without_a_secret_too() -> None:
    srv = MemServer(1 << 20, lease_s=60, lock=False)
    addr = await srv.start()
    try:
        owner = MemClient(*addr, "mine")
        await owner.connect()
        await owner.reserve(1)
        await owner.store([5], b"m" * PS)
        other = MemClient(*addr, "mine", token=os.urandom(32), retries=0)  # another process
        with pytest.raises(PageServerError) as ei:
            await other.connect()
        assert ei.value.code == pp.ErrorCode.DENIED
        same = MemClient(*addr, "mine")  # this process, same id: the same default token
        await same.connect()
        assert await same.load([5]) == b"m" * PS
        await same.close()
        await owner.close()
    finally:
        await srv.close()


# --- TLS -------------------------------------------------------------------------------------


def _make_pki(d: Path) -> dict[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(cn: str, key, issuer, issuer_key, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    out: dict[str, str] = {}

    def save(label: str, key, crt) -> None:
        (d / f"{label}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (d / f"{label}.key").chmod(0o600)
        (d / f"{label}.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        out[label], out[label + "_key"] = str(d / f"{label}.pem"), str(d / f"{label}.key")

    for ca_label in ("ca", "rogue_ca"):
        k = ec.generate_private_key(ec.SECP256R1())
        save(ca_label, k, cert(ca_label, k, name(ca_label), k, True))
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), None)
    rogue_key = serialization.load_pem_private_key((d / "rogue_ca.key").read_bytes(), None)
    for label, issuer, ik in (
        ("server", "ca", ca_key),
        ("client", "ca", ca_key),
        ("rogue", "rogue_ca", rogue_key),
    ):
        k = ec.generate_private_key(ec.SECP256R1())
        save(label, k, cert(label, k, name(issuer), ik, False))
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return _make_pki(tmp_path_factory.mktemp("pki"))


async def test_mutual_tls_authenticates_without_a_secret(pki) -> None:
    srv = MemServer(
        1 << 20,
        lease_s=60,
        lock=False,
        tls=auth.server_tls_context(pki["server"], pki["server_key"], pki["ca"]),
    )
    addr = await srv.start()
    try:
        good = auth.PeerSecurity(
            None, auth.client_tls_context(pki["ca"], pki["client"], pki["client_key"])
        )
        c = MemClient(*addr, "tls-node", security=good)
        await c.connect()
        await c.reserve(2)
        await c.store([0], b"t" * PS)
        assert await c.load([0]) == b"t" * PS
        st = await query_status(*addr, security=good)
        assert st["security"] == {**st["security"], "auth": "tls", "tls": True}
        await c.close()
        bad = [
            auth.PeerSecurity(None, auth.client_tls_context(pki["ca"])),  # no client cert
            auth.PeerSecurity(
                None, auth.client_tls_context(pki["ca"], pki["rogue"], pki["rogue_key"])
            ),
            auth.PeerSecurity(
                None, auth.client_tls_context(pki["rogue_ca"], pki["client"], pki["client_key"])
            ),
        ]
        for sec in bad:
            c = MemClient(*addr, "tls-bad", security=sec, retries=0)
            with pytest.raises((MemserverUnreachable, PageServerError)):
                await c.connect()
            await c.close()
        plain = MemClient(*addr, "plain", retries=0, connect_timeout=2)  # no TLS at all
        with pytest.raises((MemserverUnreachable, PageServerError)):
            await plain.connect()
        await plain.close()
        assert set(srv.store.namespaces) <= {"tls-node"}
    finally:
        await srv.close()


async def test_tls_and_secret_together(pki) -> None:
    srv = MemServer(
        1 << 20,
        lease_s=60,
        lock=False,
        keyring=_keyring(S1),
        tls=auth.server_tls_context(pki["server"], pki["server_key"], None),
    )
    addr = await srv.start()
    try:
        tls = auth.client_tls_context(pki["ca"])
        c = MemClient(*addr, "both", security=auth.PeerSecurity(_keyring(S1), tls))
        await c.connect()
        await c.reserve(1)
        await c.store([3], b"b" * PS)
        assert await c.load([3]) == b"b" * PS
        await c.close()
        wrong = MemClient(*addr, "wrong", security=auth.PeerSecurity(_keyring(S2), tls), retries=0)
        with pytest.raises(PageServerError, match="AUTH"):
            await wrong.connect()
    finally:
        await srv.close()


# --- limits: floods and slow clients do not stop service -------------------------------------


async def test_flood_and_slowloris_do_not_stop_service(caplog) -> None:
    caplog.set_level(logging.WARNING, "duvm.memserver")
    srv = MemServer(
        1 << 20,
        lease_s=60,
        lock=False,
        keyring=_keyring(S1),
        max_handshakes=8,
        handshake_timeout=1.0,
    )
    addr = await srv.start()
    writers = []
    try:
        busy = MemClient(*addr, "busy", security=_sec(S1))
        await busy.connect()
        await busy.reserve(4)

        async def slowloris() -> None:
            _, w = await asyncio.open_connection(*addr)
            writers.append(w)
            wire = encode_bytes(
                pp.Hello(1, "slow", nonce=os.urandom(32), key_id=auth.key_id(S1), token=bytes(32))
            )
            for b in wire:  # one byte every 50 ms: never finishes within the timeout
                if w.is_closing():
                    return
                w.write(bytes([b]))
                await asyncio.sleep(0.05)

        for _ in range(100):  # a flood of idle connections
            _, w = await asyncio.open_connection(*addr)
            writers.append(w)
        slow = [asyncio.ensure_future(slowloris()) for _ in range(4)]
        # meanwhile the authenticated client is served, and a new client gets in
        for i in range(20):
            await busy.store([i % 4], bytes([i]) * PS)
            assert await busy.load([i % 4]) == bytes([i]) * PS
        late = MemClient(*addr, "late", security=_sec(S1))
        await asyncio.wait_for(late.connect(), 5)
        await late.close()
        assert len(srv.pending_connections()) <= srv.max_handshakes
        assert all(c.decoder._buf.__len__() <= HANDSHAKE_FRAME for c in srv.pending_connections())
        await asyncio.sleep(1.5)  # past the handshake timeout
        assert len(srv.pending_connections()) == 0
        assert srv.counters["handshakes_evicted"] >= 90
        assert srv.counters["handshake_timeouts"] >= 1
        for s in slow:
            s.cancel()
        assert await busy.load([0]) == bytes([16]) * PS
        await busy.close()
    finally:
        for w in writers:
            w.close()
        await srv.close()


async def test_connection_cap_and_idle_timeout() -> None:
    srv = MemServer(1 << 20, lease_s=60, lock=False, max_connections=2, idle_timeout=0.3)
    addr = await srv.start()
    try:
        a, b = MemClient(*addr, "a"), MemClient(*addr, "b")
        await a.connect()
        await b.connect()
        c = MemClient(*addr, "c", retries=0)
        with pytest.raises(PageServerError) as ei:
            await c.connect()
        assert ei.value.code == pp.ErrorCode.BUSY and "too many connections" in str(ei.value)
        # both idle: closed by the server, and the client sees it (waited for, not a fixed
        # 0.8 s: after a stall the sweep's close and the test's wake-up share a loop turn)
        deadline = time.monotonic() + 30
        while (srv.counters["idle_closed"] < 2 or a.connected) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert srv.counters["idle_closed"] >= 2
        assert not a.connected
        await a.reserve(1)  # the client reconnects on its own and finds its namespace
        await a.store([0], b"i" * PS)
        await a.close()
        await b.close()
        await c.close()
    finally:
        await srv.close()


# --- nothing secret in logs or status --------------------------------------------------------


async def test_no_secret_in_memserver_logs_or_status(tmp_path: Path) -> None:
    p = tmp_path / "secret"
    p.write_text(S1.hex() + "\n" + S2.hex() + "\n")
    p.chmod(0o600)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "duvm.cli",
        "memserver",
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "1M",
        "--no-mlock",
        "--secret-file",
        str(p),
        "-v",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        host, port = line.split(" listening on ")[1].split()[0].rsplit(":", 1)
        addr = (host, int(port))
        ok = MemClient(*addr, "ok", security=_sec(S1))
        await ok.connect()
        await ok.reserve(1)
        await ok.store([0], b"s" * PS)
        await ok.close()
        bad = MemClient(*addr, "bad", security=_sec(os.urandom(32)), retries=0)
        with pytest.raises(PageServerError):
            await bad.connect()
        status = json.dumps(await query_status(*addr, security=_sec(S2)))
        seen: list[bytes] = []
        proc.send_signal(signal.SIGHUP)  # re-read: logs the count, not the secrets

        async def until_reread() -> None:  # not a fixed delay: the SIGTERM could come first
            while (got := await proc.stderr.readline()) and b"re-read" not in got:
                seen.append(got)
            seen.append(got)

        with contextlib.suppress(asyncio.TimeoutError):  # then the assertions below say it
            await asyncio.wait_for(until_reread(), 30)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    logs = line + b"".join(seen).decode() + out.decode() + err.decode()
    assert "authentication failed" in logs and "re-read" in logs
    for s in (S1, S2):
        for text in (logs, status):
            assert s.hex() not in text and s.hex().upper() not in text
    assert "token" not in status and proc.returncode == 0
