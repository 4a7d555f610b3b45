"""`duvm secret`: create, inspect and rotate the cluster secret file.

Theory of operation: a secret file holds one or more 256-bit secrets, one per line as hex; the
first authenticates this node, all are accepted from peers (duvm.wire.auth). Files are written to a
temporary file created with mode 0600 in the same directory and renamed over the old one, so a
reader never sees a half-written or briefly world-readable file. Nothing here prints a secret:
`show` prints key ids (a one-way hash) so operators can compare nodes.

Rotation without stopping the pool (memservers and daemons re-read the file on SIGHUP):

1. `duvm secret add PATH` on one node, copy the file to every node, SIGHUP everyone: all
   accept the old and the new secret, all still prove the old one.
2. `duvm secret promote PATH`, copy, SIGHUP: every node proves the new one, accepts both.
3. `duvm secret retire PATH`, copy, SIGHUP: the old secret is no longer accepted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from duvm.wire import auth

_HEADER = "# duvm cluster secret: keep mode 0600; first line proves this node, all accepted\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("generate", "write a new secret file (refuses to overwrite one)"),
        ("add", "append a new secret (accepted everywhere, not yet used to prove)"),
        ("promote", "make the newest secret the one this node proves itself with"),
        ("retire", "keep only the first secret (the others stop being accepted)"),
        ("show", "print the key ids (never the secrets) and check the file's mode"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("path", metavar="PATH", help="secret file, e.g. /etc/duvm/secret")


def _write(path: Path, secrets: list[str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(_HEADER + "".join(s + "\n" for s in secrets))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _lines(path: Path) -> list[str]:
    return [s.hex() for s in auth.load_secrets(path)]


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    try:
        if args.action == "generate":
            if path.exists():
                raise auth.SecretError(f"{path} exists; use `duvm secret add` to rotate")
            if not path.parent.is_dir():  # a typo in the path must not create folders
                raise auth.SecretError(
                    f"no directory {path.parent}: create it first (mkdir -m 0700 "
                    f"{path.parent}) or give another path"
                )
            _write(path, [auth.new_secret_line()])
        elif args.action == "add":
            _write(path, [*_lines(path), auth.new_secret_line()])
        elif args.action == "promote":
            lines = _lines(path)
            if len(lines) < 2:
                raise auth.SecretError(f"{path} holds one secret: `duvm secret add` first")
            _write(path, [lines[-1], *lines[:-1]])
        elif args.action == "retire":
            _write(path, _lines(path)[:1])
        kr = auth.Keyring.from_file(path)
    except (auth.SecretError, OSError) as e:
        print(f"duvm secret: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 1
    print(f"{path}: {len(kr.secrets)} secret(s), mode 0600")
    for i, s in enumerate(kr.secrets):
        role = "proves this node, accepted" if i == 0 else "accepted"
        print(f"  key id {auth.key_id(s).hex()}  {role}")
    return 0
