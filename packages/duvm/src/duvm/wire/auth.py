"""Peer authentication for the page protocol: cluster secrets, HMAC proofs, TLS contexts.

Theory of operation:

- A cluster secret is 32 random bytes, written as 64 hex digits on one line of a secret file
  that only its owner may read (`load_secrets` refuses a file with any group/other permission
  bit, so a secret never sits readable by other users). A file may hold several secrets, one a
  line: the first is the one this node proves itself with, all of them are accepted from
  peers. That is how a secret is rotated without stopping the pool (see `duvm secret`).
- A secret is named on the wire only by its key id, the first 8 bytes of
  SHA-256("duvm key id" + secret): the server picks the secret the client says it uses, so
  during a rotation old and new secrets both work, and the id reveals nothing usable.
- The handshake (docs/protocol.md) is a mutual HMAC-SHA256 challenge-response. Each side sends
  a fresh 32-byte nonce; each proof is HMAC(secret, label | nonce_c | nonce_s | client id |
  namespace token digest) with a different label per role, so a proof can neither be replayed
  on another connection (fresh nonces), reflected back (role labels) nor moved to another
  namespace (the id and token are bound). The server proves itself first, before the client
  sends anything that depends on the secret, and the client checks it before any page moves.
- TLS is optional (`ssl` module, TLS 1.2+): it encrypts the whole stream and, with a cluster
  CA, authenticates both ends by certificate (mutual TLS) as an alternative to the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECRET_BYTES = 32
NONCE_BYTES = 32
KEY_ID_BYTES = 8
PROOF_BYTES = 32
TOKEN_BYTES = 32
NO_KEY = bytes(KEY_ID_BYTES)  # key id of "no secret"
_LABELS = {"server": b"duvm-auth-v2 server\0", "client": b"duvm-auth-v2 client\0"}


class SecretError(Exception):
    """The secret file is missing, unsafe or malformed (message says which, never the secret)."""


def key_id(secret: bytes) -> bytes:
    """The public name of a secret: 8 bytes of a hash that cannot be turned back into it."""
    return hashlib.sha256(b"duvm key id\0" + secret).digest()[:KEY_ID_BYTES]


def token_digest(token: bytes) -> bytes:
    return hashlib.sha256(b"duvm namespace token\0" + token).digest()


def proof(
    secret: bytes, role: str, nonce_c: bytes, nonce_s: bytes, client_id: str, token: bytes
) -> bytes:
    """HMAC-SHA256 proof of `role` ("server" or "client") over both nonces, id and token."""
    cid = client_id.encode("utf-8")
    msg = b"".join(
        (_LABELS[role], nonce_c, nonce_s, len(cid).to_bytes(2, "little"), cid, token_digest(token))
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison (a timing difference must not reveal how much matched)."""
    return hmac.compare_digest(expected, got)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_secret_line() -> str:
    return secrets.token_hex(SECRET_BYTES)


def check_private(path: Path) -> os.stat_result:
    """Refuse a secret file that is not a regular file or that others could read or write."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise SecretError(f"cannot read secret file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"secret file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise SecretError(
            f"secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group/other may access "
            f"it; run `chmod 600 {path}` (the owner alone may read a cluster secret)"
        )
    if st.st_uid not in (0, os.geteuid()):
        raise SecretError(f"secret file {path} is owned by uid {st.st_uid}, not root or this user")
    return st


def parse_secrets(text: str, where: str = "secret file") -> list[bytes]:
    """Secrets from the file format: 64 hex digits a line; blank lines and # comments skipped."""
    out: list[bytes] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            raw = bytes.fromhex(line)
        except ValueError:
            raise SecretError(f"{where} line {n}: not hexadecimal") from None
        if len(raw) != SECRET_BYTES:
            raise SecretError(
                f"{where} line {n}: a secret is {SECRET_BYTES * 2} hex digits, this has {len(line)}"
            )
        out.append(raw)
    if not out:
        raise SecretError(f"{where} holds no secret")
    if len(set(out)) != len(out):
        raise SecretError(f"{where} lists a secret twice")
    return out


def load_secrets(path: str | os.PathLike[str]) -> list[bytes]:
    """The secrets of a private secret file, current one first (SecretError otherwise)."""
    p = Path(path)
    check_private(p)
    try:
        text = p.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(
            f"cannot read secret file {p}: {getattr(e, 'strerror', None) or e}"
        ) from None
    return parse_secrets(text, f"secret file {p}")


@dataclass(frozen=True)
class Keyring:
    """The secrets a node holds: `current` proves this node, all are accepted from peers."""

    secrets: tuple[bytes, ...]
    path: str | None = None
    _by_id: dict[bytes, bytes] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("a keyring needs at least one secret")
        self._by_id.update((key_id(s), s) for s in self.secrets)

    def __repr__(self) -> str:  # never the secrets themselves
        ids = ",".join(key_id(s).hex() for s in self.secrets)
        return f"Keyring(key_ids=[{ids}], path={self.path!r})"

    @property
    def current(self) -> bytes:
        return self.secrets[0]

    @property
    def current_id(self) -> bytes:
        return key_id(self.secrets[0])

    def lookup(self, kid: bytes) -> bytes | None:
        return self._by_id.get(bytes(kid))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keyring:
        return cls(tuple(load_secrets(path)), str(path))


def server_tls_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """TLS for a memserver: its certificate; with `ca`, clients must present one it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls_context(
    ca: str | None, cert: str | None = None, key: str | None = None, *, check_hostname: bool = True
) -> ssl.SSLContext:
    """TLS for a client: verify the memserver against `ca` (system CAs when None) and its
    name or IP; present `cert` when the server asks for mutual TLS."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = check_hostname
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


@dataclass(frozen=True)
class PeerSecurity:
    """How a client authenticates to memservers: a keyring and/or TLS. `require_server_auth`
    refuses a memserver that proves nothing (no secret proof and no verified certificate)."""

    keyring: Keyring | None = None
    tls: ssl.SSLContext | None = None
    require_server_auth: bool = True

    @property
    def server_verified_by_tls(self) -> bool:
        return self.tls is not None and self.tls.verify_mode == ssl.CERT_REQUIRED


class AuthError(Exception):
    """The memserver failed to prove itself, or cannot be authenticated with this setup."""


@dataclass(frozen=True)
class _ClientState:
    client_id: str
    token: bytes
    nonce: bytes


def start_handshake(
    client_id: str, security: PeerSecurity | None, token: bytes
) -> tuple[Any, _ClientState]:
    """The HELLO a client opens with, and what it must remember to check the CHALLENGE."""
    from duvm.wire import pageproto as pp

    nonce = new_nonce()
    kr = security.keyring if security else None
    kid = kr.current_id if kr else NO_KEY
    return pp.Hello(0, client_id, nonce=nonce, key_id=kid, token=token), _ClientState(
        client_id, token, nonce
    )


def answer_challenge(ch: Any, st: _ClientState, security: PeerSecurity | None, peer: str) -> Any:
    """Check the server's proof and return the AUTH to send; AuthError when the server proves
    nothing we can check (and we require it) or proves it wrongly."""
    from duvm.wire import pageproto as pp

    kr = security.keyring if security else None
    if ch.auth_required and kr is None:
        raise AuthError(
            f"memserver {peer} requires authentication: give this node the cluster "
            "secret (--secret-file)"
        )
    if kr is None:
        if (
            security is not None
            and security.require_server_auth
            and not security.server_verified_by_tls
        ):
            raise AuthError(
                f"memserver {peer} is not authenticated (no secret, no verified "
                "certificate); refusing to send it pages"
            )
        return pp.Auth(0, bytes(PROOF_BYTES))
    if not ch.auth_required:
        if security.require_server_auth and not security.server_verified_by_tls:
            raise AuthError(
                f"memserver {peer} has no cluster secret: it cannot prove itself; "
                "refusing to send it pages"
            )
        return pp.Auth(0, bytes(PROOF_BYTES))
    secret = kr.lookup(ch.key_id)
    if secret is None or not verify(
        proof(secret, "server", st.nonce, ch.nonce, st.client_id, st.token), ch.proof
    ):
        raise AuthError(
            f"memserver {peer} failed to prove the cluster secret (wrong secret or "
            "an impostor); refusing it"
        )
    return pp.Auth(0, proof(secret, "client", st.nonce, ch.nonce, st.client_id, st.token))


# Namespace tokens: a client's namespace on a memserver belongs to the token that created it.
# The default token is keyed by a random per-process key, so every client object of this
# process that names the same namespace gets it (a reconnect, a Pool reopened), and no other
# process or node can, whatever client id it sends. A caller that must resume a namespace from
# another process (a restarted program) passes its own persistent token.
_PROCESS_TOKEN_KEY = secrets.token_bytes(TOKEN_BYTES)


def default_token(client_id: str) -> bytes:
    return hmac.new(_PROCESS_TOKEN_KEY, client_id.encode("utf-8"), hashlib.sha256).digest()
