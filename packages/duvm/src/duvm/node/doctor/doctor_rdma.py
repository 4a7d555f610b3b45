"""`duvm doctor`'s RDMA checks, for peers named `rdma://` or `auto://`: the compiled verbs
transport, a verbs device with an active port, the locked-memory limit that memory
registration needs, and each such peer's rdma-cm listener. Required for `rdma://` peers (their
pages move by RDMA or not at all); warnings for `auto://` ones (they fall back to TCP)."""

from __future__ import annotations

import resource
from collections.abc import Callable

from duvm.base.units import parse_peer
from duvm.node.doctor.doctor_check import FAIL, OK, SKIP, WARN, Check, Options
from duvm.node.lifecycle.control import MEMSERVER_PORT
from duvm.rdma import verbs
from duvm.store.rdma_link import STAGING_PAGES

_DEVICE_FIX = (
    "load the NIC's RDMA driver, or for Soft-RoCE: modprobe rdma_rxe && "
    "rdma link add rxe0 type rxe netdev IFACE (iproute2); check with ibv_devinfo"
)
_MEMLOCK_FIX = (
    "run the daemon as root or with CAP_IPC_LOCK, or raise its memlock limit "
    "(systemd: LimitMEMLOCK=infinity; shell: ulimit -l unlimited)"
)


def rdma_peers(opts: Options) -> tuple[list[tuple[str, int, str, str]], bool]:
    """The peers that ask for RDMA, as (text, host, port, transport), and whether any must
    have it (`rdma://`)."""
    out = []
    for p in opts.peers:
        try:
            host, port, transport = parse_peer(p, MEMSERVER_PORT)
        except ValueError:
            continue  # the peers check says so
        if transport != "tcp":
            out.append((p, host, port, transport))
    return out, any(t == "rdma" for *_, t in out)


def _check(name: str, ok: bool, required: bool, detail: str, fix: str | None = None) -> Check:
    if ok:
        return Check(name, OK, required, detail)
    return Check(name, FAIL if required else WARN, required, detail, fix)


def check_rdma(opts: Options, timeout: float | None = None) -> list[Check]:
    peers, required = rdma_peers(opts)
    if not peers:
        return [Check("rdma", SKIP, False, "no peer asks for RDMA (rdma:// or auto://)")]
    state = verbs.state()
    if state != "compiled":
        return [_check("rdma", False, required, f"the RDMA transport is {state}", verbs.BUILD_FIX)]
    devices, why = verbs.usable_devices()
    checks = [
        _check(
            "rdma",
            bool(devices),
            required,
            f"verbs device(s) with an active port: {', '.join(devices)}" if devices else why,
            _DEVICE_FIX,
        ),
        check_memlock(len(peers), required),
    ]
    if not devices:
        return checks
    problems, good = [], []
    for text, host, port, _ in peers:
        ok, detail = verbs.probe(host, port, timeout or opts.peer_timeout)
        (good if ok else problems).append(f"{text}: {detail}")
    checks.append(
        _check(
            "rdma-peers",
            not problems,
            required,
            "; ".join(problems + good),
            "start the memservers with --rdma on (or auto with a verbs device), and check the "
            "route to them over the RDMA NIC (rping -c -a HOST)",
        )
    )
    return checks


CAP_IPC_LOCK = 14


def has_ipc_lock(status: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_IPC_LOCK (its effective set in /proc/self/status)."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_limit() -> int:
    """This process's soft locked-memory limit in bytes (`resource.RLIM_INFINITY`: none)."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def check_memlock(
    npeers: int,
    required: bool,
    limit: Callable[[], int] = memlock_limit,
    ipc_lock: Callable[[], bool] = has_ipc_lock,
) -> Check:
    """Registering memory pins it: the daemon's staging buffers (one per RDMA peer) must fit
    its locked-memory limit, unless it may lock any amount (root, CAP_IPC_LOCK). `limit` and
    `ipc_lock` read the two facts judged (this process's, by default)."""
    need = npeers * STAGING_PAGES * 4096
    soft = limit()
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", OK, required, "no locked-memory limit")
    if ipc_lock():
        return Check("memlock", OK, required, "CAP_IPC_LOCK: memory may be locked without limit")
    return _check(
        "memlock",
        soft >= need,
        required,
        f"locked-memory limit {soft >> 20} MiB; RDMA staging needs {need >> 20} MiB "
        f"({npeers} peer(s))",
        _MEMLOCK_FIX,
    )
