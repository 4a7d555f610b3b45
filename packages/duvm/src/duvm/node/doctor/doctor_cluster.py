"""`duvm doctor`'s checks of the cluster side: the cluster secret file (root-owned, no
group/other access, lines that are secrets), how the daemon will authenticate to its peers
(decided by the daemon's own rule over the security flags in the config's ``daemon_args``), and
each peer: a TCP connect with a timeout, then a page-protocol STATUS under that same
authentication."""

from __future__ import annotations

import argparse
import asyncio
import socket
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from duvm.base.units import parse_peer
from duvm.node.doctor.doctor_check import FAIL, OK, SKIP, WARN, Check, Options, verdict
from duvm.node.lifecycle import control
from duvm.store import client_flags
from duvm.wire import auth


def _tcp(host: str, port: int, timeout: float) -> str | None:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def daemon_security(opts: Options) -> argparse.Namespace:
    """The daemon's security flags as its own parser reads them (other flags ignored);
    doctor's --secret-file, when given, stands in for the daemon's."""
    parser = argparse.ArgumentParser(add_help=False)
    client_flags.add_client_arguments(parser)
    ns, _ = parser.parse_known_args(opts.daemon_args)
    if opts.secret_file is not None:
        ns.secret_file = str(opts.secret_file)
    return ns


def check_peer_auth(opts: Options) -> tuple[auth.PeerSecurity | None, Check]:
    """How the daemon will authenticate to the peers, by the daemon's own rule (memservers
    off loopback need a secret or TLS unless --insecure). Returns the security doctor then
    uses for its STATUS requests, so an authenticating memserver answers it."""
    if not opts.peers:
        return None, Check("peer-auth", SKIP, True, "no peers given")
    try:
        addrs = [parse_peer(p, control.MEMSERVER_PORT)[:2] for p in opts.peers]
        ns = daemon_security(opts)
        security = client_flags.client_security_from_args(ns, addrs)
    except (ValueError, OSError, auth.SecretError) as exc:
        return None, Check("peer-auth", FAIL, True, str(exc), _AUTH_FIX)
    if security is None:
        how = (
            "--insecure: pages go to unauthenticated peers"
            if ns.insecure and not client_flags.all_loopback(addrs)
            else "all peers on loopback, no authentication needed"
        )
        return None, Check(
            "peer-auth", WARN if ns.insecure else OK, False, how, _AUTH_FIX if ns.insecure else None
        )
    how = [f"secret file {ns.secret_file}"] if security.keyring else []
    how += ["TLS"] if security.tls else []
    return security, Check("peer-auth", OK, True, " + ".join(how))


_AUTH_FIX = (
    "duvm secret generate /etc/duvm/cluster.secret on one node, copy it (mode 0600, "
    'root) to every node, give memservers --secret-file and add "--secret-file", '
    '"/etc/duvm/cluster.secret" to daemon_args in duvm.toml'
)


async def _statuses(
    addrs: dict[str, tuple[str, int]], timeout: float, security: auth.PeerSecurity | None
) -> dict[str, dict[str, Any] | str]:
    from duvm.store.memserver_status import query_status  # the page protocol is only needed here

    async def one(host: str, port: int) -> dict[str, Any] | str:
        try:
            return await query_status(host, port, timeout=timeout, security=security)
        except Exception as exc:  # unreachable, refused auth, or not a memserver at all
            return str(exc)

    got = await asyncio.gather(*(one(h, p) for h, p in addrs.values()))
    return dict(zip(addrs, got, strict=True))


def check_peers(
    peers: list[str], timeout: float, security: auth.PeerSecurity | None = None
) -> Check:
    if not peers:
        return Check("peers", SKIP, True, "no peers given (--peers or --config)")
    problems, good, addrs = [], [], {}
    for p in peers:
        try:
            addrs[p] = parse_peer(p, control.MEMSERVER_PORT)[:2]
        except ValueError as exc:
            problems.append(f"{p}: {exc}")
    # Connect to all peers at once, so N dead peers cost one timeout, not N.
    with ThreadPoolExecutor(max_workers=min(16, len(addrs) or 1)) as pool:
        errors = dict(
            zip(addrs, pool.map(lambda hp: _tcp(*hp, timeout), addrs.values()), strict=True)
        )
    problems += [f"{p}: {err}" for p, err in errors.items() if err]
    reachable = {p: addrs[p] for p, err in errors.items() if not err}
    fix = (
        "on each failing peer run `duvm memserver --listen HOST:PORT --capacity SIZE` (or "
        "its systemd unit duvm-node.service) and open that TCP port"
    )
    for peer, st in asyncio.run(_statuses(reachable, timeout, security)).items():
        if isinstance(st, str):
            problems.append(f"{peer}: port open but no duvm memserver STATUS ({st})")
            if "authentication required" in st and security is None:
                fix = "the peers require authentication: " + _AUTH_FIX
            elif "has no cluster secret" in st:  # it runs; it cannot prove the secret
                fix = (
                    f"the memserver at {peer} runs without the cluster secret: restart it with "
                    "--secret-file and this node's secret file (duvm node: secret_file in "
                    "duvm.toml)"
                )
            continue

        def mib(pages: object) -> str:
            return f"{pages * 4096 >> 20} MiB" if isinstance(pages, int) else "n/a"

        good.append(
            f"{peer} (capacity {mib(st.get('capacity_pages'))}, reserved "
            f"{mib(st.get('reserved_pages'))})"
        )
    detail = "; ".join([*problems, f"ok: {', '.join(good)}"] if good else problems)
    return verdict("peers", bool(problems), True, detail, fix)


def check_secret(path: Path | None) -> Check:
    if path is None:
        return Check("secret-file", SKIP, True, "no cluster secret configured")
    fix = f"chown root:root {path} && chmod 0600 {path}"
    try:
        st = path.lstat()
    except OSError as exc:
        return Check(
            "secret-file",
            FAIL,
            True,
            f"{path}: {exc.strerror or exc}",
            f"duvm secret generate {path} (on one node; copy it to the others)",
        )
    problems = []
    if not stat.S_ISREG(st.st_mode):
        problems.append("not a regular file" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else ""))
    if st.st_uid != 0:
        problems.append(f"owned by uid {st.st_uid}, not root")
    if st.st_mode & 0o077:
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o} lets others read or write it")
    if not problems:  # safe to read: are the lines secrets (`duvm secret generate`)?
        try:
            n = len(auth.load_secrets(path))
        except auth.SecretError as exc:
            problems.append(str(exc))
            fix = f"duvm secret generate {path} (or fix the line it names)"
    return verdict(
        "secret-file",
        bool(problems),
        True,
        f"{path}: "
        + (
            "; ".join(problems)
            if problems
            else f"{n} secret(s), root-owned, mode {stat.S_IMODE(st.st_mode):04o}"
        ),
        fix,
    )


def secret_path(opts: Options) -> Path | None:
    """--secret-file, else the daemon's --secret-file from daemon_args."""
    found = daemon_security(opts).secret_file
    return Path(found) if found else None
