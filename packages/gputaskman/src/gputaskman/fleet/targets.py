"""Which hosts a fleet polls: ``HOST[:PORT]`` as typed on the command line or listed in a
hosts file, read into `Target`s.

Forms: ``gpu1`` (port 9835, `serve`'s default), ``gpu1:9900``, ``10.0.0.7:9900``,
``[fd00::7]:9900`` (IPv6 in brackets), ``http://gpu1:9900`` and ``https://gpu1:9900`` (TLS; a
trailing ``/`` is allowed). A hosts file holds one such entry per line, optionally followed
by the name to show for it (``10.0.0.7:9835 gpu-node-07``); blank lines and ``#`` comments
are skipped. A host listed twice, or a name given twice, is an error, not a second row.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 9835  # gputaskman serve's default
PATH = "/snapshot.json"


class TargetError(ValueError):
    """A host entry that cannot be polled; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # as the user wrote it (without a scheme): the row's HOST
    host: str  # what to connect to (an IPv6 address without brackets)
    port: int
    tls: bool = False

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}{PATH}"


def parse_target(text: str) -> Target:
    """One host entry (see the module docstring); `TargetError` says why not."""
    raw = text.strip()
    rest, tls = raw, False
    for scheme, is_tls in (("https://", True), ("http://", False)):
        if rest.lower().startswith(scheme):
            rest, tls = rest[len(scheme) :], is_tls
            break
    rest = rest.rstrip("/")
    if not rest or any(c.isspace() or c in "/?#@" for c in rest):
        raise TargetError(f"not HOST[:PORT]: {text!r}")
    if rest.startswith("["):
        host, sep, tail = rest[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            raise TargetError(f"not [IPv6]:PORT: {text!r}")
        port_s = tail[1:] if tail else ""
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TargetError(f"not an IPv6 address in brackets: {text!r}") from None
    elif rest.count(":") > 1:
        raise TargetError(f"an IPv6 address needs brackets, [ADDR]:PORT: {text!r}")
    else:
        host, _, port_s = rest.partition(":")
    if not host:
        raise TargetError(f"no host in {text!r}")
    port = DEFAULT_PORT
    if port_s or rest.endswith(":"):
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise TargetError(f"port must be 1-65535: {text!r}")
        port = int(port_s)
    return Target(rest, host, port, tls)


def parse_targets(entries: Iterable[tuple[str, str]]) -> list[Target]:
    """(where, text) pairs -> targets; text is ``HOST[:PORT]``, optionally followed by a
    name. A host or name listed twice, or a bad entry, is an error naming where it was."""
    out: list[Target] = []
    seen: dict[tuple[str, int], str] = {}
    names: dict[str, str] = {}
    for where, text in entries:
        address, _, name = text.strip().partition(" ")
        name = name.strip()
        try:
            t = parse_target(address)
        except TargetError as exc:
            raise TargetError(f"{where}: {exc}") from None
        if name:
            if any(c.isspace() for c in name):
                raise TargetError(f"{where}: a name is one word: {name!r}")
            t = Target(name, t.host, t.port, t.tls)
        key = (t.host.lower(), t.port)
        if key in seen:
            raise TargetError(f"{where}: {t.address} is listed twice (also {seen[key]})")
        if t.name in names:
            raise TargetError(f"{where}: the name {t.name} is given twice (also {names[t.name]})")
        seen[key] = names[t.name] = where
        out.append(t)
    return out


def read_hosts_file(path: str | Path) -> list[tuple[str, str]]:
    """The entries of a hosts file as (``FILE:LINE``, text) pairs. Raises TargetError when
    the file cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TargetError(f"cannot read the hosts file {path}: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip()
        if entry:
            out.append((f"{path}:{n}", entry))
    return out
