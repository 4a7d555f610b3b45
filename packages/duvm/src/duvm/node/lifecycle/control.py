"""Enable, disable and inspect duvm on this node: daemon process + attach layer, as one unit.

Theory of operation
-------------------
``enable`` starts the daemon (the NBD server whose blocks live on memservers) as a detached
child in its own session, records it in ``STATE_DIR/daemon.json``, waits for its Unix socket,
then hands over to :mod:`duvm.node.attach.attach`, which attaches the export as a block device and
activates swap (``STATE_DIR/state.json``). The daemon reserves capacity on the peers before it
opens its socket, so the device the kernel sees only has slots that have somewhere to go.

``disable`` is the reverse, and it is safe: :func:`duvm.node.attach.attach.detach` turns swap off
first; if the kernel cannot bring the pages home, the device stays attached, the daemon keeps
running and the command explains. Only after a clean detach is the daemon stopped (SIGTERM), which
ends its memserver sessions and so releases the reservations.

``status`` reads the two state files, ``/proc/swaps``, each peer's STATUS, the daemon's control
socket and, when `duvm node` runs here, the node's control socket (what this node lends). What
cannot be known (a peer that does not answer, a daemon without a status socket) is None, never 0.

The config file (`duvm.node.lifecycle.config`) is shared by enable (top-level keys) and `duvm node`
([node]).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from duvm.base import control_socket, pressure, ramfs
from duvm.base.units import parse_peer
from duvm.node.attach import attach, attach_state, kernel_swap, processes, systools
from duvm.node.lifecycle import supervisor_process

# The config file lives in duvm.node.lifecycle.config; its names are re-exported for the commands
from duvm.node.lifecycle.config import (
    DEFAULT_NODE_CONTROL_SOCKET,
    DEFAULT_STATE_DIR,
    MEMSERVER_PORT,
    Config,
    ControlError,
)
from duvm.node.lifecycle.config import NodeConfig as NodeConfig
from duvm.node.lifecycle.config import load_config as load_config
from duvm.node.lifecycle.config import load_node_config as load_node_config
from duvm.store import client_flags
from duvm.wire import auth

# --- daemon process --------------------------------------------------------------------------

DAEMON_STATE_SUBDIR = "daemon-state"


def daemon_state_dir(state_dir: Path) -> Path:
    """Where `duvm enable` has the daemon keep its state (`duvm.store.daemon_state`): a ramfs of its
    own (`duvm.base.ramfs`), so that nothing a restarted daemon must read can be swapped out."""
    return state_dir.resolve() / DAEMON_STATE_SUBDIR


@dataclass
class DaemonInfo:
    pid: int
    socket: str
    peers: list[str]
    size: int
    replicas: int
    log: str
    started: float
    client_id: str | None = None
    # the daemon's extra flags: `duvm status` authenticates to the peers with its security flags
    daemon_args: list[str] = field(default_factory=list)
    # its start time (processes.start_time): with the pid, names this daemon; None in old records
    start: int | None = None


def state_path(state_dir: Path) -> Path:
    return state_dir / "state.json"


def daemon_path(state_dir: Path) -> Path:
    return state_dir / "daemon.json"


def load_daemon(state_dir: Path) -> DaemonInfo | None:
    try:
        return DaemonInfo(**json.loads(daemon_path(state_dir).read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise ControlError(
            f"{daemon_path(state_dir)} is unreadable ({exc}); inspect it by hand"
        ) from exc


def client_id(cfg: Config) -> str:
    """This node's namespace on the memservers: host and state directory, stable across runs."""
    return f"{socket.gethostname()}:{cfg.state_dir.resolve()}"


def daemon_command(cfg: Config) -> list[str]:
    """The `duvm daemon` command line for `cfg` (the daemon's own flags live in daemon.py)."""
    cmd = [
        sys.executable,
        "-m",
        "duvm.cli",
        "daemon",
        "--socket",
        cfg.socket,
        "--peers",
        ",".join(cfg.peers),
        "--size",
        str(cfg.size),
        "--client-id",
        client_id(cfg),
    ]
    # Always explicit: the daemon's own default (2 with 2+ peers) must not override the config.
    cmd += ["--replicas", str(cfg.replicas)]
    return cmd + cfg.daemon_flags()


def daemon_alive(info: DaemonInfo | None) -> bool:
    return info is not None and processes.duvm_runs(info.pid, "daemon", info.start)


def start_daemon(cfg: Config, timeout: float = 60.0) -> DaemonInfo:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cfg.socket)  # a stale socket from a crashed daemon would look ready
    log = cfg.state_dir / "daemon.log"
    log.unlink(missing_ok=True)  # errors shown on failure must be this run's
    proc = processes.spawn_detached(daemon_command(cfg), log)
    info = DaemonInfo(
        proc.pid,
        cfg.socket,
        cfg.peers,
        cfg.size,
        cfg.replicas,
        str(log),
        time.time(),
        client_id(cfg),
        cfg.daemon_flags(),
        processes.start_time(proc.pid),
    )
    daemon_path(cfg.state_dir).write_text(json.dumps(asdict(info)) + "\n")
    deadline = time.monotonic() + timeout
    while not os.path.exists(cfg.socket):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text()[-1500:].strip() if log.exists() else ""
            stop_daemon(cfg.state_dir)
            why = "exited" if proc.returncode is not None else f"not ready after {timeout:.0f} s"
            raise ControlError(f"the duvm daemon {why}: {tail or '(no output)'}")
        time.sleep(0.05)
    return info


def stop_daemon(state_dir: Path, timeout: float = 30.0) -> None:
    """SIGTERM the recorded daemon (SIGKILL after `timeout`), then forget it."""
    info = load_daemon(state_dir)
    if info is not None and daemon_alive(info):
        processes.send_signal(info.pid, signal.SIGTERM, info.start)
        if not processes.wait_pid_exit(info.pid, timeout, info.start):
            processes.send_signal(info.pid, signal.SIGKILL, info.start)
            processes.wait_pid_exit(info.pid, 10, info.start)
    daemon_path(state_dir).unlink(missing_ok=True)
    if info is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(info.socket)
        with contextlib.suppress(FileNotFoundError):  # a killed daemon could not remove it
            os.unlink(control_socket.default_path(info.socket))


# --- enable / disable ------------------------------------------------------------------------


def enable(
    cfg: Config, *, resolve_method: Callable[[str], str] = attach.resolve_method
) -> attach_state.Attachment:
    """Start the daemon and attach its export as swap; `resolve_method` picks the block-device
    path for `cfg.method` (attach.resolve_method), before anything starts."""
    systools.require_root()
    cfg.validate()
    method = resolve_method(cfg.method)  # refused before anything starts
    existing = attach_state.load_state(state_path(cfg.state_dir))
    if existing is not None or daemon_alive(load_daemon(cfg.state_dir)):
        where = existing.device if existing and existing.device else "daemon running"
        raise ControlError(
            f"duvm is already enabled ({where}); `duvm status` shows it, "
            "`duvm disable` turns it off"
        )
    unswappable, state_problem = _unswappable_state(cfg)
    extra: dict[str, object] = {}
    if unswappable is not None:
        extra["state_ramfs"] = str(unswappable)  # disable unmounts it
    if state_problem:
        extra["state_problem"] = state_problem
    daemon = None
    try:
        daemon = start_daemon(cfg)
        att = attach.attach(
            daemon.socket,
            state_path(cfg.state_dir),
            run_dir=cfg.state_dir,
            method=method,
            priority=cfg.priority,
            extra={"daemon_pid": daemon.pid, **extra},
            realtime=pressure.realtime_wanted(cfg.daemon_args),
            connections=cfg.workers,  # one per worker: the kernel spreads requests over them
        )
    except BaseException:
        if daemon is not None:
            stop_daemon(cfg.state_dir)
        if unswappable is not None:
            ramfs.release(unswappable)
        raise
    # the daemon's status names its swap device (for gputaskman); a failure is only logged
    control_socket.try_tell_swap_device(control_socket.default_path(daemon.socket), att.device)
    if cfg.supervise and supervisor_process.wanted(att, cfg.daemon_args):
        att.extra["supervise"] = True  # `enable --resume` starts it again after a give-up
        attach_state.save_state(state_path(cfg.state_dir), att)
        pid, problem = supervisor_process.start(cfg.state_dir)
        att.extra["supervisor_pid"] = pid
        if problem:
            att.extra["supervisor_problem"] = problem
    return att


def _unswappable_state(cfg: Config) -> tuple[Path | None, str | None]:
    """Mount a ramfs on the daemon's state directory when it is the one enable chose (a
    directory the user chose is theirs). Returns what was mounted, and why nothing could be."""
    chosen = supervisor_process.state_dir_arg(cfg.daemon_args)
    if chosen is None or chosen.resolve() != daemon_state_dir(cfg.state_dir):
        return None, None
    try:
        return (chosen if ramfs.ensure(chosen) else None), None
    except OSError as exc:
        return None, (
            f"{exc.strerror or exc}: the daemon's state can be swapped out, and a daemon "
            "restarted after a crash may not be able to read it back"
        )


def disable(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    force: bool = False,
    notes: list[str] | None = None,
    detach: Callable[..., attach_state.Attachment | None] = attach.detach,
) -> bool:
    """Swap off, detach, stop the daemon. False when nothing was enabled. What the user should
    know about a device left alone goes to `notes`; `detach` does the swapoff and detach
    (attach.detach)."""
    systools.require_root()
    current = attach_state.load_state(state_path(state_dir))
    daemon = load_daemon(state_dir)
    if (
        current is not None
        and daemon is not None
        and not force
        and not daemon_alive(daemon)
        and supervisor_process.wanted(current, daemon.daemon_args)
    ):
        # swapoff would have to read the pages from a dead daemon: they would be lost
        sup = supervisor_process.alive(supervisor_process.load(state_dir))
        raise ControlError(
            f"the daemon (pid {daemon.pid}) is not running, so swapoff could not bring the "
            f"pages on {current.device} home: "
            + (
                "the supervisor is restarting it; run disable again in a few seconds"
                if sup
                else "run `duvm enable --resume` first (--force detaches anyway, and the "
                "programs whose pages are still out get I/O errors)"
            )
        )
    # The supervisor stays on during the swapoff (a daemon crash then is resumed too) and is
    # stopped before the daemon, whose stop it must not take for a crash.
    att = detach(state_path(state_dir), force=force)  # SwapoffFailed: nothing done
    supervisor_process.stop(state_dir)
    if att is not None and notes is not None and att.extra.get("device_problem"):
        notes.append(
            f"left {att.device} alone (not swapped off, not discarded): "
            f"{att.extra['device_problem']}"
        )
    had_daemon = load_daemon(state_dir) is not None
    stop_daemon(state_dir)
    # A device left alone may still need the state (a later `enable --resume`): keep it then.
    mounted = current.extra.get("state_ramfs") if current is not None else None
    if isinstance(mounted, str) and not (att is not None and att.extra.get("device_problem")):
        ramfs.release(Path(mounted))
    return att is not None or had_daemon


# --- status ----------------------------------------------------------------------------------


def peer_security(daemon_args: list[str], peers: list[str]) -> Any:
    """The `auth.PeerSecurity` the daemon uses with these flags (its own rule,
    `duvm.store.client_flags`), so STATUS requests authenticate like it does.
    ValueError/OSError/SecretError with a reason."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    client_flags.add_client_arguments(parser)
    ns, _ = parser.parse_known_args(daemon_args)
    return client_flags.client_security_from_args(
        ns, [parse_peer(p, MEMSERVER_PORT)[:2] for p in peers]
    )


async def _peer_status(
    peer: str, timeout: float, client: str | None, security: Any
) -> dict[str, Any]:
    from duvm.store.memserver_status import query_status  # the page protocol is only needed here

    host, port, _ = parse_peer(peer, MEMSERVER_PORT)
    try:
        st = await query_status(host, port, timeout=timeout, security=security)
    except Exception as exc:  # unreachable, refused, or a peer that speaks something else
        return {
            "peer": peer,
            "health": "unreachable",
            "error": str(exc),
            "pages": None,
            "capacity_pages": None,
            "our_pages": None,
            "our_reserved_pages": None,
        }
    ours = next((ns for ns in st.get("namespaces", []) if ns.get("client_id") == client), None)
    return {
        "peer": peer,
        "health": "ok",
        "error": None,
        "pages": st.get("used_pages"),
        "reserved_pages": st.get("reserved_pages"),
        "capacity_pages": st.get("capacity_pages"),
        "namespaces": st.get("namespaces_total"),
        "our_pages": ours.get("stored_pages") if ours else (0 if client else None),
        "our_reserved_pages": ours.get("reserved_pages") if ours else (0 if client else None),
        "counters": st.get("counters"),
    }


def peer_statuses(
    peers: list[str], timeout: float = 3.0, client: str | None = None, security: Any = None
) -> list[dict[str, Any]]:
    """STATUS of each peer: totals, and the pages of namespace `client` when given.
    `security` (an `auth.PeerSecurity`) authenticates to memservers that require it."""

    async def gather() -> list[dict[str, Any]]:
        return list(
            await asyncio.gather(*(_peer_status(p, timeout, client, security) for p in peers))
        )

    return asyncio.run(gather()) if peers else []


def daemon_report(daemon: DaemonInfo | None) -> dict[str, Any]:
    """What the daemon's control socket answers (empty when it cannot answer)."""
    if daemon is None or not daemon_alive(daemon):
        return {}
    try:
        return control_socket.query(control_socket.default_path(daemon.socket))
    except (OSError, ValueError):
        return {}


def daemon_health(daemon: DaemonInfo | None) -> dict[str, Any] | None:
    """Replication health from the daemon's control socket (None when it cannot answer)."""
    return daemon_report(daemon).get("store")


def node_status(path: Path = DEFAULT_NODE_CONTROL_SOCKET) -> dict[str, Any] | None:
    """What this node lends (`duvm node`'s control socket); None when no node runs here."""
    if not path.exists():
        return None
    try:
        st = control_socket.query(str(path))
    except (OSError, ValueError) as exc:
        return {"socket": str(path), "running": False, "error": str(exc)}
    keep = (
        "capacity_pages",
        "used_pages",
        "reserved_pages",
        "connections",
        "lease_seconds",
        "namespaces_total",
        "counters",
    )
    return {
        "socket": str(path),
        "running": True,
        "error": None,
        **{k: st.get(k) for k in keep},
        "auth": (st.get("security") or {}).get("auth"),
        "namespaces": [
            {k: ns.get(k) for k in ("client_id", "stored_pages", "reserved_pages", "connections")}
            for ns in st.get("namespaces") or []
            if isinstance(ns, dict)
        ],
    }


def status(
    state_dir: Path = DEFAULT_STATE_DIR, node_socket: Path = DEFAULT_NODE_CONTROL_SOCKET
) -> dict[str, Any]:
    """Everything `duvm status` shows, as plain data (JSON-ready)."""
    att = attach_state.load_state(state_path(state_dir))
    daemon = load_daemon(state_dir)
    entry = kernel_swap.swap_entry(att.device) if att and att.device else None
    peers = daemon.peers if daemon else []
    security, security_error = None, None
    if daemon is not None and peers:
        try:
            security = peer_security(daemon.daemon_args, peers)
        except (ValueError, OSError, auth.SecretError) as exc:  # said with each peer
            security_error = f"cannot authenticate as the daemon does: {exc}"
    peer_list = peer_statuses(peers, client=daemon.client_id if daemon else None, security=security)
    report = daemon_report(daemon)
    if security_error:
        for p in peer_list:
            p["error"] = f"{p['error']} ({security_error})" if p["error"] else security_error
    _add_transports(peer_list, (report.get("store") or {}).get("peers") or [])
    return {
        "enabled": att is not None and entry is not None,
        "state_dir": str(state_dir),
        "method": att.method if att else None,
        "device": att.device if att else None,
        "path": (att.fuse_file or att.nbd_device) if att else None,
        "socket": att.socket if att else (daemon.socket if daemon else None),
        "size_bytes": att.size_bytes if att else None,
        "swap": None
        if entry is None
        else {
            "size_bytes": entry.size_kb * 1024,
            "used_bytes": entry.used_kb * 1024,
            "priority": entry.priority,
        },
        "daemon": None
        if daemon is None
        else {
            "pid": daemon.pid,
            "running": daemon_alive(daemon),
            "log": daemon.log,
            "replicas": daemon.replicas,
            "request_path": report.get("request_path"),
            "swap_device": report.get("swap_device"),
            # the supervisor's request-timer guard it holds (duvm.wire.nbdguard)
            "timer_guard": report.get("timer_guard"),
            "workers": report.get("workers"),  # pids, worker 0 first; None with one
        },
        "connections": att.connections if att else None,
        "supervisor": supervisor_process.status(state_dir),
        "standby": supervisor_process.standby_status(state_dir),
        "min_free_kbytes": {"before": att.min_free_before, "set": att.min_free_set}
        if att
        else None,
        "watermark_boost_factor": {
            "before": att.watermark_boost_before,
            "set": att.watermark_boost_set,
        }
        if att
        else None,
        "client_id": daemon.client_id if daemon else None,
        "replication": report.get("store"),
        "peers": peer_list,
        "node": node_status(node_socket),
    }


def _add_transports(peer_list: list[dict[str, Any]], daemon_peers: list[Any]) -> None:
    """Each peer's transport as the daemon reports it (None where the daemon does not say)."""
    by_addr = {p.get("peer"): p for p in daemon_peers if isinstance(p, dict)}
    for p in peer_list:
        host, port, asked = parse_peer(p["peer"], MEMSERVER_PORT)
        d = by_addr.get(f"{host}:{port}", {})
        p["transport"] = {
            "asked": asked,
            "in_use": d.get("transport_in_use"),
            "rdma_device": d.get("rdma_device"),
            "rdma_error": d.get("rdma_error"),
        }


def _transport_text(t: dict[str, Any] | None) -> str:
    if not t or t.get("in_use") is None:
        return ""
    if t["in_use"] == "rdma":
        return f", by RDMA ({t.get('rdma_device')})"
    why = f" (RDMA: {t['rdma_error']})" if t.get("asked") != "tcp" and t.get("rdma_error") else ""
    return f", by TCP{why}"


def _guard_text(g: dict[str, Any]) -> str:
    """The daemon's request-timer guard (duvm.wire.nbdguard) as one status line."""
    who, fired = f"supervisor pid {g.get('supervisor_pid')}", g.get("fired")
    if g.get("watching"):
        return f"request timer: quick requeue while {who} watches (restored if it is killed)"
    if fired == "restored":
        return f"request timer: the kernel's again ({who} ended; the daemon restored it)"
    return f"request timer: {who} ended, not restored: {fired}" if fired else ""


def format_status(st: dict[str, Any]) -> str:
    def mib(n: int | None) -> str:
        return "n/a" if n is None else f"{n / (1 << 20):.1f} MiB"

    lines = [f"duvm: {'enabled' if st['enabled'] else 'not enabled'}"]
    if st["device"]:
        lines.append(f"device: {st['device']} via {st['method']} ({st['path']})")
    if st["swap"]:
        s = st["swap"]
        lines.append(
            f"swap: {mib(s['used_bytes'])} used of {mib(s['size_bytes'])}, priority {s['priority']}"
        )
    elif st["device"]:
        lines.append("swap: not active on the device")
    if st["daemon"]:
        d = st["daemon"]
        lines.append(
            f"daemon: pid {d['pid']} {'running' if d['running'] else 'NOT RUNNING'} "
            f"(log {d['log']}), request path {d.get('request_path') or 'n/a'}"
        )
        if w := d.get("workers"):  # several: pids, worker 0 first
            lines.append(f"workers: pids {' '.join(map(str, w))}, connections {st['connections']}")
        if (guard := d.get("timer_guard")) and (text := _guard_text(guard)):
            lines.append(text)
    sup = st.get("supervisor")
    if sup:
        lines.append(
            f"supervisor: pid {sup['pid']} "
            f"{'running' if sup['running'] else 'NOT RUNNING'} (log {sup['log']})"
            + (f"; gave up at {sup['gave_up']}" if sup.get("gave_up") else "")
        )
    if sb := st.get("standby"):
        lines.append(supervisor_process.standby_line(sb))
    r = st.get("replication")
    if r:
        rep = (
            "; ".join(
                f"slab {x['slab']} to {x['target']} {x['copied_pages']}/{x['total_pages']} pages"
                for x in r["repairing"]
            )
            or "none running"
        )
        done = r.get("repairs_done", "n/a")
        lines.append(
            f"replication: R={r['replicas']}, {r['degraded_slabs']} of {r['slabs']} "
            f"slabs degraded, repairs done {done} "
            f"(now: {rep}), failovers {r['failovers']}, checksum failures "
            f"{r['checksum_failures']}, pages lost {r['pages_lost_now']}"
        )
    elif st["daemon"]:
        lines.append("replication: n/a (the daemon's control socket does not answer)")
    for p in st["peers"]:

        def n(v: int | None) -> str:
            return "n/a" if v is None else str(v)

        extra = f" ({p['error']})" if p["error"] else ""
        lines.append(
            f"peer {p['peer']}: {p['health']}{_transport_text(p.get('transport'))}, "
            f"ours {n(p['our_pages'])} pages "
            f"({n(p['our_reserved_pages'])} reserved), all clients "
            f"{n(p['pages'])} of {n(p['capacity_pages'])}{extra}"
        )
    node = st.get("node")
    if node is not None and not node["running"]:
        lines.append(f"node: control socket {node['socket']} does not answer ({node['error']})")
    elif node is not None:

        def pages(v: object) -> str:
            return f"{v * 4096 >> 20} MiB" if isinstance(v, int) else "n/a"

        lines.append(
            f"node: lends {pages(node['used_pages'])} in use, "
            f"{pages(node['reserved_pages'])} reserved of {pages(node['capacity_pages'])}"
            f" to {node['namespaces_total']} client(s), {node['connections']} "
            f"connection(s), auth {node['auth'] or 'n/a'}"
        )
        for ns in node["namespaces"]:
            lines.append(
                f"  client {ns['client_id']}: {ns['stored_pages']} pages stored, "
                f"{ns['reserved_pages']} reserved"
            )
    if not st["enabled"] and not st["device"] and not st["daemon"]:
        lines.append(
            "to enable: sudo duvm enable --config /etc/duvm/duvm.toml (or --peers HOST:PORT,... "
            "--size SIZE); sudo duvm doctor checks what it needs first"
        )
    return "\n".join(lines)
