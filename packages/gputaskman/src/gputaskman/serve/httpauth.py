"""What `gputaskman serve` asks of a client: the bearer token, and TLS with client certificates.

The token lives in a file of its own, readable by its owner only (mode 0600: a file that
group or others may read is refused, like ssh refuses such a key). Every request must carry
``Authorization: Bearer <token>``; the token is compared in constant time
(`hmac.compare_digest`). A refused request gets a bare 401 that says nothing about this
host: no metrics, no document, no software versions (`httpserve`). With TLS, a CA named by
``--tls-client-ca`` must have signed the client's certificate, or the handshake fails and no
request is read at all.
"""

from __future__ import annotations

import hmac
import os
import ssl
import stat
from pathlib import Path

MIN_TOKEN_CHARS = 16
MAKE_TOKEN = "umask 077; head -c 32 /dev/urandom | base64 > FILE"


class TokenError(Exception):
    """The token file (or a TLS file) cannot be used; the message says why and what to do."""


def read_token(path: Path) -> str:
    try:
        st = os.stat(path)
    except OSError as e:
        raise TokenError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise TokenError(f"{path} is not a regular file")
    if st.st_mode & 0o077:
        raise TokenError(
            f"{path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 {path}"
        )
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"cannot read the token file {path}: {e}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(
            f"{path} must hold one token of at least {MIN_TOKEN_CHARS} characters without "
            f"spaces; make one with: {MAKE_TOKEN}"
        )
    return token


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries `token` (compared in constant time)."""
    got = (header or "").encode("latin-1", "replace")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def server_tls_context(cert: Path, key: Path, client_ca: Path | None) -> ssl.SSLContext:
    """TLS for `serve`: its certificate; with `client_ca`, every client must present a
    certificate that CA signed, or the handshake fails before any HTTP is read."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca is not None:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise TokenError(f"cannot use the TLS files: {e}") from None
    return ctx
