"""The node's config file (`/etc/duvm/duvm.toml`, example: duvm.example.toml): one file for both
roles of a node, so the same file can be copied to every node of a cluster.

Theory of operation
-------------------
The file has two parts:

- top-level keys: the consumer side, read by `duvm enable` (and `duvm doctor`): ``peers``,
  ``size``, ``replicas``, ``priority``, ``method``, ``state_dir``, ``daemon_args``;
- a ``[node]`` table: the provider side, read by `duvm node`: ``listen``, ``capacity``,
  ``lease``, ``control_socket``, ``metrics``, ``memserver_args``;
- ``secret_file`` (top level) is the cluster secret both sides prove: the daemon gets it as
  ``--secret-file`` (it is folded into ``daemon_args``, which is also where `duvm doctor` looks
  for the daemon's security flags) and the memserver too.

Reading is strict, because a key silently ignored is a setting the operator believes in but
does not have: the file must be UTF-8 TOML, every key must be known, every value of the right
type (``true`` is not a number, ``1.5`` is not a priority, a string is not a list of flags).
Every problem is a `ControlError` whose message names the file and the key; the commands print
it as one line and exit non-zero.

Since every node may carry the same ``peers`` list, a node's own memserver (``[node] listen``)
would be among its peers; swapping into one's own RAM gains nothing, so `load_config` drops
that peer (same port, and the same address or a wildcard listen on a local address).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from duvm.base.units import parse_listen, parse_peer, parse_size
from duvm.node.attach import attach_state
from duvm.store.placement import default_replicas
from duvm.store.state_files import MAX_WORKERS

DEFAULT_STATE_DIR = Path("/run/duvm")
MEMSERVER_PORT = 7070
METHODS = ("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE)
# gputaskman's pool panel looks for /run/duvm/*.ctl; this is the memserver's
DEFAULT_NODE_CONTROL_SOCKET = DEFAULT_STATE_DIR / "memserver.ctl"

TOP_KEYS = (
    "peers",
    "size",
    "priority",
    "replicas",
    "method",
    "state_dir",
    "daemon_args",
    "secret_file",
    "workers",
    "node",
)
NODE_KEYS = ("listen", "capacity", "lease", "control_socket", "metrics", "memserver_args")


class ControlError(Exception):
    """A command cannot proceed; the message says why and what to do (one line)."""


@dataclass
class NodeConfig:
    """What `duvm node` needs: where this node's memserver listens and how much RAM it lends."""

    listen: str
    capacity: int
    lease: float | None = None  # None: the memserver's default
    secret_file: Path | None = None
    control_socket: Path = DEFAULT_NODE_CONTROL_SOCKET
    metrics: str | None = None
    memserver_args: list[str] = field(default_factory=list)

    def memserver_argv(self) -> list[str]:
        """The `duvm memserver` arguments this node runs with."""
        argv = [
            "--listen",
            self.listen,
            "--capacity",
            str(self.capacity),
            "--control-socket",
            str(self.control_socket),
        ]
        if self.lease is not None:
            argv += ["--lease", repr(float(self.lease))]
        if self.secret_file is not None:
            argv += ["--secret-file", str(self.secret_file)]
        if self.metrics:
            argv += ["--metrics", self.metrics]
        return argv + self.memserver_args


@dataclass
class Config:
    """What `duvm enable` needs: peers to reserve on and the device size."""

    peers: list[str]
    size: int
    priority: int = attach_state.DEFAULT_PRIORITY
    replicas: int | None = None  # None: 2 when there are at least 2 peers, else 1
    method: str = "auto"
    state_dir: Path = DEFAULT_STATE_DIR
    daemon_args: list[str] = field(default_factory=list)
    supervise: bool = True  # restart a crashed daemon (kernel nbd over netlink only)
    workers: int = 1  # daemon processes, one kernel nbd connection each (DECISIONS.md D49)
    secret_file: Path | None = None  # already folded into daemon_args (see with_secret)
    node: NodeConfig | None = None
    skipped_self: list[str] = field(default_factory=list)  # own memserver, dropped from peers

    @property
    def socket(self) -> str:
        return str(self.state_dir / "nbd.sock")

    def daemon_flags(self) -> list[str]:
        """The daemon's own flags: `daemon_args`, and `--workers` when there are several."""
        workers = ["--workers", str(self.workers)] if self.workers != 1 else []
        return [*workers, *self.daemon_args]

    def validate(self) -> Config:
        if not self.peers:
            why = (
                f" (left after skipping this node's own memserver {self.skipped_self})"
                if self.skipped_self
                else ""
            )
            raise ControlError(
                f"no peers{why}: give --peers HOST:PORT[,...] or peers = [...] in the config file"
            )
        for p in self.peers:
            try:
                parse_peer(p, MEMSERVER_PORT)
            except ValueError as exc:
                raise ControlError(f"bad peer address: {exc}") from exc
        if self.size < 1 << 20 or self.size % 4096:
            raise ControlError(f"size {self.size} must be at least 1 MiB and whole pages")
        if self.replicas is None:
            self.replicas = default_replicas(len(self.peers))
        if not 1 <= self.replicas <= len(self.peers):
            raise ControlError(
                f"replicas = {self.replicas} needs 1..{len(self.peers)} (at most one copy per peer)"
            )
        if not -1 <= self.priority <= 32767:
            raise ControlError(f"swap priority {self.priority} is outside -1..32767")
        if self.method not in METHODS:
            raise ControlError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if any(a == "--workers" or a.startswith("--workers=") for a in self.daemon_args):
            raise ControlError("daemon_args has --workers: use workers = N (--workers N)")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ControlError(f"workers = {self.workers} is outside 1..{MAX_WORKERS}")
        if self.workers > 1 and self.method == attach_state.METHOD_FUSE:
            raise ControlError(f"workers = {self.workers} needs kernel nbd (method = kernel-nbd)")
        return self


def with_secret(daemon_args: list[str], secret_file: Path | None) -> list[str]:
    """`daemon_args` with `--secret-file` in front when a cluster secret is configured.
    Refuses two secrets (the setting and a flag in daemon_args) rather than pick one."""
    if secret_file is None:
        return list(daemon_args)
    if any(a == "--secret-file" or a.startswith("--secret-file=") for a in daemon_args):
        raise ControlError("secret_file is set and daemon_args has --secret-file too: keep one")
    return ["--secret-file", str(secret_file), *daemon_args]


# --- reading the file ------------------------------------------------------------------------


def read_toml(path: Path) -> dict[str, Any]:
    """The file as a TOML table; unreadable, non-UTF-8 or invalid TOML is a ControlError."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ControlError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ControlError(
            f"config {path} cannot be read as text: not UTF-8 (byte "
            f"{exc.start}, line {line}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ControlError(f"config {path} is not valid TOML: {exc}") from None


class _Reader:
    """Typed access to one table; each wrong value names the file, the key and what it wants."""

    def __init__(self, path: Path, table: dict[str, Any], prefix: str, known: tuple[str, ...]):
        self.file, self.table, self.prefix = path, table, prefix
        unknown = sorted(set(table) - set(known))
        if unknown:
            where = f"[{prefix.rstrip('.')}] " if prefix else ""
            raise ControlError(
                f"config {path}: unknown {where}key(s) {unknown}; known: {sorted(known)}"
            )

    def fail(self, key: str, want: str) -> ControlError:
        got = self.table[key]
        shown = repr(got) if len(repr(got)) <= 60 else f"a {type(got).__name__}"
        return ControlError(f"config {self.file}: {self.prefix}{key} must be {want}, not {shown}")

    def has(self, key: str) -> bool:
        return key in self.table

    def integer(self, key: str, default: int) -> int:
        v = self.table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):  # TOML true is not a number
            raise self.fail(key, "a whole number")
        return v

    def number(self, key: str) -> float | None:
        v = self.table.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or v == float("inf"):
            raise self.fail(key, "a positive number of seconds")
        return float(v)

    def text(self, key: str, default: str | None = None) -> str | None:
        v = self.table.get(key, default)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise self.fail(key, "a non-empty string")
        return v

    def path(self, key: str, default: Path | None = None) -> Path | None:
        v = self.text(key)
        if v is None:
            return default
        if "\0" in v:
            raise self.fail(key, "a path")
        return Path(v)

    def size(self, key: str, example: str) -> int:
        if key not in self.table:
            raise ControlError(
                f'config {self.file}: {self.prefix}{key} is missing (e.g. {key} = "{example}")'
            )
        v = self.table[key]
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise self.fail(key, f'a size such as "{example}"')
        try:
            return parse_size(str(v))
        except ValueError as exc:
            raise ControlError(f"config {self.file}: {self.prefix}{key}: {exc}") from None

    def strings(self, key: str, *, comma: bool = False) -> list[str]:
        v = self.table.get(key, [])
        if comma and isinstance(v, str):  # peers = "a:1,b:2", as on the command line
            v = v.split(",")
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail(key, "a list of strings")
        if any("\0" in x for x in v):
            raise self.fail(key, "strings without NUL")
        return [x.strip() for x in v if x.strip()] if comma else list(v)


def _node_from(path: Path, raw: dict[str, Any], secret_file: Path | None) -> NodeConfig | None:
    table = raw.get("node")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ControlError(f"config {path}: node must be a table ([node]), not a value")
    r = _Reader(path, table, "node.", NODE_KEYS)
    listen = r.text("listen")
    if listen is None:
        raise ControlError(
            f"config {path}: node.listen is missing (e.g. listen = "
            '"10.0.0.2:7070", this node\'s address on the cluster network)'
        )
    try:
        parse_listen(listen)
    except ValueError as exc:
        raise ControlError(f"config {path}: node.listen: {exc}") from None
    capacity = r.size("capacity", "4G")
    if capacity < 4096:
        raise ControlError(f"config {path}: node.capacity must be at least one page (4096)")
    metrics = r.text("metrics")
    if metrics is not None:
        try:
            parse_listen(metrics)
        except ValueError as exc:
            raise ControlError(f"config {path}: node.metrics: {exc}") from None
    return NodeConfig(
        listen=listen,
        capacity=capacity,
        lease=r.number("lease"),
        secret_file=secret_file,
        control_socket=r.path("control_socket", DEFAULT_NODE_CONTROL_SOCKET)
        or DEFAULT_NODE_CONTROL_SOCKET,
        metrics=metrics,
        memserver_args=r.strings("memserver_args"),
    )


def _top(path: Path) -> tuple[dict[str, Any], _Reader, Path | None, NodeConfig | None]:
    raw = read_toml(path)
    r = _Reader(path, raw, "", TOP_KEYS)
    secret = r.path("secret_file")
    return raw, r, secret, _node_from(path, raw, secret)


def load_config(path: Path) -> Config:
    """The consumer side (`duvm enable`) of a config file; the [node] table is checked too.
    Every problem is a one-line ControlError naming the file and the key."""
    _, r, secret, node = _top(path)
    if not r.has("size"):
        raise ControlError(f'config {path}: size is missing (e.g. size = "4G")')
    peers = r.strings("peers", comma=True)
    for p in peers:
        try:
            parse_peer(p, MEMSERVER_PORT)
        except ValueError as exc:
            raise ControlError(f"config {path}: bad peer address: {exc}") from None
    own = [p for p in peers if node is not None and is_own_memserver(p, node.listen)]
    try:
        daemon_args = with_secret(r.strings("daemon_args"), secret)
    except ControlError as exc:
        raise ControlError(f"config {path}: {exc}") from None
    cfg = Config(
        peers=[p for p in peers if p not in own],
        size=r.size("size", "4G"),
        priority=r.integer("priority", attach_state.DEFAULT_PRIORITY),
        replicas=r.integer("replicas", 0) if "replicas" in r.table else None,
        method=r.text("method", "auto") or "auto",
        state_dir=r.path("state_dir", DEFAULT_STATE_DIR) or DEFAULT_STATE_DIR,
        daemon_args=daemon_args,
        secret_file=secret,
        node=node,
        skipped_self=own,
        workers=r.integer("workers", 1),
    )
    try:
        return cfg.validate()
    except ControlError as exc:
        raise ControlError(f"config {path}: {exc}") from None


def load_node_config(path: Path) -> NodeConfig:
    """The provider side (`duvm node`): the [node] table and the cluster secret. The consumer
    keys are checked for type errors too, so a broken file is caught on every node."""
    _, r, _, node = _top(path)
    r.strings("peers", comma=True)  # type checks only: enable reads these
    r.strings("daemon_args")
    if node is None:
        raise ControlError(
            f"config {path}: no [node] table: add [node] with listen = "
            '"HOST:PORT" and capacity = "SIZE" (see duvm.example.toml)'
        )
    return node


# --- addresses -------------------------------------------------------------------------------


def _is_local_ip(ip: str) -> bool:
    """True when `ip` is an address of this machine (binding to it succeeds)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if addr.is_loopback:
        return True
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        return True
    return False


def is_own_memserver(peer: str, listen: str) -> bool:
    """Whether `peer` reaches the memserver this node runs on `listen` (no DNS lookups)."""
    try:
        phost, pport, _ = parse_peer(peer, MEMSERVER_PORT)
        lhost, lport = parse_listen(listen)
    except ValueError:
        return False
    if pport != lport:
        return False
    if phost == lhost:
        return True
    if lhost in ("0.0.0.0", "::", ""):  # a wildcard listen serves every local address
        name = phost in ("localhost", socket.gethostname())
        return name or _is_local_ip(phost)
    return False
