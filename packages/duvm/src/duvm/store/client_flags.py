"""The command-line flags of a memserver client's security (`--secret-file`, `--tls-*`,
`--encrypt`, `--insecure`) and the daemon's rule that turns them into the memory client's
`auth.PeerSecurity` and its choice to encrypt pages.

The daemon takes these flags; `duvm enable`/`status` and `duvm doctor` parse the daemon's
flags with the same parser and rule, so they predict what it will do. Those commands cannot
import each other (the daemon is a process of its own), so the flags live here, beside the
memory client they configure; the protocol's authentication itself is `duvm.wire.auth`.
"""

from __future__ import annotations

import argparse

from duvm.base.units import is_loopback
from duvm.wire import auth


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--secret-file, --tls-ca/--tls-cert/--tls-key, --encrypt/--no-encrypt, --insecure."""
    sec = parser.add_argument_group("security (see README: Security)")
    sec.add_argument(
        "--secret-file",
        metavar="PATH",
        help="cluster secret file (mode 0600, `duvm secret generate`); its first "
        "secret proves this node, memservers must prove one of its secrets",
    )
    sec.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="connect to memservers over TLS, verifying them against this CA",
    )
    sec.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    sec.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    sec.add_argument(
        "--encrypt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="seal pages with AES-GCM before they leave this node (default: on "
        "when any memserver is not on loopback)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow memservers off loopback with no secret and no TLS",
    )


def all_loopback(peers: list[tuple[str, int]]) -> bool:
    """Whether every memserver is on this machine's loopback."""
    return all(is_loopback(h) for h, _ in peers)


def client_security_from_args(
    args: argparse.Namespace, peers: list[tuple[str, int]]
) -> auth.PeerSecurity | None:
    """PeerSecurity from the daemon's flags. ValueError/SecretError/OSError with a reason;
    refuses memservers off loopback without a secret or TLS unless --insecure."""
    keyring = auth.Keyring.from_file(args.secret_file) if args.secret_file else None
    if (args.tls_cert or args.tls_key) and not (args.tls_cert and args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        raise ValueError("--tls-cert needs --tls-ca (the CA that signed the memservers)")
    tls = auth.client_tls_context(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    if keyring is None and tls is None:
        if peers and not all_loopback(peers) and not args.insecure:
            raise ValueError(
                "memservers off loopback need --secret-file or --tls-ca "
                "(or --insecure to send pages to unauthenticated peers)"
            )
        return None
    return auth.PeerSecurity(keyring, tls, require_server_auth=True)


def encryption_wanted(args: argparse.Namespace, peers: list[tuple[str, int]]) -> bool:
    """--encrypt/--no-encrypt, else on exactly when a memserver is not on loopback."""
    return args.encrypt if args.encrypt is not None else not all_loopback(peers)
